"""config.json files as the Hub ships them (transformers-4 diff form, hand-trimmed multimodal text configs, stray
keys) load into what transformers builds from the same folder: the tie and field defaults of each architecture's
config class, Gemma's GELU-tanh under ``hidden_act``, a ``sliding_window`` only where transformers' model applies
one, and RoPE's ``original_max_position_embeddings`` as transformers resolves it. Each tiny random checkpoint is
saved by transformers, its config.json edited to the Hub's form, and Ember's prefill logits compared with
transformers' forward on that folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember.engine.config import ModelConfig
from ember.engine.models import MODEL_REGISTRY
from ember.engine.models.layers import sliding_windows
from tests.moe.conftest import assert_prefill_logits_match_transformers, save_with_tokenizer

BASE = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)


def _tiny(path: Path, tokenizer_dir: Path, model_cls: str, config_cls: str, seed: int = 0, **over) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **over}))
    return save_with_tokenizer(model, path, tokenizer_dir)


def _edit(path: Path, fn) -> Path:
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))
    return path


def _drop(*keys):
    def fn(cfg):
        for k in keys:
            cfg.pop(k, None)
    return fn


# -- tie_word_embeddings and Gemma's activation -------------------------------------------------------------------

_GEMMA = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)


@pytest.mark.parametrize("case", ["gemma2-hidden-act", "gemma2-no-tie-key", "gemma3-no-tie-key", "smollm3-no-tie-key"])
def test_hub_form_configs_load_and_match_transformers(case, tmp_path, demo_model_dir):
    if case == "gemma2-hidden-act":  # google/gemma-2-2b's config.json has both keys
        path = _tiny(tmp_path, demo_model_dir, "Gemma2ForCausalLM", "Gemma2Config", **_GEMMA)
        _edit(path, lambda c: c.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"))
    elif case.startswith("gemma"):  # transformers 4 leaves out a tie equal to the class default (tied)
        name = "Gemma2" if case.startswith("gemma2") else "Gemma3"
        path = _tiny(tmp_path, demo_model_dir, f"{name}ForCausalLM", f"{name}Config" if name == "Gemma2" else
                     "Gemma3TextConfig", **_GEMMA)
        _edit(path, _drop("tie_word_embeddings"))
    else:
        path = _tiny(tmp_path, demo_model_dir, "SmolLM3ForCausalLM", "SmolLM3Config", pad_token_id=0,
                     no_rope_layer_interval=2, tie_word_embeddings=True)
        _edit(path, _drop("tie_word_embeddings"))
    assert_prefill_logits_match_transformers(path)


_MODEL_TYPES = {  # each causal architecture Ember serves -> (outer model_type, text model_type or None)
    "Qwen3ForCausalLM": ("qwen3", None), "LlamaForCausalLM": ("llama", None), "SmolLM3ForCausalLM": ("smollm3", None),
    "Olmo2ForCausalLM": ("olmo2", None), "Olmo3ForCausalLM": ("olmo3", None), "GraniteForCausalLM": ("granite", None),
    "Qwen2ForCausalLM": ("qwen2", None), "SeedOssForCausalLM": ("seed_oss", None),
    "MistralForCausalLM": ("mistral", None), "Mistral3ForConditionalGeneration": ("mistral3", "mistral"),
    "Ministral3ForCausalLM": ("ministral3", None), "Phi3ForCausalLM": ("phi3", None),
    "MixtralForCausalLM": ("mixtral", None), "Llama4ForCausalLM": ("llama4_text", None),
    "Llama4ForConditionalGeneration": ("llama4", "llama4_text"), "Qwen2MoeForCausalLM": ("qwen2_moe", None),
    "Qwen3MoeForCausalLM": ("qwen3_moe", None), "GptOssForCausalLM": ("gpt_oss", None),
    "DeepseekV3ForCausalLM": ("deepseek_v3", None), "Glm4MoeForCausalLM": ("glm4_moe", None),
    "MiniMaxM2ForCausalLM": ("minimax_m2", None), "Gemma2ForCausalLM": ("gemma2", None),
    "Gemma3ForCausalLM": ("gemma3_text", None), "Gemma3ForConditionalGeneration": ("gemma3", "gemma3_text"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "qwen3_vl_text"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", "qwen3_vl_moe_text"),
    "Qwen3NextForCausalLM": ("qwen3_next", None), "Qwen3_5ForCausalLM": ("qwen3_5_text", None),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5_text"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", None),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "qwen3_5_moe_text"),
}
_MINIMAL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def test_every_architecture_ties_by_its_transformers_default():
    """A config.json without ``tie_word_embeddings`` ties as the transformers config class does by default; for a
    multimodal one (whose outer config decides in transformers 5), tied only where the text config class agrees
    (Mistral 3's outer class ties, its text config does not: a real untied head is kept)."""
    from transformers import CONFIG_MAPPING

    assert set(_MODEL_TYPES) == set(MODEL_REGISTRY)
    for arch, (outer, text) in _MODEL_TYPES.items():
        want = bool(getattr(CONFIG_MAPPING[outer](), "tie_word_embeddings", False))
        if text is None:
            cfg = {"architectures": [arch], "model_type": outer, **_MINIMAL}
        else:
            want = want and bool(getattr(CONFIG_MAPPING[text](), "tie_word_embeddings", False))
            cfg = {"architectures": [arch], "model_type": outer, "text_config": {"model_type": text, **_MINIMAL}}
        assert ModelConfig.from_dict(cfg).tie_word_embeddings is want, arch


def test_gemma3_multimodal_text_config_as_gemma_3_4b_it_ships_it(tmp_path, demo_model_dir):
    """gemma-3-4b-it's text_config lists only the fields that differ from Gemma3TextConfig's defaults (no heads,
    head_dim, vocabulary, max_position_embeddings or tie): the rest come from those defaults, as in transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(1)
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, sliding_window=8, initializer_range=0.05,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    path = save_with_tokenizer(model, tmp_path, demo_model_dir)

    def hub(c):
        keep = ("hidden_size", "intermediate_size", "model_type", "num_hidden_layers", "sliding_window")
        c["text_config"] = {k: v for k, v in c["text_config"].items() if k in keep}
        c["text_config"]["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
        c.pop("tie_word_embeddings", None)

    _edit(path, hub)
    cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size,
            cfg.max_position_embeddings, cfg.tie_word_embeddings) == (8, 4, 256, 262208, 131072, True)
    assert_prefill_logits_match_transformers(path)


# -- sliding windows ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["Llama", "Granite", "SeedOss"])
def test_a_stray_sliding_window_is_ignored_where_transformers_has_none(arch, tmp_path, demo_model_dir):
    path = _tiny(tmp_path, demo_model_dir, f"{arch}ForCausalLM", f"{arch}Config", head_dim=16)
    _edit(path, lambda c: c.update(sliding_window=8))  # the prompt (30 tokens) is well past it
    assert_prefill_logits_match_transformers(path)


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3"])
def test_qwen_sliding_window_without_use_sliding_window_is_off(arch, tmp_path, demo_model_dir):
    path = _tiny(tmp_path, demo_model_dir, f"{arch}ForCausalLM", f"{arch}Config", head_dim=16)

    def edit(c):
        c.pop("use_sliding_window", None)
        c.pop("layer_types", None)
        c["sliding_window"] = 8

    _edit(path, edit)
    assert_prefill_logits_match_transformers(path)


@pytest.mark.parametrize("model_type,over", [
    ("qwen2", dict(use_sliding_window=True, max_window_layers=2)),
    ("qwen3", dict(use_sliding_window=True, max_window_layers=1)),
    ("qwen2_moe", dict(use_sliding_window=True, max_window_layers=3)),
    ("qwen2_moe", dict(use_sliding_window=False)),
    ("qwen3_moe", dict(use_sliding_window=True, max_window_layers=2)),
    ("gpt_oss", dict()),
    ("mistral", dict()),
    ("mixtral", dict()),
    ("phi3", dict()),
    ("llama", dict()),
])
def test_per_layer_windows_follow_transformers_config_rules(model_type, over):
    """The window of each layer equals the one transformers' attention gets from the same config.json (keys absent
    from it take the config class defaults)."""
    from transformers import CONFIG_MAPPING

    n = 4
    raw = dict(model_type=model_type, num_hidden_layers=n, sliding_window=8, **over)
    hf = CONFIG_MAPPING[model_type](**raw)
    if model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):  # every layer: `getattr(config, "sliding_window")`
        want = [hf.sliding_window] * n
    elif hasattr(hf, "layer_types") and model_type != "llama":
        want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    else:
        want = [None] * n
    want = [w or None for w in want]  # Qwen2-MoE's "off" window is 0
    arch = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe",
            "gpt_oss": "GptOss", "mistral": "Mistral", "mixtral": "Mixtral", "phi3": "Phi3", "llama": "Llama"}
    cfg = ModelConfig.from_dict({"architectures": [f"{arch[model_type]}ForCausalLM"], **_MINIMAL, **raw})
    assert sliding_windows(cfg) == want


# -- RoPE's pretrained length -------------------------------------------------------------------------------------

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("rope,top", [
    ({"rope_type": "yarn", "factor": 4.0}, 16),  # the top-level length wins ...
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 16),  # ... over the dict's
    (_LLAMA3, None),  # llama3 without one: max_position_embeddings
    (_LLAMA3, 16),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16}, None),  # implicit: 64 / 16
], ids=["yarn-top", "yarn-top-over-dict", "llama3-none", "llama3-top", "yarn-null-factor"])
def test_rope_original_max_position_embeddings_as_transformers_reads_it(rope, top, tmp_path, demo_model_dir):
    path = _tiny(tmp_path, demo_model_dir, "LlamaForCausalLM", "LlamaConfig", head_dim=16, max_position_embeddings=64,
                 rope_parameters=dict(rope, rope_theta=10000.0))

    def v4(c):  # the transformers-4 spelling: rope_theta at the top, rope_scaling as written
        c.pop("rope_parameters")
        c["rope_theta"] = 10000.0
        c["rope_scaling"] = dict(rope)
        if top:
            c["original_max_position_embeddings"] = top

    _edit(path, v4)
    assert_prefill_logits_match_transformers(path)


@pytest.mark.parametrize("model_cls,config_cls,key,nested,stale", [
    ("LlamaForCausalLM", "LlamaConfig", "rope_theta", 10000.0, 500000.0),
    ("Phi3ForCausalLM", "Phi3Config", "partial_rotary_factor", 0.5, 1.0),
], ids=["rope_theta", "partial_rotary_factor"])
def test_a_stale_top_level_rope_field_loses_to_rope_parameters_as_in_transformers_5(
        model_cls, config_cls, key, nested, stale, tmp_path, demo_model_dir):
    """A config.json holding a RoPE field both in ``rope_parameters`` and (stale, edited by hand or left by an older
    writer) at the top level: transformers 5 reads the nested one, so Ember does (it read the top one: wrong
    logits, silently); an --hf-overrides of the top-level key still wins over both."""
    from ember.engine.checkpoint import apply_hf_overrides, read_config

    params = {"rope_type": "default", "rope_theta": 10000.0} | ({key: nested} if key != "rope_theta" else {})
    path = _tiny(tmp_path, demo_model_dir, model_cls, config_cls, head_dim=16, pad_token_id=0, rope_parameters=params)
    _edit(path, lambda c: c.__setitem__(key, stale))
    assert_prefill_logits_match_transformers(path)
    overridden = apply_hf_overrides(read_config(path), {key: stale})
    assert overridden["rope_parameters"][key] == overridden[key] == stale


def test_class_defaults_for_absent_window_and_pretrained_length_follow_transformers():
    """Mistral without ``sliding_window`` gets MistralConfig's 4096; Phi-3's top-level pretrained length
    (Phi3Config's 4096 when absent) wins over the LongRoPE dict's, as transformers resolves both."""
    from transformers import MistralConfig, Phi3Config

    mistral = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "model_type": "mistral", **_MINIMAL})
    assert sliding_windows(mistral) == [MistralConfig().sliding_window] * 2 == [4096, 4096]
    rope = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 2048}
    raw = dict(model_type="phi3", max_position_embeddings=8192, rope_scaling=rope, **_MINIMAL)
    want = Phi3Config.from_dict(raw).rope_parameters["original_max_position_embeddings"]
    got = ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], **raw}).rope_scaling
    assert got["original_max_position_embeddings"] == want == 4096
