"""Qwen3.5 (dense and MoE): Qwen3-Next's hybrid of Gated DeltaNet and gated attention, with the linear attention's
projections stored apart (``in_proj_qkv`` in the conv's q|k|v channel order, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``).

The released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``:
``text_config`` in config.json, the language model under ``model.language_model.``); Ember serves the language model
and skips the vision tower (``model.visual.``) and the multi-token-prediction weights. Text positions are the same
on the three multimodal rotary axes, so the rotary embedding is the plain partial one. Every layer of the MoE variant
is sparse, with renormalised top-k weights and a gated shared expert; the dense variant's layers all use the gated
MLP.
"""
from __future__ import annotations

import torch
from torch import nn

from ember.engine.config import ModelConfig
from ember.engine.models import qwen3_next
from ember.engine.models.layers import language_model_name
from ember.engine.models.qwen3_moe import moe_settings



class SplitGatedDeltaNet(qwen3_next.GatedDeltaNet):
    """Qwen3.5's linear attention: the same layer as Qwen3-Next's over four separate input projections."""

    def _make_projections(self, hidden: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, self.channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)

    def _project(self, x: torch.Tensor, triton: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each part from its own projection: already in the layouts the layer consumes, on either backend."""
        return (self.in_proj_qkv(x), self.in_proj_z(x).view(x.shape[0], self.hv, self.dv), self.in_proj_b(x),
                self.in_proj_a(x))


class _Body(qwen3_next._Body):
    linear_attention = SplitGatedDeltaNet


class Qwen3_5ForCausalLM(qwen3_next.Qwen3NextForCausalLM):
    """Qwen3.5's language model (dense or MoE), from the multimodal or the text-only checkpoint layout."""

    body = _Body

    @staticmethod
    def moe_settings(cfg: ModelConfig) -> tuple[dict, list[bool]]:
        """Qwen3-MoE's reading of the expert fields; top-k weights are always renormalised."""
        moe, sparse = moe_settings(cfg)
        moe["norm_topk_prob"] = bool(cfg.raw.get("norm_topk_prob", True))
        return moe, sparse

    @staticmethod
    def tp_split_rule(name: str, cfg: ModelConfig) -> tuple:
        """Qwen3-Next's split, with ``in_proj_qkv``'s rows as three parts (q, k, v) like the conv's channels and
        ``in_proj_z``/``b``/``a`` by value heads (their per-tensor scales replicated, as Qwen3-Next's)."""
        parent, _, leaf = name.rpartition(".")
        if ".linear_attn." in name and leaf not in ("weight", "bias", "weight_scale"):
            return qwen3_next.Qwen3NextForCausalLM.tp_split_rule(name, cfg)
        if ".linear_attn." in name and parent.endswith("in_proj_qkv"):
            return "segments", 0, qwen3_next.qkv_channel_parts(cfg)
        if ".linear_attn." in name and parent.endswith(("in_proj_z", "in_proj_b", "in_proj_a")):
            return "shard", 0
        return qwen3_next.Qwen3NextForCausalLM.tp_split_rule(name, cfg)

    def checkpoint_name(self, name: str) -> str | None:
        """The language model's tensors under Ember's names (``model.language_model.`` -> ``model.``); the vision
        tower and the multi-token-prediction head are skipped."""
        return None if name.startswith("mtp.") else language_model_name(name)
