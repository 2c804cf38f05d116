"""Greedy generation of tiny random Qwen2 (q/k/v biases) and Mistral (with a sliding window shorter than the prompts)
models equals transformers' generate, token for token, with staggered prompts and chunked prefill."""
from __future__ import annotations

import shutil

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.models import get_model_class
from tests.conftest import save_with_tokenizer
from tests.engine.test_parity import _good, _hf_greedy, _prompts, _run_staggered

WINDOW = 8


def _save_tiny(kind: str, path, tokenizer_dir) -> None:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.1, rope_theta=10000.0)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
        with torch.no_grad():  # transformers initialises biases to zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    else:
        model = MistralForCausalLM(MistralConfig(tie_word_embeddings=False, sliding_window=WINDOW, **common))
    save_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_model_dir):
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in ("qwen2", "mistral"):
        d = tmp_path_factory.mktemp(f"tiny-{kind}")
        _save_tiny(kind, d, demo_model_dir)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        out[kind] = (d, hf)
    return out


def test_architectures_are_registered_with_their_attention_shape(tiny):
    from ember.engine import loader

    q2 = get_model_class("Qwen2ForCausalLM")(loader.load_model_config(tiny["qwen2"][0]), 64)
    attn = q2.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is None
    assert attn.sliding_window is None
    mi = get_model_class("MistralForCausalLM")(loader.load_model_config(tiny["mistral"][0]), 64)
    assert [layer.self_attn.sliding_window for layer in mi.model.layers] == [WINDOW, WINDOW]


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny, kind):
    path, hf = tiny[kind]
    prompts = _prompts(10, seed=3, min_len=5, max_len=50)
    prompts, expected = _good(prompts, _hf_greedy(hf, prompts))
    engine = Engine.from_pretrained(path, block_size=16, max_num_batched_tokens=16, max_num_seqs=16)
    got, _ = _run_staggered(engine, prompts)
    assert max(len(p) for p in prompts) > 16 > WINDOW
    assert got == expected
    # a later prompt sharing the longest one's first two blocks is served partly from the prefix cache
    longest = max(prompts, key=len)
    shared = longest[:32] + _prompts(1, seed=4, min_len=9, max_len=9)[0]
    hits = engine.kv.prefix_hits
    got, _ = _run_staggered(engine, [shared])
    assert engine.kv.prefix_hits - hits == 32
    assert got == [_hf_greedy(hf, [shared])[0][0]]


def test_a_mistral3_multimodal_checkpoint_serves_its_language_model(tmp_path, demo_model_dir):
    """Mistral Small 3.x / Magistral / Devstral ship as ``Mistral3ForConditionalGeneration`` (the decoder under
    ``language_model.``, a vision tower beside it): the logits of a text prompt equal transformers'."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from tests.moe.conftest import ember_logits, ember_model, prompts

    text = dict(model_type="mistral", vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                initializer_range=0.1, tie_word_embeddings=False)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, head_dim=8)
    torch.manual_seed(2)
    hf = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision)).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, tmp_path / name)
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    got = ember_logits(ember_model(tmp_path), prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_ministral3_scales_queries_past_its_original_context(tmp_path, demo_model_dir):
    """Ministral 3 / Mistral Large 3: YaRN RoPE and, past ``original_max_position_embeddings`` (8 here, so a 30-token
    prompt crosses it three times), queries multiplied by ``1 + beta * log(1 + floor(pos / 8))``."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    from tests.moe.conftest import assert_prefill_logits_match_transformers

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
    torch.manual_seed(3)
    Ministral3ForCausalLM(Ministral3Config(
        vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
        rope_parameters=rope)).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, tmp_path / name)
    from ember.engine import loader

    model = get_model_class("Ministral3ForCausalLM")(loader.load_model_config(tmp_path), 64)
    assert model.model.layers[0].self_attn.q_position_scale == (0.5, 8, 0)
    assert_prefill_logits_match_transformers(tmp_path)
