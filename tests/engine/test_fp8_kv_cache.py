"""FP8 (e4m3) KV cache: ``kv_cache_dtype="fp8"`` allocates an e4m3 cache that takes half the bytes, the
checkpoint's per-layer k/v scales (ModelOpt's ``k_proj.k_scale`` / ``v_proj.v_scale`` or the older
``self_attn.k_scale``) reach the attention backend (1.0 where absent), greedy decoding stays within FP8 rounding
of the full-precision cache, and two tensor-parallel ranks (each caching its KV heads in e4m3 under the same
scales) decode what one process does."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.engine.attention import TorchBackend
from ember.engine.config import ConfigError
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3, tensor_parallel_workers

SCALES = {"model.layers.0.self_attn.k_proj.k_scale": 0.5, "model.layers.0.self_attn.v_proj.v_scale": 0.25,
          "model.layers.1.self_attn.k_scale": 2.0}


def _save(path, demo_model_dir, extra: dict[str, float]) -> None:
    save_tiny_qwen3(path, demo_model_dir, seed=5)
    if extra:
        tensors = load_file(path / "model.safetensors")
        tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in extra.items()})
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, demo_model_dir):
    path = tmp_path_factory.mktemp("fp8-plain")
    _save(path, demo_model_dir, {})
    return path


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory, demo_model_dir):
    path = tmp_path_factory.mktemp("fp8-scaled")
    _save(path, demo_model_dir, SCALES)
    return path


def _engine(path, **kw) -> Engine:
    opts = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=32, dtype="float32",
                device="cpu")
    return Engine.from_pretrained(path, **(opts | kw))


class _Recording(TorchBackend):
    """The CPU backend, noting the scales each KV write and attention call receives."""

    calls: list[tuple[str, float | None, float | None]] = []

    @staticmethod
    def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        _Recording.calls.append(("write", k_scale, v_scale))
        TorchBackend.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def paged_attention(q, k_cache, v_cache, out, cu, seq_lens, table, max_q, max_k, scale, k_scale=None,
                        v_scale=None, **kw):
        _Recording.calls.append(("read", k_scale, v_scale))
        return TorchBackend.paged_attention(q, k_cache, v_cache, out, cu, seq_lens, table, max_q, max_k, scale,
                                            k_scale, v_scale, **kw)


def test_checkpoint_kv_scales_reach_the_backend(scaled_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    eng = _engine(scaled_dir, kv_cache_dtype="fp8")
    attn = [layer.self_attn for layer in eng.runner.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [(0.5, 0.25), (2.0, 1.0)]
    assert all(k.dtype == torch.float8_e4m3fn and v.dtype == torch.float8_e4m3fn for k, v in eng.runner.kv_caches)
    eng.runner.backend = _Recording
    _Recording.calls = []
    eng.add_request([3, 1, 4, 1, 5], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    per_step = [("write", 0.5, 0.25), ("read", 0.5, 0.25), ("write", 2.0, 1.0), ("read", 2.0, 1.0)]
    assert _Recording.calls == per_step * 2

    auto = _engine(scaled_dir)  # the scales load, but a full-precision cache ignores them
    assert auto.runner.kv_caches[0][0].dtype == torch.float32
    auto.runner.backend = _Recording
    _Recording.calls = []
    auto.add_request([3, 1, 4], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    auto.step()
    assert {c[1:] for c in _Recording.calls} == {(None, None)}


KV_ONLY = {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
           "config_groups": {}, "ignore": ["lm_head"],
           "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                               "symmetric": True}}


def test_a_compressed_tensors_config_of_only_kv_cache_scales_loads_them(tmp_path, demo_model_dir, monkeypatch):
    """llm-compressor's FP8 KV cache without weight quantization (no config group, a kv_cache_scheme): the weights
    load as they are and the scales reach the cache, as vLLM reads it; a KV scheme Ember has no cache for is named."""
    import json

    from ember.engine.nvfp4_loading import QuantizationError

    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    _save(tmp_path, demo_model_dir, SCALES)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": KV_ONLY}))
    eng = _engine(tmp_path, kv_cache_dtype="fp8", quantization="compressed-tensors")
    assert [(a.self_attn.k_scale, a.self_attn.v_scale) for a in eng.runner.model.model.layers] == [(0.5, 0.25),
                                                                                                    (2.0, 1.0)]
    int8 = {**KV_ONLY, "kv_cache_scheme": {**KV_ONLY["kv_cache_scheme"], "type": "int"}}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": int8}))
    with pytest.raises(QuantizationError, match="kv_cache_scheme .* is not supported"):
        _engine(tmp_path, kv_cache_dtype="fp8")


def test_fp8_cache_is_half_the_bytes_and_bad_settings_are_refused(plain_dir):
    full = _engine(plain_dir, num_kv_blocks=None, kv_cache_memory=1 << 20)
    fp8 = _engine(plain_dir, num_kv_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    assert fp8.kv.num_blocks == 4 * full.kv.num_blocks  # fp32 model: 4 bytes per element vs 1
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _engine(plain_dir, kv_cache_dtype="int4")


def test_a_kv_scale_outside_attention_is_named(tmp_path, demo_model_dir):
    _save(tmp_path, demo_model_dir, {"model.layers.0.mlp.k_scale": 1.0})
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model.layers.0.mlp.k_scale'"):
        _engine(tmp_path)


def _greedy(eng: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    execute = eng.runner.execute

    def spy(out, *carried):
        lg = execute(out, *carried)
        logits.append(lg.clone())
        return lg

    eng.runner.execute = spy
    rids = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[r] for r in rids], logits


@pytest.mark.parametrize("which", ["plain", "scaled"])
def test_fp8_greedy_decoding_stays_close_to_the_full_precision_cache(which, plain_dir, scaled_dir, monkeypatch):
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    path = plain_dir if which == "plain" else scaled_dir
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1270, (n,), generator=g).tolist() for n in (7, 19, 40)]
    want, want_logits = _greedy(_engine(path), prompts)
    got, got_logits = _greedy(_engine(path, kv_cache_dtype="fp8"), prompts)
    # greedy tokens agree until a near-tie flips (if ever); until then each step's logits are within FP8 rounding
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(got, want)]
    assert min(agree) >= 3 and sum(agree) >= 0.75 * sum(len(y) for y in want), (got, want)
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(got_logits, want_logits)][: 1 + min(agree)]
    assert 0 < max(errs) < 0.1, errs  # e4m3 keeps 3 mantissa bits: about 3.6% RMS rounding of K and V


def test_two_ranks_with_an_fp8_cache_decode_what_one_process_does(scaled_dir, monkeypatch):

    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1270, (n,), generator=g).tolist() for n in (5, 23, 40)]
    want, _ = _greedy(_engine(scaled_dir, kv_cache_dtype="fp8"), prompts)
    eng = _engine(scaled_dir, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        k, v = eng.runner.kv_caches[0]
        assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape[2] == 1  # this rank's 1 of the 2 KV heads
        assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in eng.runner.model.model.layers] \
            == [(0.5, 0.25), (2.0, 1.0)]
        got, _ = _greedy(eng, prompts)
    finally:
        eng.shutdown()
    assert got == want
    assert not tensor_parallel_workers()
