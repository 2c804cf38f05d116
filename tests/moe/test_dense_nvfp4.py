"""A dense Qwen3 quantized by `ember quantize-nvfp4` loads through the shared decoder with its linear layers kept
NVFP4, and generates what transformers generates from the dequantized checkpoint."""
from __future__ import annotations

import shutil

import pytest
import torch

from ember.engine import quantize
from ember.engine.nvfp4_loading import NVFP4Linear
from tests.moe.conftest import VOCAB, clear_margin, ember_greedy, ember_model, hf_greedy, prompts, write_dequantized


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory, demo_model_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    src = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=256, initializer_range=0.1,
                                 tie_word_embeddings=False)).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, src / name)
    q = tmp_path_factory.mktemp("tiny-qwen3-nvfp4")
    assert quantize.main([str(src), str(q)]) == 0
    return q, write_dequantized(q, tmp_path_factory.mktemp("tiny-qwen3-dequantized"))


def test_dense_layers_stay_packed(dense_dirs):
    model = ember_model(dense_dirs[0])
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(lin, NVFP4Linear) and lin.weight.dtype == torch.uint8
    assert layer.self_attn.qkv_proj.part_sizes == [64, 32, 32]
    assert not isinstance(model.lm_head, NVFP4Linear)


def test_dense_greedy_equals_dequantized_reference(dense_dirs):
    ps = prompts(6, seed=4)
    ps, expected = clear_margin(ps, hf_greedy(dense_dirs[1], ps), need=4)
    assert ember_greedy(dense_dirs[0], ps) == expected


@pytest.mark.parametrize("shared_scale", [True, False], ids=["one-partition", "three-partitions"])
def test_packed_linear_with_bias_is_the_same_on_the_kernel_path(shared_scale, monkeypatch):
    """A fused q/k/v NVFP4 linear with a bias (Qwen2's) gives on the Triton kernel (one launch, the bias added in
    its epilogue; per-partition launches when the partitions' tensor scales differ) what the torch reference
    gives."""
    from ember.kernels import nvfp4

    g = torch.Generator().manual_seed(3)
    sizes, k = [48, 16, 16], 64
    parts = [nvfp4.quantize(torch.randn(n, k, generator=g)) for n in sizes]
    bias = torch.nn.Parameter(torch.randn(sum(sizes), generator=g).half(), requires_grad=False)
    lin = NVFP4Linear(sizes, k, bias, torch.device("cpu"))
    with torch.no_grad():
        lin.weight.copy_(torch.cat([p.weight for p in parts]))
        lin.weight_scale.copy_(torch.cat([p.weight_scale.view(torch.uint8) for p in parts]))
        lin.weight_scale_2.copy_(torch.stack([parts[0].weight_scale_2.reshape(()) if shared_scale
                                              else p.weight_scale_2.reshape(()) for p in parts]))
    x = torch.randn(5, k, generator=g).half()
    monkeypatch.setenv("EMBER_MOE", "reference")
    want = lin(x)
    lin._parts = None
    monkeypatch.setenv("EMBER_MOE", "triton")
    got = lin(x)
    assert len(lin.partitions()) == (1 if shared_scale else 3)
    assert got.dtype == torch.float16 and got.shape == (5, 80)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-3
