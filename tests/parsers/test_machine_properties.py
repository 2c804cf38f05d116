"""Property tests of ParserMachine over generated replies for every profile (design invariants I1-I4, I6-I8, I12-I14):
the same events for every chunking of the text into tokens, every byte in exactly one event, the expected split into
reasoning / content / tool calls, and sane results when the stream is cut at any token."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.parsers.events import ToolCallArguments
from tests.parsers.test_machine_common import (DEEPSEEK_IDS, HARMONY_IDS, QWEN_IDS, fold, machine, merged, raw_text,
                                               run)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.data_too_large])
PIECES = ["a", "b", "Z", " ", "\n", "\t", "<", ">", "/", "=", "é", "中", "😀", "{", "}", "[", '"', "\\", "|", ":",
          "think", "tool_call", "function", "parameter", "</think>", "<think>", "<tool_call>", "</tool_call>",
          "</parameter", "<parameter=", "</function>", "<function=", "<|end|>", "<|channel|>", "<|message|>",
          "<|im_end|>"]
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def text(exclude=(), max_size=8):
    return (st.lists(st.sampled_from(PIECES), max_size=max_size).map("".join)
            .filter(lambda t: not any(x in t for x in exclude)))


def json_values():
    scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False,
                                                                               allow_infinity=False) | text()
    return st.recursive(scalars, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(text(max_size=3), ch,
                                                                                        max_size=3), max_leaves=6)


NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@st.composite
def hermes_call(draw):
    """(name, arguments object, the call body text as the model writes it, name first?)."""
    name = draw(NAMES)
    args = draw(st.dictionaries(text(max_size=3), json_values(), max_size=3))
    dumped = json.dumps(args, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])),
                        separators=draw(st.sampled_from([None, (",", ":")])))
    sp = draw(st.sampled_from(["", " ", "\n  "]))
    name_first = draw(st.integers(0, 4)) > 0          # mostly the template's order, sometimes arguments first
    parts = [f'"name":{sp}{json.dumps(name)}', f'"arguments":{sp}{dumped}']
    body = "{" + sp + ("," + sp).join(parts if name_first else parts[::-1]) + sp + "}"
    return name, args, "\n" + body + "\n", name_first


def reply_head(draw, think_close_id: int | None):
    """The opening of a tool-call family's reply: a random initial state; in REASONING a free thought closed by
    ``</think>`` (token ``think_close_id``, or text where it is None); free content; how many calls follow (0-3).
    Returns ``(segments, initial, reasoning, content, n)``."""
    free = text(exclude=("<think>", "</think>"))
    initial = draw(st.sampled_from(["REASONING", "CONTENT"]))
    segs, reasoning = [], ""
    if initial == "REASONING":
        reasoning = draw(free)
        segs += [(None, reasoning), (think_close_id, "</think>")]
    content = draw(free)
    segs.append((None, content))
    return segs, initial, reasoning, content, draw(st.integers(0, 3))


def check_tool_reply(events, toks, reasoning: str, content: str, calls: list) -> None:
    """The fold of a `reply_head` reply with ``calls`` ``(name, arguments)``: the thought, the content (whitespace
    before calls is dropped), every call complete with its arguments, and every byte once."""
    f = fold(events)
    assert (f.reasoning, f.malformed) == (reasoning, "")
    assert f.content == (content if not calls or content.strip() else "")
    assert [(nm, json.loads(a), e) for nm, a, e in f.calls] == [(nm, a, True) for nm, a in calls]
    assert raw_text(events) == "".join(t for _, t in toks)


def tokens_of(draw, segments):
    """Delimiter segments stay single tokens; text segments are cut into random tokens."""
    toks = []
    for tid, t in segments:
        if tid is not None:
            toks.append((tid, t))
            continue
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(t) - 1)), max_size=len(t)))))
        toks += [(None, t[a:b]) for a, b in zip([0, *cuts], [*cuts, len(t)]) if t[a:b]]
    return toks


def per_char(toks):
    return [(tid, t) if tid is not None else (None, c) for tid, t in toks for c in ([t] if tid is not None else t)]


def check_chunking_and_truncation(profile, ids, initial, toks, tools=None, exact_bytes=True):
    """I1 + I3 + I13 + I14: feeding ``toks``, the same text char by char, and every truncation of it."""
    events = run(machine(profile, ids, initial, tools), toks)
    assert merged(events) == merged(run(machine(profile, ids, initial, tools), per_char(toks)))
    full = "".join(t for _, t in toks)
    if exact_bytes:
        assert raw_text(events) == full
    final = fold(events)
    step = max(1, len(toks) // 12)
    for k in sorted({*range(0, len(toks) + 1, step), len(toks) - 1}):
        m = machine(profile, ids, initial, tools)
        streamed = [e for tok in toks[:k] for e in m.feed(*tok)]
        streamed_fold = fold(streamed)
        assert final.reasoning.startswith(streamed_fold.reasoning)
        assert final.content.startswith(streamed_fold.content)
        for got, want in zip(streamed_fold.calls, final.calls):
            assert got[0] == want[0] and want[1].startswith(got[1])
        cut = streamed + m.finish()
        again = run(machine(profile, ids, initial, tools), per_char(toks[:k]))
        assert merged(cut) == merged(again)
        if exact_bytes:
            assert raw_text(cut) == "".join(t for _, t in toks[:k])
        for name, args, ended in fold(cut).calls:
            assert ended
    return events


def expected_content(segments, n_calls):
    """Design A.6: a whitespace-only content segment next to a tool call is Dropped; other content verbatim."""
    out = []
    for i, seg in enumerate(segments):
        followed_by_call = i < len(segments) - 1
        if seg.strip() == "" and (followed_by_call or n_calls):
            continue
        out.append(seg)
    return "".join(out)


def think_tool_reply(draw, profile, ids):
    """A Qwen3 / Hermes reply: optional thought, content and JSON tool calls, as (segments, expectation)."""
    tid = lambda t: ids.get(t)                                  # noqa: E731
    spelled_ok = bool(ids)                                      # delimiters are tokens: their spellings are text
    free = text() if spelled_ok else text(exclude=TAGS)
    segs, reasoning = [], ""
    initial = "CONTENT"
    if profile == "qwen3":
        initial = draw(st.sampled_from(["REASONING", "CONTENT"]))
        if initial == "REASONING" or draw(st.booleans()):
            if initial == "CONTENT":
                segs.append((tid("<think>"), "<think>"))
            reasoning = draw(free)
            segs += [(None, reasoning), (tid("</think>"), "</think>")]
    contents, calls = [], []
    for _ in range(draw(st.integers(0, 3))):
        c = draw(free | st.sampled_from(["", "\n", "\n\n"]))
        name, args, body, name_first = draw(hermes_call())
        contents.append(c)
        calls.append((name, args, name_first))
        segs += [(None, c), (tid("<tool_call>"), "<tool_call>"), (None, body), (tid("</tool_call>"), "</tool_call>")]
    last = draw(free | st.sampled_from(["", "\n"]))
    contents.append(last)
    segs.append((None, last))
    if draw(st.booleans()) and ids:
        segs.append((ids["<|im_end|>"], "<|im_end|>"))
    return initial, [s for s in segs if s[1]], reasoning, expected_content(contents, len(calls)), calls


@SETTINGS
@given(st.data(), st.sampled_from(["qwen3", "hermes"]), st.booleans())
def test_qwen3_and_hermes_replies(data, profile, by_id):
    ids = QWEN_IDS if by_id else {}
    initial, segs, reasoning, content, calls = think_tool_reply(data.draw, profile, ids)
    toks = tokens_of(data.draw, segs)
    all_name_first = all(nf for *_, nf in calls)
    events = check_chunking_and_truncation(profile, ids, initial, toks, exact_bytes=all_name_first)
    f = fold(events)
    assert (f.reasoning, f.content, f.malformed) == (reasoning, content, "")
    assert [(n, json.loads(a), e) for n, a, e in f.calls] == [(n, a, True) for n, a, _ in calls]
    if not all_name_first:
        assert sorted(raw_text(events)) == sorted("".join(t for _, t in toks))


CODER_TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "force": {"type": "boolean"}, "lines": {"type": "array"}, "opts": {"type": "object"}, "note": {}}}}}]
def _plain_value(v: str) -> bool:
    """Text a Qwen3-Coder value can hold: none of the tags that end one, nor the start of its close tag at its end."""
    return not any(t in v for t in ("</parameter>", "<parameter=", "</function>")) and not v.endswith("</parameter")


CODER_VALUES = {
    "path": text(max_size=10).filter(_plain_value),
    "count": st.integers(-1000, 1000),
    "ratio": st.floats(allow_nan=False, allow_infinity=False),
    "force": st.booleans(),
    "lines": st.lists(st.integers(0, 9), max_size=3),
    "opts": st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), max_size=2),
    "note": text(max_size=6).filter(_plain_value),
}


def _xml_value(key, v) -> str:
    if key in ("path", "note"):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, (list, dict, float)) else str(v)


@SETTINGS
@given(st.data())
def test_qwen3_coder_replies(data):
    draw = data.draw
    ids = QWEN_IDS
    initial = draw(st.sampled_from(["REASONING", "CONTENT"]))
    segs, reasoning = [], ""
    if initial == "REASONING":
        reasoning = draw(text())
        segs += [(None, reasoning), (ids["</think>"], "</think>")]
    contents, calls = [], []
    for _ in range(draw(st.integers(0, 3))):
        c = draw(text(exclude=("<tool_call>",)) | st.sampled_from(["", "\n"]))
        name = draw(st.sampled_from(["edit", "other_tool"]))
        keys = draw(st.lists(st.sampled_from(sorted(CODER_VALUES)), unique=True, max_size=4))
        args = {k: draw(CODER_VALUES[k]) for k in keys}
        body = f"\n<function={name}>\n" + "".join(f"<parameter={k}>\n{_xml_value(k, v)}\n</parameter>\n"
                                                  for k, v in args.items()) + "</function>\n"
        if name == "other_tool":          # not among the tools: every value is a string
            args = {k: _xml_value(k, v) for k, v in args.items()}
        contents.append(c)
        calls.append((name, args))
        segs += [(None, c), (ids["<tool_call>"], "<tool_call>"), (None, body), (ids["</tool_call>"], "</tool_call>")]
    last = draw(text() | st.just("\n"))
    contents.append(last)
    segs.append((None, last))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    events = check_chunking_and_truncation("qwen3_coder", ids, initial, toks, CODER_TOOLS, exact_bytes=False)
    f = fold(events)
    assert (f.reasoning, f.content, f.malformed) == (reasoning, expected_content(contents, len(calls)), "")
    assert [(n, json.loads(a), e) for n, a, e in f.calls] == [(n, a, True) for n, a in calls]


@SETTINGS
@given(st.data(), st.booleans())
def test_deepseek_r1_replies_with_text_matched_tags(data, reopened):
    draw = data.draw
    reasoning = draw(text(exclude=("<think>", "</think>")))
    content = draw(text(exclude=("<think>", "</think>")))
    full = ("<think>" if reopened else "") + reasoning + "</think>" + content
    segs = [(None, full)]
    if draw(st.booleans()):
        segs.append((DEEPSEEK_IDS["<｜end▁of▁sentence｜>"], "<｜end▁of▁sentence｜>"))
    toks = tokens_of(draw, segs)
    f = fold(check_chunking_and_truncation("deepseek_r1", DEEPSEEK_IDS, "REASONING", toks))
    assert (f.reasoning, f.content, f.malformed) == (reasoning, content, "")


@SETTINGS
@given(st.data())
def test_none_profile_is_all_content_whatever_the_tokens(data):
    segs = data.draw(st.lists(st.one_of(text().map(lambda t: (None, t)),
                                        st.sampled_from(sorted(QWEN_IDS.items())).map(lambda kv: (kv[1], kv[0]))),
                              max_size=6))
    toks = tokens_of(data.draw, [s for s in segs if s[1]])
    f = fold(check_chunking_and_truncation("none", QWEN_IDS, "REASONING", toks))
    assert f.content == "".join(t for _, t in toks) and f.reasoning == "" and f.calls == []


@SETTINGS
@given(st.data())
def test_gpt_oss_harmony_replies(data):
    draw = data.draw
    H = HARMONY_IDS
    segs, reasoning, content, calls = [], "", "", []
    n = draw(st.integers(1, 4))
    for i in range(n):
        if i:
            segs += [(H["<|start|>"], "<|start|>"), (None, "assistant")]
        kind = draw(st.sampled_from(["analysis", "final", "commentary", "tool"]))
        if kind == "tool":
            name = draw(NAMES)
            segs += [(H["<|channel|>"], "<|channel|>"), (None, f"commentary to=functions.{name} ")]
            if draw(st.booleans()):
                segs += [(H["<|constrain|>"], "<|constrain|>"), (None, "json")]
            body = json.dumps(draw(st.dictionaries(text(max_size=3), json_values(), max_size=3)),
                              ensure_ascii=draw(st.booleans()))
            calls.append((name, json.loads(body)))
        else:
            segs += [(H["<|channel|>"], "<|channel|>"), (None, kind)]
            body = draw(text())
            if kind == "analysis":
                reasoning += body
            else:
                content += body
        segs += [(H["<|message|>"], "<|message|>"), (None, body)]
        closer = "<|call|>" if kind == "tool" else ("<|return|>" if i == n - 1 else "<|end|>")
        segs.append((H[closer], closer))
    toks = tokens_of(draw, [s for s in segs if s[1]])
    f = fold(check_chunking_and_truncation("gpt_oss", H, "CONTENT", toks))
    assert (f.reasoning, f.content, f.malformed) == (reasoning, content, "")
    assert [(nm, json.loads(a), e) for nm, a, e in f.calls] == [(nm, a, True) for nm, a in calls]


def test_arguments_stream_as_append_only_fragments_in_order():
    m = machine("qwen3", QWEN_IDS)
    m.feed(QWEN_IDS["<tool_call>"], "<tool_call>")
    body = '\n{"name": "f", "arguments": {"k": "v\\"}", "n": [1, 2]}}\n'
    frags = [e.fragment for ch in body for e in m.feed(None, ch) if isinstance(e, ToolCallArguments)]
    assert len(frags) > 10 and "".join(frags) == '{"k": "v\\"}", "n": [1, 2]}'
