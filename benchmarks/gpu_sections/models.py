"""Checkpoints and models the engine sections run: the demo Qwen3 (tiny) and a LoRA adapter of it, tiny random
Qwen3-MoE, Qwen3-Next, GLM-4.5 and Gemma 3, and a random Qwen3-8B-shaped model cut to a few layers (bf16), each
written once per run as a real checkpoint folder (``save_pretrained`` + the demo tokenizer) so the engine loads it
through its own loader."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from gpu_sections.common import Ctx

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128)
QWEN3_TOY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_qwen3(ctx: Ctx) -> Path:
    """The built-in demo model (2 layers, hidden 64, vocab 1280)."""
    from ember.engine import demo

    return ctx.cached("tiny_qwen3", lambda: demo.build(ctx.tmp / "qwen3-tiny"))


def write_lora_adapter(folder: Path, model: Path, rank: int, seed: int, scale: float = 0.05) -> Path:
    """A random PEFT LoRA adapter (rank ``rank``, ``lora_alpha`` 2 x rank) on all seven attention and MLP
    projections of every layer of the Qwen3 checkpoint ``model``, written into ``folder``."""
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    sizes = {"self_attn": {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)},
             "mlp": {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for part, projections in sizes.items():
            for name, (n_in, n_out) in projections.items():
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * scale
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "bias": "none"}))
    return folder


def tiny_lora(ctx: Ctx) -> Path:
    """A rank-8 adapter of the demo Qwen3 (`tiny_qwen3`) whose updates change its greedy tokens."""
    return ctx.cached("tiny_lora", lambda: write_lora_adapter(ctx.tmp / "qwen3-tiny-lora", tiny_qwen3(ctx), 8, 1,
                                                             scale=0.3))


def _saved(model: Any, ctx: Ctx, name: str) -> Path:
    """A transformers model saved as the checkpoint folder ``name``, with the demo tokenizer."""
    path = ctx.tmp / name
    model.save_pretrained(path)
    return _with_tokenizer(path, ctx)


def _with_tokenizer(path: Path, ctx: Ctx) -> Path:
    src = tiny_qwen3(ctx)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, path / name)
    return path


def tiny_encoder(ctx: Ctx, architecture: str) -> Path:
    """A random 2-layer BERT or XLM-RoBERTa ``architecture`` (hidden 64, 4 heads; a classifier has 3 labels) with the
    demo tokenizer (no separator token, so BERT's token types stay 0)."""
    def build() -> Path:
        import transformers

        family = "XLMRoberta" if architecture.startswith("XLMRoberta") else "Bert"
        extra = {"pad_token_id": 1, "type_vocab_size": 1} if family == "XLMRoberta" else {}
        cfg = getattr(transformers, f"{family}Config")(
            vocab_size=1280, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=258 if family == "XLMRoberta" else 256, num_labels=3, **extra)
        torch.manual_seed(0)
        return _saved(getattr(transformers, architecture)(cfg).eval(), ctx, f"{architecture}-tiny")

    return ctx.cached(f"tiny_{architecture}", build)


def tiny_qwen3_moe(ctx: Ctx) -> Path:
    """A random Qwen3-MoE (3 layers, one dense; 8 experts, top-2) saved by transformers; routers drawn wide so
    top-k has no near-ties."""
    def build() -> Path:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=1280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[1], max_position_embeddings=1024, initializer_range=0.1,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0.0, 0.5)
        return _saved(model, ctx, "qwen3-moe-tiny")

    return ctx.cached("tiny_qwen3_moe", build)


def tiny_qwen3_next(ctx: Ctx) -> Path:
    """A random Qwen3-Next (4 layers: linear, full, linear, full; 8 experts, top-2, a shared expert) saved by
    transformers; norm offsets, decays and routers moved off their initial values."""
    def build() -> Path:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(vocab_size=1280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=True, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                              full_attention_interval=2, partial_rotary_factor=0.5, max_position_embeddings=1024,
                              initializer_range=0.1, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = Qwen3NextForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "A_log", "dt_bias")):
                    p.add_(torch.randn_like(p) * 0.2)
                elif name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
        return _saved(model, ctx, "qwen3-next-tiny")

    return ctx.cached("tiny_qwen3_next", build)


def tiny_glm4_moe(ctx: Ctx) -> Path:
    """A random GLM-4.5 (3 layers, the first dense; q/k/v biases, rotary on half of each head; 8 experts in 2 groups,
    top-2, a shared expert, a correction bias) saved by transformers; routers and biases drawn wide."""
    def build() -> Path:
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        cfg = Glm4MoeConfig(vocab_size=1280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                            first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
                            max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5})
        torch.manual_seed(0)
        model = Glm4MoeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0.0, 0.5)
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0.0, 0.5)
                    layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
        return _saved(model, ctx, "glm4-moe-tiny")

    return ctx.cached("tiny_glm4_moe", build)


def tiny_gemma3(ctx: Ctx) -> Path:
    """A random Gemma 3 (7 layers: sliding windows of 8 with their own RoPE around one global layer with linear
    scaling) saved by transformers; the zero-centred norm weights moved off 0."""
    def build() -> Path:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                               query_pre_attn_scalar=24, max_position_embeddings=1024, initializer_range=0.1,
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                   "rope_theta": 1e6}})
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
        return _saved(model, ctx, "gemma3-tiny")

    return ctx.cached("tiny_gemma3", build)


def tiny_gemma2(ctx: Ctx) -> Path:
    """A random Gemma 2 (4 layers alternating windows of 8 and global attention; attention scores soft-capped at 1.5
    with q projections scaled up so the cap shapes every softmax, final logits at 4) saved by transformers."""
    def build() -> Path:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg = Gemma2Config(vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           query_pre_attn_scalar=24, max_position_embeddings=1024, initializer_range=0.1,
                           attn_logit_softcapping=1.5, final_logit_softcapping=4.0)
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
                elif name.endswith("q_proj.weight"):
                    p.mul_(4)
        return _saved(model, ctx, "gemma2-tiny")

    return ctx.cached("tiny_gemma2", build)


def tiny_minimax_m2(ctx: Ctx) -> Path:
    """A random MiniMax-M2 (q/k RMSNorms over the whole projections, rotary on half of each head, sigmoid routing with
    a correction bias over 8 experts, 2 per token) saved by transformers in the release's layout."""
    def build() -> Path:
        from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

        cfg = MiniMaxM2Config(vocab_size=1280, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
                              num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
                              initializer_range=0.1, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = MiniMaxM2ForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.e_score_correction_bias.normal_(0.0, 0.3)
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
        return _saved(model, ctx, "minimax-m2-tiny")

    return ctx.cached("tiny_minimax_m2", build)


def tiny_llama4(ctx: Ctx) -> Path:
    """A random Llama 4 (chunks of 8 positions on three RoPE layers around a NoPE one with attention temperature,
    weightless q/k norms, a top-1 routed expert plus a shared one every other layer) saved by transformers."""
    def build() -> Path:
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        cfg = Llama4TextConfig(vocab_size=1280, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                               attention_chunk_size=8, floor_scale=4, attn_scale=0.5, max_position_embeddings=1024,
                               initializer_range=0.1, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = Llama4ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.normal_(0.0, 0.5)
        return _saved(model, ctx, "llama4-tiny")

    return ctx.cached("tiny_llama4", build)


def qwen3_layers_config(ctx: Ctx, layers: int) -> dict[str, Any]:
    """Qwen3-8B's shapes (toy shapes on a CPU run) with ``layers`` decoder layers."""
    return dict(QWEN3_TOY if ctx.tiny else QWEN3_8B, num_hidden_layers=layers, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def qwen3_8b_shaped(ctx: Ctx, layers: int) -> Path:
    """A random Qwen3-8B-shaped checkpoint with ``layers`` layers in the run's dtype, built on the device by
    transformers (seed 0) and saved with ``save_pretrained``: the same weights for Ember and the transformers peer."""
    def build() -> Path:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**qwen3_layers_config(ctx, layers))
        saved = torch.get_default_dtype()
        torch.manual_seed(0)
        torch.set_default_dtype(ctx.dtype)
        try:
            with torch.device(ctx.device):
                model = Qwen3ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(saved)
        path = ctx.tmp / f"qwen3-8b-shaped-{layers}l"
        model.to(ctx.dtype).save_pretrained(path)
        del model
        raw = json.loads((path / "config.json").read_text())
        raw["torch_dtype"] = str(ctx.dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(raw))
        return _with_tokenizer(path, ctx)

    return ctx.cached(f"qwen3_8b_shaped_{layers}", build)


def random_ember_model(ctx: Ctx, raw: dict[str, Any], max_position: int):
    """Ember's model class for a config dict, with random weights, built directly on the device (no checkpoint IO)."""
    from ember.engine.config import ModelConfig
    from ember.engine.models import get_model_class

    cfg = ModelConfig.from_dict(dict(raw, architectures=["Qwen3ForCausalLM"], model_type="qwen3"))
    saved = torch.get_default_dtype()
    torch.set_default_dtype(ctx.dtype)
    try:
        with torch.device(ctx.device):
            model = get_model_class(cfg.architecture)(cfg, max_position).to(ctx.dtype)
    finally:
        torch.set_default_dtype(saved)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    model.rope.build_cache(ctx.device, ctx.dtype)
    return cfg, model.eval()
