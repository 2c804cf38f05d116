"""A tiny random Llama 4 (chunked attention of 8 positions on the RoPE layers, a NoPE layer with attention
temperature, weightless q/k norms, interleaved rotary pairs, a top-1 routed expert fed the router-scaled token plus a
shared expert, MoE layers interleaved with dense ones): Ember's logits and greedy tokens equal transformers' for
prompts past the chunk, through chunked prefill and prefix hits; the multimodal checkpoint's language model serves the
same; two tensor-parallel ranks decode what one does."""
from __future__ import annotations

import pytest
import torch

from tests.moe.conftest import (assert_greedy_matches_transformers_chunked_and_cached,
                                assert_prefill_logits_match_transformers, assert_two_ranks_match_one, ember_model,
                                prompts, save_with_tokenizer)

TEXT = dict(vocab_size=1280, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
            max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)


def _spread(model) -> None:
    """Router weights large enough that the experts' choice and score vary from token to token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)


@pytest.fixture(scope="module")
def tiny_llama4_dir(tmp_path_factory, demo_model_dir):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    model = Llama4ForCausalLM(Llama4TextConfig(**TEXT))
    _spread(model)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-llama4"), demo_model_dir)


def test_layers_follow_the_config(tiny_llama4_dir):
    model = ember_model(tiny_llama4_dir)
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.use_rope, a.chunk) for a in attn] == [(True, 8), (True, 8), (True, 8), (False, None)]
    assert attn[3].q_position_scale == (0.5, 4, 1) and attn[0].q_norm is not None and attn[3].q_norm is None
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["GatedMLP", "Llama4MoE"] * 2


def test_prefill_logits_match_transformers(tiny_llama4_dir):
    assert_prefill_logits_match_transformers(tiny_llama4_dir)  # 30 tokens: past chunks of 8 and floor_scale 4


def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_llama4_dir):
    assert_greedy_matches_transformers_chunked_and_cached(tiny_llama4_dir)


def test_the_multimodal_checkpoint_serves_its_language_model(tmp_path, demo_model_dir):
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=TEXT, vision_config=vision))
    _spread(model)
    save_with_tokenizer(model, tmp_path / "mm", demo_model_dir)
    assert_prefill_logits_match_transformers(tmp_path / "mm")


def test_two_ranks_match_one(tiny_llama4_dir):
    assert_two_ranks_match_one(tiny_llama4_dir, prompts(4, seed=12, min_len=5, max_len=40), 6)


def test_quantize_nvfp4_runs_like_its_dequantized_weights(tiny_llama4_dir, tmp_path, monkeypatch):
    """``ember quantize-nvfp4`` on Llama 4 quantizes its fused, transposed experts per expert (they stayed fused in
    the model dtype), and Ember runs the NVFP4 checkpoint as the same weights dequantized: the q/k block scales move
    with the rows reordered for the rotary halves (they did not: logits were about 30% off), on the torch and the
    Triton paths."""
    from ember.engine import quantize
    from tests.moe.conftest import ember_logits, write_dequantized

    dst = tmp_path / "nvfp4"
    assert quantize.main([str(tiny_llama4_dir), str(dst)]) == 0
    model = ember_model(dst)
    experts = model.model.layers[1].mlp.experts
    assert experts.w13 is None and experts.quant13.weight.dtype == experts.quant2.weight.dtype == torch.uint8
    prompt = prompts(1, seed=7, min_len=12, max_len=12)[0]
    want = ember_logits(ember_model(write_dequantized(dst, tmp_path / "dequantized")), prompt)
    assert ((ember_logits(model, prompt) - want).norm() / want.norm()).item() < 1e-5
    monkeypatch.setenv("EMBER_MOE", "triton")  # the Triton interpreter on CPU
    assert ((ember_logits(ember_model(dst), prompt) - want).norm() / want.norm()).item() < 1e-4


def test_quantization_fp8_runs_like_its_dequantized_weights(tiny_llama4_dir, tmp_path):
    """``--quantization fp8`` on Llama 4: each projection's per-channel scales move with the q/k rows reordered for
    the rotary halves, so Ember runs exactly the weights quantized and dequantized (the scales stayed in checkpoint
    row order, a quarter of the logits' norm off)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ember.engine import fp8_loading
    from ember.kernels import fp8_block
    from tests.moe.conftest import ember_logits

    def rounded(w: torch.Tensor) -> torch.Tensor:
        return fp8_block.quantize(w, fp8_loading.ON_LOAD.block).dequantize()

    with safe_open(str(tiny_llama4_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name, w in tensors.items():
        if name.endswith("proj.weight") and ".layers." in name:
            tensors[name] = rounded(w)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, H, 2I], [E, I, H]: rows are outputs
            tensors[name] = torch.stack([rounded(e.T).T for e in w])
    ref = tmp_path / "rounded"
    ref.mkdir()
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    for other in tiny_llama4_dir.iterdir():
        if other.name != "model.safetensors":
            (ref / other.name).write_bytes(other.read_bytes())
    prompt = prompts(1, seed=7, min_len=12, max_len=12)[0]
    want = ember_logits(ember_model(ref), prompt)
    got = ember_logits(ember_model(tiny_llama4_dir, quantization="fp8"), prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("block,heads", [((8, 16), None), ((16, 16), None), ((4, 16), 16)])
def test_a_block_fp8_checkpoint_runs_like_its_dequantized_weights(tiny_llama4_dir, tmp_path, block, heads):
    """A block-FP8 checkpoint (``weight_block_size``) gives the logits of its weights dequantized: q/k stay FP8 where
    a scale block spans whole heads (16 rows, head_dim 16; 4 rows, head_dim 4), their block grid unmoved (16 heads
    of 4: its 16 rows were reordered as one head's), and are dequantized as they load where a block spans half a head
    (8 rows: reordered within the head, the rows left their scale blocks; logits were 13% off)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from ember.engine.fp8_loading import FP8Linear
    from ember.kernels import fp8_block
    from tests.moe.conftest import ember_logits

    src = tiny_llama4_dir
    if heads is not None:
        torch.manual_seed(0)
        model = Llama4ForCausalLM(Llama4TextConfig(**TEXT | {"num_attention_heads": heads, "head_dim": 64 // heads}))
        _spread(model)
        src = save_with_tokenizer(model, tmp_path / "src", tiny_llama4_dir)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    packed, ref = {}, {}
    for name, w in tensors.items():
        packed[name] = ref[name] = w
        if name.endswith("proj.weight") and ".layers." in name:
            q = fp8_block.quantize(w, block)
            packed[name], packed[name[: -len(".weight")] + ".weight_scale_inv"], ref[name] = \
                q.weight, q.scale, q.dequantize()
    cfg = json.loads((src / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    for d, data, c in ((tmp_path / "fp8", packed, cfg | {"quantization_config": fp8}), (tmp_path / "ref", ref, cfg)):
        d.mkdir()
        save_file(data, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(c))
    model = ember_model(tmp_path / "fp8")
    prompt = prompts(1, seed=4, min_len=20, max_len=20)[0]
    want = ember_logits(ember_model(tmp_path / "ref"), prompt)
    assert ((ember_logits(model, prompt) - want).norm() / want.norm()).item() < 1e-5
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.o_proj, FP8Linear) and isinstance(attn.qkv_proj, FP8Linear) == (block[0] != 8)
