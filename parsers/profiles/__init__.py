"""Model-family profiles: each family's output syntax as data, interpreted by `parsers.machine.ParserMachine` and the
tool syntax (`parsers.tools`) that its ``tool_format`` names.

Families: ``qwen3`` (think + Hermes JSON tool calls), ``qwen3_coder`` (think + XML tool calls typed by JSON schema),
``deepseek_r1`` (the reply starts in the thought; DeepSeek's tool calls), ``deepseek_v3`` (DeepSeek's tool-call
section, V3 and V3.1 spellings), ``glm45`` (think + `<arg_key>`/`<arg_value>` tool calls), ``kimi_k2`` (think +
Kimi's tool-call section), ``minimax_m2`` (think + `<invoke name="..">` XML tool calls typed as Qwen3-Coder's, several
in one block; ``minimax_m2_append_think`` keeps its thought in the content), ``seed_oss`` (`<seed:think>` +
Qwen3-Coder's XML calls in `<seed:tool_call>`), ``hermes`` (JSON tool calls, no reasoning), ``gpt_oss`` (harmony
channels), ``none`` (all content).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import Profile, ReasoningSpec, Rule
from . import (deepseek_r1, deepseek_v3, glm45, gpt_oss, hermes, kimi_k2, llama3_json, minimax_m2, mistral, none,
               pythonic, qwen3, qwen3_coder, seed_oss)

__all__ = ["Profile", "ReasoningSpec", "Rule", "PROFILE_NAMES", "ALIASES", "PARSER_NAMES", "canonical_name",
           "get_profile", "detect_profile"]

_PROFILES: dict[str, Profile] = {p.name: p for p in (
    qwen3.PROFILE, qwen3_coder.PROFILE, deepseek_r1.PROFILE, deepseek_v3.PROFILE, glm45.PROFILE, kimi_k2.PROFILE,
    minimax_m2.PROFILE, minimax_m2.APPEND_THINK, seed_oss.PROFILE, llama3_json.PROFILE, mistral.PROFILE,
    pythonic.PROFILE, hermes.PROFILE, gpt_oss.PROFILE, none.PROFILE)}
PROFILE_NAMES: tuple[str, ...] = tuple(_PROFILES)

ALIASES: dict[str, str] = {
    "openai": "gpt_oss",              # vLLM --tool-call-parser for gpt-oss
    "openai_gptoss": "gpt_oss",       # vLLM --reasoning-parser for gpt-oss
    "qwen3_xml": "qwen3_coder",       # vLLM's second Qwen3-Coder tool parser
    "deepseek_v31": "deepseek_v3",    # vLLM's V3.1 tool parser (one syntax here reads both spellings)
    "llama4_json": "llama3_json",     # vLLM reads Llama 4's JSON calls with its Llama 3 parser
    "llama4_pythonic": "pythonic",    # Llama 4's pythonic calls inside <|python_start|> .. <|python_end|>
    "glm47": "glm45",                 # vLLM's GLM-4.7 tool parser: the same <arg_key>/<arg_value> syntax
}
"""vLLM's parser names (its ``--tool-call-parser`` / ``--reasoning-parser`` values) that differ from ours -> our
profile name, so a vLLM command line works unchanged. The names both share (``hermes``, ``qwen3_coder``, ``qwen3``,
``deepseek_r1``, ``minimax_m2``, ``seed_oss``) need no entry. The one alias table: the CLI check and `get_profile`
both read it."""

PARSER_NAMES: tuple[str, ...] = PROFILE_NAMES + tuple(ALIASES)
"""Every name `get_profile` accepts: the profile names, then the aliases."""


def canonical_name(name: str) -> str:
    """The profile name ``name`` stands for (itself unless it is an alias); "none" stays "none"."""
    return ALIASES.get(name, name)


def get_profile(name: str) -> Profile:
    """The profile called ``name`` (or an alias of it); ValueError naming the known names otherwise."""
    try:
        return _PROFILES[canonical_name(name)]
    except KeyError:
        raise ValueError(f"unknown parser profile {name!r}; known: {', '.join(PARSER_NAMES)}") from None


_MODEL_TYPES = {"gpt_oss": "gpt_oss", "qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_next": "qwen3",
                "deepseek_v3": "deepseek_v3", "glm4_moe": "glm45", "kimi_k2": "kimi_k2", "minimax_m2": "minimax_m2",
                "seed_oss": "seed_oss"}


def detect_profile(chat_template: str | Mapping[str, str] | Sequence[Mapping[str, str]] | None,
                   model_type: str | None = None) -> str:
    """The profile name for a chat template (the markup it renders), else for a `config.json` ``model_type``;
    "none" when neither is recognised. Named templates (``{"default": ..., "tool_use": ...}`` as transformers loads
    Hermes 2 Pro's, Hermes 3's and Command R's, or tokenizer_config.json's list of ``{"name", "template"}``) are read
    together: their tool markup is often only in ``tool_use``."""
    if isinstance(chat_template, Mapping):
        chat_template = "\n".join(v for v in chat_template.values() if isinstance(v, str))
    elif chat_template is not None and not isinstance(chat_template, str):
        chat_template = "\n".join(t.get("template") or "" for t in chat_template if isinstance(t, Mapping))
    t = chat_template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return "gpt_oss"
    if "<｜tool▁calls▁begin｜>" in t and ("</think>" not in t or "<｜Assistant｜></think>" in t
                                      or "<｜Assistant｜><think></think>" in t):
        return "deepseek_v3"          # V3 (no thought) and V3.1 (renders an empty thought when thinking is off)
    if "<｜Assistant｜>" in t and "</think>" in t:
        return "deepseek_r1"
    if "<minimax:tool_call>" in t:
        return "minimax_m2"
    if "<seed:tool_call>" in t or "<seed:think>" in t:
        return "seed_oss"
    if "<|tool_calls_section_begin|>" in t and "<|tool_call_argument_begin|>" in t:
        return "kimi_k2"
    if "<tool_call>" in t and "<arg_key>" in t and "<arg_value>" in t:
        return "glm45"
    if "<|im_start|>" in t and "<tool_call>" in t:
        if "<function=" in t and "<parameter=" in t:
            return "qwen3_coder"
        return "qwen3" if "<think>" in t else "hermes"
    if "<|im_start|>" in t and "<think>" in t and "</think>" in t:
        return "qwen3"
    if "[TOOL_CALLS]" in t and "[INST]" in t:
        return "mistral"              # Mistral 7B v0.3 / Nemo / Small 3.x / Devstral / Magistral / Ministral 3
    if "[func_name" in t:
        return "pythonic"             # vLLM's llama3.2 / llama4 / gemma3 pythonic templates
    if ("<|start_header_id|>" in t or "<|header_start|>" in t) and '"parameters"' in t:
        return "llama3_json"          # Llama 3.1/3.2/3.3 and vLLM's llama3.x_json / llama4_json templates
    return _MODEL_TYPES.get(model_type or "", "none")
