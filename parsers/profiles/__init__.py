"""Model-family profiles: each family's output syntax as data, interpreted by `parsers.machine.ParserMachine`.

Families: ``qwen3`` (think + Hermes JSON tool calls), ``qwen3_coder`` (think + XML tool calls typed by JSON schema),
``deepseek_r1`` (the template opens the thought), ``hermes`` (JSON tool calls, no reasoning), ``gpt_oss`` (harmony
channels), ``none`` (all content).
"""
from __future__ import annotations

from .base import Profile, ReasoningSpec, Rule
from . import deepseek_r1, gpt_oss, hermes, none, qwen3, qwen3_coder

__all__ = ["Profile", "ReasoningSpec", "Rule", "PROFILE_NAMES", "get_profile", "detect_profile"]

_PROFILES: dict[str, Profile] = {m.PROFILE.name: m.PROFILE
                                 for m in (qwen3, qwen3_coder, deepseek_r1, hermes, gpt_oss, none)}
PROFILE_NAMES: tuple[str, ...] = tuple(_PROFILES)


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the known names otherwise."""
    try:
        return _PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown parser profile {name!r}; known: {', '.join(PROFILE_NAMES)}") from None


_MODEL_TYPES = {"gpt_oss": "gpt_oss", "qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_next": "qwen3"}


def detect_profile(chat_template: str | None, model_type: str | None = None) -> str:
    """The profile name for a chat template (the markup it renders), else for a `config.json` ``model_type``;
    "none" when neither is recognised."""
    t = chat_template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return "gpt_oss"
    if "<｜Assistant｜>" in t and "</think>" in t:
        return "deepseek_r1"
    if "<|im_start|>" in t and "<tool_call>" in t:
        if "<function=" in t and "<parameter=" in t:
            return "qwen3_coder"
        return "qwen3" if "<think>" in t else "hermes"
    if "<|im_start|>" in t and "<think>" in t and "</think>" in t:
        return "qwen3"
    return _MODEL_TYPES.get(model_type or "", "none")
