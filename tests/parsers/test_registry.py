"""The profile and tool-syntax registries: vLLM's parser names work as aliases, every profile's rules resolve to
actions of the driver or of its tool syntax, and a profile naming an unknown syntax or action is a clear error."""
from __future__ import annotations

import dataclasses

import pytest

from ember.parsers.initial import InitialState
from ember.parsers.machine import ParserMachine
from ember.parsers.profiles import ALIASES, PARSER_NAMES, PROFILE_NAMES, canonical_name, get_profile
from ember.parsers.profiles.base import Rule
from ember.parsers.tools import SYNTAXES, ToolSyntax, syntax_for


@pytest.mark.parametrize("vllm_name, ours", [("openai", "gpt_oss"), ("openai_gptoss", "gpt_oss"),
                                             ("qwen3_xml", "qwen3_coder"), ("hermes", "hermes"),
                                             ("qwen3_coder", "qwen3_coder"), ("qwen3", "qwen3"),
                                             ("deepseek_r1", "deepseek_r1"), ("minimax_m2", "minimax_m2"),
                                             ("seed_oss", "seed_oss")])
def test_vllm_parser_names_pick_our_profiles(vllm_name, ours):
    assert vllm_name in PARSER_NAMES
    assert canonical_name(vllm_name) == ours
    assert get_profile(vllm_name) is get_profile(ours)


def test_every_alias_names_a_profile_and_unknown_names_list_the_aliases():
    assert set(ALIASES.values()) <= set(PROFILE_NAMES)
    assert not set(ALIASES) & set(PROFILE_NAMES)
    assert canonical_name("none") == "none"
    with pytest.raises(ValueError, match="openai"):
        get_profile("granite")


def test_serve_flags_accept_vllm_names():
    config = pytest.importorskip("ember.server.config")
    if not hasattr(config, "parse_profile_name"):
        pytest.skip("the CLI checks parser names at start (server.cli)")
    assert config.parse_profile_name("openai") == "gpt_oss"
    assert config.parse_profile_name("none") == "none"
    with pytest.raises(ValueError, match="openai_gptoss"):
        config.parse_profile_name("nonsense")


def test_named_templates_are_detected_from_all_of_them():
    """Hermes 3's tool markup is only in its `tool_use` template (transformers loads named templates as a dict;
    tokenizer_config.json lists them as name/template pairs)."""
    from ember.parsers.profiles import detect_profile

    default = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tool_use = default + "{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}<tool_call>"
    assert detect_profile({"default": default, "tool_use": tool_use}) == "hermes"
    assert detect_profile([{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]) \
        == "hermes"
    assert detect_profile({"default": default}, "qwen3") == "qwen3"


def test_choose_profile_takes_aliases():
    from ember.server.generation import choose_profile

    p = choose_profile(None, None, "openai_gptoss", "openai")
    assert p.name == "gpt_oss" and p.tool_format == "harmony"
    p = choose_profile(None, None, "deepseek_r1", "hermes")
    assert (p.tool_format, p.reasoning.start_mode) == ("hermes", "always")


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_every_rule_of_every_profile_has_an_action(name):
    p = get_profile(name)
    cls = syntax_for(p.tool_format)
    assert (cls is None) == (p.tool_format is None)
    m = ParserMachine(p, {}, InitialState.CONTENT)       # raises on a rule without an action
    actions = set(m._actions)
    assert {r.action for r in p.transitions.values()} <= actions, name


def test_syntax_registry_is_keyed_by_tool_format_and_rejects_unknown_ones():
    for fmt, cls in SYNTAXES.items():
        assert issubclass(cls, ToolSyntax) and cls.tool_format == fmt
    with pytest.raises(ValueError, match="hermes"):
        syntax_for("smoke_signals")
    bad = dataclasses.replace(get_profile("hermes"), tool_format="smoke_signals")
    with pytest.raises(ValueError, match="smoke_signals"):
        ParserMachine(bad, {}, InitialState.CONTENT)


def test_a_profile_rule_without_an_action_is_a_clear_error():
    p = get_profile("hermes")
    bad = dataclasses.replace(p, transitions={**p.transitions, ("content", "tool_close"): Rule("teleport")})
    with pytest.raises(ValueError, match="teleport"):
        ParserMachine(bad, {}, InitialState.CONTENT)


def test_without_a_tool_syntax_tool_markup_is_content():
    """`--tool-parser none` keeps the family's rules but no syntax: its calls stay text, even with parse_tools."""
    p = dataclasses.replace(get_profile("qwen3"), tool_format=None)
    m = ParserMachine(p, {"<tool_call>": 7}, InitialState.CONTENT, parse_tools=True)
    events = m.feed(7, "<tool_call>") + m.feed(None, '{"name": "f"}') + m.finish()
    assert "".join(getattr(e, "text", "") for e in events) == '<tool_call>{"name": "f"}'
