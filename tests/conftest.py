"""Shared test setup: Triton's interpreter on CPU, the location of ../shared."""
import gzip
import os
import pathlib
import shutil
from typing import Any

import pytest
import torch
from hypothesis import settings

# Must be set before any module that defines @triton.jit kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Before any test uses transformers: `import ember` keeps the checkout's `kernels/` folder (the checkout's root is on
# sys.path under pytest) from shadowing the `kernels` package transformers imports.
import ember  # noqa: E402,F401

# The suite's models are tiny: torch's intra-op threads only contend with each other and with the server and
# engine threads the tests start (measured up to 20x slower on 2 cores), so every test runs torch on one thread.
torch.set_num_threads(1)

# CI replays the same property-test examples on every run, so a submission's result does not depend on the draw;
# local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
SHARED_DATA = SHARED / "data"


def shared_path(*parts: str) -> pathlib.Path:
    """Path under ../shared/data, skipping the calling test where it is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"../shared/data/{'/'.join(parts)} is absent")
    return p


def write_shared_tokenizer(family: str, out: pathlib.Path, extra: tuple[str, ...] = ()) -> pathlib.Path:
    """A loadable folder holding ../shared/data/tokenizers/<family>: tokenizer.json gunzipped beside
    tokenizer_config.json (and the ``extra`` files); skips the calling test where it is absent."""
    src = shared_path("tokenizers", family)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes(gzip.decompress((src / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", *extra):
        shutil.copy(src / name, out / name)
    return out


def save_with_tokenizer(model, path: pathlib.Path, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """``model`` (a transformers model) saved as a checkpoint folder with the tokenizer of ``tokenizer_dir``."""
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def save_tiny_qwen3(path: pathlib.Path, tokenizer_dir: pathlib.Path, seed: int, head: str = "ForCausalLM",
                    **config) -> pathlib.Path:
    """A 2-layer random Qwen3 checkpoint (GQA 4/2, head_dim 16, 1280-token vocabulary) saved into ``path`` with the
    tokenizer files of ``tokenizer_dir`` (the demo model's); ``head`` picks the transformers class
    (``Qwen3<head>``); ``config`` overrides Qwen3Config fields."""
    import transformers
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                initializer_range=0.1, tie_word_embeddings=False), **config})
    return save_with_tokenizer(getattr(transformers, f"Qwen3{head}")(cfg), path, tokenizer_dir)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> pathlib.Path:
    """The built-in demo model, built once per test session."""
    from ember.engine import demo

    path = tmp_path_factory.mktemp("demo-model")
    demo.build(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, demo_model_dir) -> pathlib.Path:
    """A 2-layer random Qwen3 (q/k norms) for the tests that run the engine on the CUDA path's kernels."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), demo_model_dir, seed=7, intermediate_size=96)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, demo_model_dir) -> pathlib.Path:
    """A random Gemma 3 (zero-centred norms, sliding windows, GELU-tanh MLP)."""
    from tests.engine.test_gemma3 import save_tiny_gemma3

    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), demo_model_dir, seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory, demo_model_dir) -> pathlib.Path:
    """A random 4-layer Qwen3-Next (2 linear-attention, 2 gated-attention layers, MoE)."""
    from transformers import Qwen3NextForCausalLM

    from tests.moe.conftest import save_hybrid
    from tests.moe.test_qwen3_next import tiny_next_config

    torch.manual_seed(3)
    return save_hybrid(Qwen3NextForCausalLM(tiny_next_config()), tmp_path_factory.mktemp("tiny-qwen3-next"),
                       demo_model_dir)


def greedy_with_logits(path: pathlib.Path, monkeypatch, row_ops: str, attention: str,
                       kv_cache_dtype: str | None = None) -> tuple[Any, dict[str, list[int]], list[torch.Tensor]]:
    """The engine (fp32, CPU) on ``row_ops`` / ``attention`` kernels (``triton``: the CUDA path's, interpreted):
    three greedy requests of 6 tokens, one longer than a step's budget (chunked, mixed with decodes) and one reusing
    its cached prefix; returns the engine, each request's tokens and every step's logits."""
    from ember.engine.engine import Engine
    from ember.engine.params import SamplingParams

    monkeypatch.setenv("EMBER_ROW_OPS", row_ops)
    monkeypatch.setenv("EMBER_ATTENTION", attention)
    extra = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
    eng = Engine.from_pretrained(path, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                                 num_kv_blocks=32, dtype="float32", device="cpu", **extra)
    logits: list[torch.Tensor] = []
    execute = eng.runner.execute
    eng.runner.execute = lambda out, *carried: logits.append(execute(out, *carried).clone()) or logits[-1]
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 1270, (9,), generator=g).tolist()
    prompts = {"a": shared + torch.randint(0, 1270, (12,), generator=g).tolist(), "b": [5, 9, 11],
               "c": shared + [40]}
    out: dict[str, list[int]] = {k: [] for k in prompts}
    for rid, ids in prompts.items():
        eng.add_request(ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), request_id=rid)
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
    return eng, out, logits


def tensor_parallel_workers() -> list:
    """This process's live tensor-parallel worker processes (not the engine processes of servers other tests keep
    running)."""
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("ember-tp-worker")]
