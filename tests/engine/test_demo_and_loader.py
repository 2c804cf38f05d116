"""The built-in demo checkpoint (deterministic, Qwen3 special tokens, chat template) and checkpoint loading errors."""
from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.engine import demo
from ember.engine.config import ConfigError
from ember.engine.engine import Engine
from ember.engine.loader import CheckpointError
from ember.engine.params import SamplingParams
from tests.conftest import write_shared_tokenizer


def _digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_demo_build_is_byte_for_byte_reproducible(tmp_path, demo_model_dir):
    again = demo.build(tmp_path / "again")
    assert _digest(again) == _digest(demo_model_dir)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(_digest(again))


def test_demo_tokenizer_has_qwen3_delimiters_as_single_tokens(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    assert 1000 <= len(tok) <= 2000
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        ids = tok.encode(f"x{t}y", add_special_tokens=False)
        assert tok.convert_tokens_to_ids(t) in ids, t
    assert tok.eos_token == "<|im_end|>"
    specials = set(tok.all_special_tokens)
    assert "<|im_end|>" in specials and "<think>" not in specials and "<tool_call>" not in specials
    text = 'def f(x):\n    return {"a": [1, 2]}  # héllo'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_demo_chat_template_is_qwen3_shaped(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_ensure_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    assert demo.default_path() == tmp_path / "cache" / "demo"
    p = demo.ensure()
    stamp = (p / "model.safetensors").stat().st_mtime_ns
    assert demo.ensure() == p and (p / "model.safetensors").stat().st_mtime_ns == stamp


def test_engine_exposes_model_facts(demo_model_dir):
    eng = Engine.from_pretrained(demo_model_dir, num_kv_blocks=32)
    assert eng.vocab_size == 1280 and eng.model_config.architecture == "Qwen3ForCausalLM"
    assert eng.max_model_len == 4096
    assert eng.eos_token_ids == {eng.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}


def test_sharded_checkpoint_loads_identically(tmp_path, demo_model_dir):
    sharded = tmp_path / "sharded"
    shutil.copytree(demo_model_dir, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    toks = []
    for path in (demo_model_dir, sharded):
        eng = Engine.from_pretrained(path, num_kv_blocks=16)
        eng.add_request([3, 4, 5], params)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.new_token_ids]
        toks.append(out)
    assert toks[0] == toks[1] and len(toks[0]) == 6


def test_clear_errors_name_the_file(tmp_path, demo_model_dir):
    with pytest.raises(CheckpointError, match="not a directory"):
        Engine.from_pretrained(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(demo_model_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Engine.from_pretrained(broken)

    odd = tmp_path / "odd"
    shutil.copytree(demo_model_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json.*MambaForCausalLM"):
        Engine.from_pretrained(odd)

    partial = tmp_path / "partial"
    shutil.copytree(demo_model_dir, partial)
    tensors = load_file(partial / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"))
    with pytest.raises(ConfigError, match="gate_up_proj"):
        Engine.from_pretrained(partial)
    (partial / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        Engine.from_pretrained(partial)


@pytest.mark.parametrize("edit,error", [
    ({"num_attention_heads": -4}, "config.json: num_attention_heads must be a positive integer, got -4"),
    ({"max_position_embeddings": 0}, "config.json: max_position_embeddings must be a positive integer, got 0"),
    ({"architectures": "Qwen3ForCausalLM"}, "config.json: 'architectures' must be a list of class names"),
    ({"layer_types": ["full_attention"]}, "config.json: transformers cannot read it"),
])
def test_a_bad_config_value_is_named_in_config_json(tmp_path, demo_model_dir, edit, error):
    """A size that is not a positive integer or a config transformers refuses is an error naming config.json, not a
    torch error deep in the model's build nor a failure blamed on the tokenizer files."""
    from ember.engine.checkpoint import load_tokenizer
    from ember.engine.loader import load_model_config

    bad = tmp_path / "bad"
    shutil.copytree(demo_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises((ConfigError, CheckpointError), match=re.escape(error)):
        load_model_config(bad)
        load_tokenizer(bad)


@pytest.mark.parametrize("family", ["deepseek-v3", "qwen3"])
def test_a_prompt_gets_the_bos_its_tokenizer_config_asks_for(tmp_path, family):
    """DeepSeek V3's tokenizer_config.json sets add_bos_token (its tokenizer.json does not add it): a completion
    prompt starts with the BOS, as with transformers 4 and vLLM; a chat prompt (its template writes the BOS) and
    Qwen3 (no BOS) get none added."""
    from ember.engine.checkpoint import load_tokenizer

    tok = load_tokenizer(write_shared_tokenizer(family, tmp_path / family))
    text_ids = tok.encode("Hi", add_special_tokens=False)
    expected = [tok.bos_token_id] * (family == "deepseek-v3") + text_ids
    assert tok("Hi")["input_ids"] == tok.encode("Hi") == expected
    assert tok.encode("Hi", add_special_tokens=False) == text_ids


def test_rope_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import LlamaConfig

    from ember.engine.models.layers import rope_inv_freq

    cases = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ]
    for scaling in cases:
        cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                          rope_parameters=dict(scaling, rope_theta=10000.0))
        ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
        ours, scale = rope_inv_freq(64, 10000.0, scaling, 256)
        torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-7)
        assert scale == pytest.approx(ref_scale)


def _copy(demo_model_dir, path, edit_config=None):
    shutil.copytree(demo_model_dir, path)
    if edit_config is not None:
        cfg = json.loads((path / "config.json").read_text())
        edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("form", ["string", "named-list"])
def test_a_chat_template_only_in_chat_template_json_is_used(tmp_path, demo_model_dir, form):
    from ember.engine.checkpoint import load_tokenizer

    path = _copy(demo_model_dir, tmp_path / "m")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_cfg.pop("chat_template").replace("<|im_start|>", "<|im_start|>JSON:")
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    value = template if form == "string" else [{"name": "default", "template": template},
                                               {"name": "tool_use", "template": "TOOLS"}]
    (path / "chat_template.json").write_text(json.dumps({"chat_template": value}))
    tok = load_tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>JSON:user\nhi")
    (path / "chat_template.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(CheckpointError, match=r"chat_template\.json: 'chat_template' must be"):
        load_tokenizer(path)


def test_an_unknown_config_dtype_does_not_stop_loading(tmp_path, demo_model_dir):
    from ember.engine.loader import load_model_config

    def set_dtype(key, value):
        return lambda c: (c.pop("torch_dtype"), c.update({key: value}))

    path = _copy(demo_model_dir, tmp_path / "fp8", set_dtype("torch_dtype", "float8_e4m3fn"))
    assert Engine.from_pretrained(path, num_kv_blocks=8).dtype == torch.float32
    for i, value in enumerate(["auto", "int8", "float64"]):
        for key in ("torch_dtype", "dtype"):
            assert load_model_config(_copy(demo_model_dir, tmp_path / f"{key}{i}", set_dtype(key, value))
                                     ).torch_dtype is None
    path = _copy(demo_model_dir, tmp_path / "bf16", set_dtype("dtype", "bfloat16"))
    assert load_model_config(path).torch_dtype == torch.bfloat16


@pytest.mark.parametrize("content, reason", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n", "git-lfs pointer.*git lfs pull"),
    (b"\x00" * 100, "cannot read safetensors"),
    (b"\xff" * 100, "cannot read safetensors"),
])
def test_an_unreadable_weight_file_is_named(tmp_path, demo_model_dir, content, reason):
    from ember.engine.loader import iter_weights

    path = _copy(demo_model_dir, tmp_path / "m")
    (path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{reason}"):
        Engine.from_pretrained(path, num_kv_blocks=8)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{reason}"):
        list(iter_weights(path))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{reason}"):
        Engine.from_pretrained(path, num_kv_blocks=8, quantization="fp8")


def test_a_tensor_twice_or_a_missing_fused_part_is_named(tmp_path, demo_model_dir):
    tensors = load_file(demo_model_dir / "model.safetensors")
    dup = "model.layers.0.self_attn.v_proj.weight"
    path = _copy(demo_model_dir, tmp_path / "dup")
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "a.safetensors"))
    save_file({dup: tensors[dup]}, str(path / "b.safetensors"))
    weight_map = {**{k: "a.safetensors" for k in tensors}, dup: "b.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError, match=rf"tensor '{dup}' appears more than once"):
        Engine.from_pretrained(path, num_kv_blocks=8)

    path = _copy(demo_model_dir, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != dup}, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"missing tensor\(s\) '{dup}' \(for parameter "
                                          r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'\)"):
        Engine.from_pretrained(path, num_kv_blocks=8)


@pytest.mark.parametrize("edit, said", [
    ({"rope_theta": 0.0}, "rope_theta must be a positive number, got 0.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor must be a positive number, got 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 64}},
     "rope_scaling.factor must be a positive number, got -2.0")])
def test_a_rope_that_would_make_every_logit_nan_is_refused_by_name(tmp_path, demo_model_dir, edit, said):
    """It started and answered every request from NaN logits."""
    path = _copy(demo_model_dir, tmp_path / "m", lambda c: c.update(edit))
    with pytest.raises(ConfigError, match=re.escape(said)):
        Engine.from_pretrained(path, num_kv_blocks=8)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_an_integer_weight_in_an_unquantized_checkpoint_is_refused_by_name(tmp_path, demo_model_dir, dtype):
    """It was cast to float and served: a quantized export without its quantization_config answered nonsense."""
    tensors = load_file(demo_model_dir / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = torch.ones_like(tensors[name], dtype=dtype)
    path = _copy(demo_model_dir, tmp_path / "m")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"tensor '{re.escape(name)}' is {str(dtype)[6:]}, not floating point"):
        Engine.from_pretrained(path, num_kv_blocks=8)


_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"], "config_groups": {
    "group_0": {"targets": ["Linear"], "input_activations": None,
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
_W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"], "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}


@pytest.mark.parametrize("qc, scheme", [
    (_W4A16, r"format 'pack-quantized'; weights int 4-bit group"),
    (_W8A8, r"format 'int-quantized'; weights int 8-bit channel, input_activations int 8-bit token"),
])
def test_an_unsupported_compressed_tensors_scheme_is_named(tmp_path, demo_model_dir, qc, scheme):
    from ember.engine.nvfp4_loading import QuantizationError

    path = _copy(demo_model_dir, tmp_path / "m", lambda c: c.update(quantization_config=qc))
    with pytest.raises(QuantizationError, match=rf"config\.json:quantization_config: compressed-tensors scheme "
                                                rf"\({scheme}\) is not supported; .*compressed-tensors FP8.*mxfp4"):
        Engine.from_pretrained(path, num_kv_blocks=8)


@pytest.mark.parametrize("sidecar, body, method", [
    ("quantize_config.json", {"bits": 4, "group_size": 128, "desc_act": False}, "gptq"),  # AutoGPTQ (TheBloke's)
    ("quant_config.json", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}, "awq"),
    ("quantize_config.json", {"bits": 4, "quant_method": "gptq_marlin"}, "gptq_marlin")])
def test_a_method_declared_only_in_a_sidecar_file_is_named(tmp_path, demo_model_dir, sidecar, body, method):
    """It was an "unexpected tensor" error about the first qweight/g_idx, naming no method."""
    from ember.engine.nvfp4_loading import QuantizationError

    path = _copy(demo_model_dir, tmp_path / "m")
    (path / sidecar).write_text(json.dumps(body))
    with pytest.raises(QuantizationError, match=rf"{sidecar}: quant_method '{method}' is not supported"):
        Engine.from_pretrained(path, num_kv_blocks=8)


def test_a_checkpoint_json_file_that_is_not_utf8_is_named(tmp_path):
    """It was a bare UnicodeDecodeError, naming no file."""
    from ember.engine.checkpoint import CheckpointError, read_json

    path = tmp_path / "model.safetensors.index.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: not UTF-8 text \(invalid start byte at "
                                              r"byte 0\)"):
        read_json(path)
