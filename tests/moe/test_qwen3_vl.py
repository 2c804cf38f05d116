"""Qwen3-VL's language model served for text: tiny random Qwen3-VL (dense) and Qwen3-VL-MoE checkpoints give
transformers' logits for a text prompt (the vision tower is not loaded); the MoE's fused expert stacks load in either
layout (transformers' own, or transposed as the released checkpoints hold them), and two tensor-parallel ranks
decode what one process does from the transposed layout."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.moe.conftest import assert_two_ranks_match_one, ember_logits, ember_model, prompts, save_with_tokenizer

TEXT = dict(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])


def _check_logits(hf, path) -> None:
    prompt = prompts(1, seed=5, min_len=30, max_len=30)[0]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    got = ember_logits(ember_model(path), prompt)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_dense_qwen3_vl_text_logits_match_transformers(tmp_path, demo_model_dir):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=TEXT, vision_config=VISION)).eval()
    _check_logits(hf, save_with_tokenizer(hf, tmp_path / "vl", demo_model_dir))


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory, demo_model_dir):
    """The tiny MoE as transformers saves it, and the same with its expert stacks transposed (the released layout)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(TEXT, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(1)
    hf = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=VISION)).eval()
    with torch.no_grad():
        for layer in hf.model.language_model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    root = tmp_path_factory.mktemp("qwen3-vl-moe")
    own = save_with_tokenizer(hf, root / "own", demo_model_dir)
    released = root / "released"
    shutil.copytree(own, released)
    tensors = load_file(own / "model.safetensors")
    flipped = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in tensors.items()}
    assert flipped["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 48)
    save_file(flipped, str(released / "model.safetensors"), metadata={"format": "pt"})
    return hf, own, released


def test_moe_text_logits_match_transformers_in_both_expert_layouts(vl_moe):
    hf, own, released = vl_moe
    _check_logits(hf, own)
    _check_logits(hf, released)


def test_moe_two_ranks_match_one_from_the_released_layout(vl_moe):
    assert_two_ranks_match_one(vl_moe[2], prompts(4, seed=12, min_len=5, max_len=40), 6)
