"""Mixtral (``MixtralForCausalLM``): Mistral's attention (no q/k norm; ``sliding_window`` when set) and a sparse MoE
in every layer: softmax top-``num_experts_per_tok`` of ``num_local_experts`` experts of ``intermediate_size``,
renormalised (Qwen3-MoE's block and kernels). The checkpoint names the experts ``block_sparse_moe.experts.E.w1``
(gate), ``w3`` (up), ``w2`` (down) and the router ``block_sparse_moe.gate``; they load under Qwen3-MoE's names."""
from __future__ import annotations

from ember.engine.config import ConfigError, ModelConfig
from ember.engine.models import qwen3_moe

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def local_experts(cfg: ModelConfig, family: str) -> tuple[dict, list[bool]]:
    """The MoE settings of a config.json that names ``num_local_experts`` experts of ``intermediate_size``,
    ``num_experts_per_tok`` per token, renormalised, in every layer (Mixtral, MiniMax-M2)."""
    raw = cfg.raw
    moe = {"num_experts": int(raw.get("num_local_experts") or 0), "top_k": int(raw.get("num_experts_per_tok") or 0),
           "inter": cfg.intermediate_size, "norm_topk_prob": True}
    if not 1 <= moe["top_k"] <= moe["num_experts"]:
        raise ConfigError(f"config.json: {family} needs 1 <= num_experts_per_tok <= num_local_experts")
    return moe, [True] * cfg.num_hidden_layers


def expert_split_rule(name: str) -> tuple[str, int] | None:
    """The tensor-parallel split of a ``block_sparse_moe.experts.E.w1/w3/w2`` weight (``w1`` / ``w3`` their rows,
    the intermediate channels; ``w2`` its columns); None for any other tensor."""
    module, _, leaf = name.rpartition(".")
    which = module.rpartition(".")[2]
    if ".block_sparse_moe.experts." in name and which in _EXPERT_NAMES and leaf == "weight":
        return ("shard", 1) if which == "w2" else ("shard", 0)
    return None


def expert_name(name: str) -> str:
    """A ``block_sparse_moe`` tensor under Ember's names (``mlp``; ``w1/w3/w2`` as ``gate/up/down_proj``)."""
    if ".block_sparse_moe." not in name:
        return name
    parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
    if len(parts) > 2 and parts[-2] in _EXPERT_NAMES:
        parts[-2] = _EXPERT_NAMES[parts[-2]]
    return ".".join(parts)


class MixtralDecoderLayer(qwen3_moe.Qwen3MoeDecoderLayer):
    qk_norm = False


class _Body(qwen3_moe._Body):
    layer = MixtralDecoderLayer


class MixtralForCausalLM(qwen3_moe.Qwen3MoeForCausalLM):
    qk_norm = False
    body = _Body

    @staticmethod
    def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
        return local_experts(cfg, "Mixtral")

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple[str, int]:
        from ember.engine import distributed

        return expert_split_rule(name) or distributed._split_rule(name)

    def checkpoint_name(self, name: str) -> str | None:
        return expert_name(name)
