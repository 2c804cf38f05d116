"""Shared test setup: Triton's interpreter on CPU, the location of ../shared."""
import gzip
import os
import pathlib
import shutil

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
