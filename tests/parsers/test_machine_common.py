"""Shared helpers of the ParserMachine tests (feeding, merging, folding events), plus the profile-level tests."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from ember.parsers.events import (ContentDelta, Dropped, Malformed, ReasoningDelta, ToolCallArguments, ToolCallEnd,
                                  ToolCallStart)
from ember.parsers.machine import ParserMachine
from ember.parsers.profiles import PROFILE_NAMES, detect_profile, get_profile
from tests.conftest import shared_path

QWEN_IDS = {"<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658,
            "<|im_end|>": 151645, "<|endoftext|>": 151643}
HARMONY_IDS = {"<|start|>": 200006, "<|channel|>": 200005, "<|constrain|>": 200003, "<|message|>": 200008,
               "<|end|>": 200007, "<|call|>": 200012, "<|return|>": 200002, "<|endoftext|>": 199999}
DEEPSEEK_IDS = {"<｜end▁of▁sentence｜>": 1}       # `<think>`/`</think>` are several tokens in DeepSeek-V3's vocab


def machine(profile: str, ids: dict, initial: str = "CONTENT", tools=None, **kw) -> ParserMachine:
    return ParserMachine(get_profile(profile), ids, initial, tools, call_id=lambda i: f"call_{i}", **kw)


def run(m: ParserMachine, tokens, cut: bool = False) -> list:
    """Feed (token_id, text) pairs (or bare texts), then finish (``cut``: by a length limit); all events."""
    events = []
    for t in tokens:
        events += m.feed(*t) if isinstance(t, tuple) else m.feed(None, t)
    return events + m.finish(cut)


def merged(events) -> list:
    """Adjacent same-kind deltas joined (their split depends on the chunking, nothing else may)."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if type(e) is type(last) and isinstance(e, (ReasoningDelta, ContentDelta)):
            out[-1] = type(e)(last.text + e.text)
        elif type(e) is type(last) and isinstance(e, (Dropped, Malformed)) and e.reason == last.reason:
            out[-1] = type(e)(last.text + e.text, e.reason)
        elif isinstance(e, ToolCallArguments) and isinstance(last, ToolCallArguments) and e.index == last.index:
            out[-1] = ToolCallArguments(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out


@dataclass
class Folded:
    reasoning: str = ""
    content: str = ""
    malformed: str = ""
    calls: list = field(default_factory=list)     # [name, arguments, ended]


def fold(events) -> Folded:
    f = Folded()
    for e in events:
        if isinstance(e, ReasoningDelta):
            f.reasoning += e.text
        elif isinstance(e, ContentDelta):
            f.content += e.text
        elif isinstance(e, Malformed):
            f.malformed += e.text
        elif isinstance(e, ToolCallStart):
            assert e.index == len(f.calls) and (e.id == f"call_{e.index}" or e.id.startswith("functions.")  # Kimi
                                                or len(e.id) == 9 and e.id.isalnum())                # Mistral
            f.calls.append([e.name, "", False])
        elif isinstance(e, ToolCallArguments):
            assert e.index == len(f.calls) - 1 and not f.calls[-1][2]
            f.calls[-1][1] += e.fragment
        elif isinstance(e, ToolCallEnd):
            assert e.index == len(f.calls) - 1 and not f.calls[-1][2]
            f.calls[-1][2] = True
    return f


def raw_text(events) -> str:
    """Every byte the events account for, in order (names stand for their own bytes)."""
    parts = []
    for e in events:
        if isinstance(e, (ReasoningDelta, ContentDelta, Malformed, Dropped)):
            parts.append(e.text)
        elif isinstance(e, ToolCallStart):
            parts.append(e.name)
        elif isinstance(e, ToolCallArguments):
            parts.append(e.fragment)
    return "".join(parts)


def split(text: str, cuts) -> list[str]:
    """``text`` cut at the given character offsets."""
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


# ------------------------------------------------------------------------------------------------- profile tests
def test_every_profile_is_known_by_name_and_unknown_names_are_a_clear_error():
    for name in PROFILE_NAMES:
        p = get_profile(name)
        assert p.name == name
        assert p.token_id_terminals <= set(p.terminals)
        for (state, terminal), rule in p.transitions.items():
            assert terminal in p.terminals, (name, state, terminal)
    assert {"qwen3", "qwen3_coder", "deepseek_r1", "deepseek_v3", "hermes", "gpt_oss", "none"} <= set(PROFILE_NAMES)
    with pytest.raises(ValueError, match="qwen3_coder"):
        get_profile("qwen4")


@pytest.mark.parametrize("path, expected", [
    ("templates/hf/Qwen3-0.6B.jinja", "qwen3"),
    ("templates/hf/Qwen3-Thinking-2507.jinja", "qwen3"),
    ("templates/llama.cpp/Qwen-QwQ-32B.jinja", "qwen3"),
    ("templates/hf/Qwen3-Coder.jinja", "qwen3_coder"),
    ("templates/llama.cpp/Qwen3.5-4B.jinja", "qwen3_coder"),
    ("templates/vllm/tool_chat_template_qwen3coder.jinja", "qwen3_coder"),
    ("templates/hf/DeepSeek-R1-Distill-Qwen-14B.jinja", "deepseek_r1"),
    ("templates/llama.cpp/llama-cpp-deepseek-r1.jinja", "deepseek_r1"),
    ("templates/llama.cpp/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("templates/llama.cpp/Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("templates/vllm/tool_chat_template_hermes.jinja", "hermes"),
    ("templates/llama.cpp/openai-gpt-oss-120b.jinja", "gpt_oss"),
    ("templates/llama.cpp/meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json"),
    ("templates/hf/DeepSeek-V3.jinja", "deepseek_v3"),
])
def test_profile_detected_from_real_chat_templates(path, expected):
    assert detect_profile(shared_path(path).read_text()) == expected


@pytest.mark.parametrize("folder, expected", [("qwen3", "qwen3"), ("qwen3-thinking-2507", "qwen3"),
                                              ("qwen3-coder", "qwen3_coder"),
                                              ("deepseek-r1-distill-qwen-14b", "deepseek_r1")])
def test_profile_detected_from_real_tokenizer_configs(folder, expected):
    config = json.loads(shared_path("tokenizers", folder, "tokenizer_config.json").read_text())
    assert detect_profile(config["chat_template"]) == expected


def test_detection_falls_back_to_model_type_and_then_none():
    assert detect_profile(None, "gpt_oss") == "gpt_oss"
    assert detect_profile("", "qwen3_moe") == "qwen3"
    assert detect_profile("{{ messages }}", "llama") == "none"
    assert detect_profile(None) == "none"


def test_token_id_terminals_are_single_tokens_in_the_real_qwen3_and_gpt_oss_vocabularies():
    import gzip

    from tokenizers import Tokenizer

    for folder, profile, ids in (("qwen3", "qwen3", QWEN_IDS), ("gpt-oss", "gpt_oss", HARMONY_IDS)):
        tok = Tokenizer.from_str(gzip.decompress(shared_path("tokenizers", folder, "tokenizer.json.gz")
                                                 .read_bytes()).decode())
        p = get_profile(profile)
        for name in p.token_id_terminals:
            text = p.terminals[name]
            assert tok.encode(text, add_special_tokens=False).ids == [ids[text]], (profile, text)
