"""The text a client gets for the tokens generated (and echoed): `skip_special_tokens`, and the legacy completions'
`text_offset`s, which index the returned `text` (echo included) whatever tokens added no text to it.

Exact token sequences are forced on the random tiny Qwen3 with a graded `logit_bias` (the first ID strongest) and
penalties that push each token down once it is out; stories260K (a real SentencePiece model, BOS-prefixed prompts)
covers the echo. vLLM's `stop_reason` (which stop string or stop token ended a choice) is checked on the demo model."""
from __future__ import annotations

import json

import httpx
import pytest

from ember.parsers.events import ContentDelta
from ember.server.choice import ChoiceEnd, ChoiceStep, TokenInfo
from tests.conftest import shared_path
from tests.server.conftest import served

VISION_START, IM_START, IM_END = 151652, 151644, 151645  # specials of the real Qwen3 tokenizer


def _forced(ids: list[int], **body) -> dict:
    """A request body that makes the tiny Qwen3 generate exactly ``ids`` (and return them)."""
    bias = {str(t): 100 - 0.9 * k for k, t in enumerate(ids)}
    return dict(logit_bias=bias, presence_penalty=2.0, frequency_penalty=2.0, temperature=0, max_tokens=len(ids),
                return_token_ids=True, **body)


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json={"model": srv.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_completion(srv, body: dict) -> tuple[str, list[int], list[str], list[int], str | None]:
    """A streamed completion's text, token IDs, logprobs tokens and offsets, and finish_reason, as a client joins
    them."""
    client = srv.openai()
    text, ids, tokens, offsets, reason = "", [], [], [], None
    sdk = {"prompt", "max_tokens", "temperature", "echo", "logprobs", "stop", "logit_bias", "presence_penalty",
           "frequency_penalty"}
    known = {k: v for k, v in body.items() if k in sdk}
    extra = {k: v for k, v in body.items() if k not in sdk}  # vLLM's fields
    for ch in client.completions.create(model=srv.model, stream=True, extra_body=extra, **known):
        for c in ch.choices:
            text += c.text
            ids += getattr(c, "token_ids", None) or []
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
            reason = c.finish_reason or reason
    return text, ids, tokens, offsets, reason


# ------------------------------------------------------------------------------------------------ skip_special_tokens

@pytest.mark.parametrize("skip", [None, False, True])
def test_skip_special_tokens_true_drops_specials_and_unset_keeps_them(qwen3_server, skip):
    tok = qwen3_server.tokenizer
    ids = [tok.convert_tokens_to_ids("A"), VISION_START, tok.convert_tokens_to_ids("B"), IM_START]
    extra = {} if skip is None else {"skip_special_tokens": skip}
    expected = "AB" if skip else "A<|vision_start|>B<|im_start|>"
    assert tok.decode(ids, skip_special_tokens=bool(skip)) == expected
    c = _post(qwen3_server, "/v1/completions", _forced(ids, prompt="x", **extra))["choices"][0]
    assert c["token_ids"] == ids
    assert c["text"] == expected
    text, got, _, _, _ = _stream_completion(qwen3_server, _forced(ids, prompt="x", **extra))
    assert (text, got) == (expected, ids)
    m = _post(qwen3_server, "/v1/chat/completions", _forced(ids, messages=[{"role": "user", "content": "x"}],
                                                             **extra))["choices"][0]
    assert m["token_ids"] == ids
    assert m["message"]["content"] == expected


def test_a_skipped_special_never_matches_a_stop_string(qwen3_server):
    tok = qwen3_server.tokenizer
    ids = [tok.convert_tokens_to_ids("A"), VISION_START, tok.convert_tokens_to_ids("B"), IM_START]
    kept = _post(qwen3_server, "/v1/completions", _forced(ids, prompt="x", stop=["<|im_start|>"]))["choices"][0]
    assert (kept["text"], kept["finish_reason"]) == ("A<|vision_start|>B", "stop")  # the default: specials are text
    c = _post(qwen3_server, "/v1/completions",
              _forced(ids, prompt="x", stop=["<|im_start|>"], skip_special_tokens=True))["choices"][0]
    assert (c["token_ids"], c["text"], c["finish_reason"]) == (ids, "AB", "length")


def test_skip_special_tokens_never_drops_a_delimiter_the_parser_needs(qwen3_runtime):
    """Were `<think>`/`</think>` marked special (they are not in Qwen3), `skip_special_tokens` would keep them: the
    reasoning is still parsed."""
    import dataclasses

    from ember.parsers.pipeline import parse_all
    from ember.parsers.tokens import TokenBytes

    runtime, _ = qwen3_runtime
    setup = runtime.parser
    tb = setup.tb
    think, end_think = tb.added["<think>"], tb.added["</think>"]
    assert {think, end_think} <= set(setup.delimiter_ids.values())
    marked = TokenBytes(tb.bytes_table, special_ids=tb.special_ids | {think, end_think}, added=tb.added)
    setup = dataclasses.replace(setup, tb=marked)
    drop = setup.dropped_ids(True)
    assert VISION_START in drop and think not in drop and end_think not in drop
    assert setup.dropped_ids(None) == setup.dropped_ids(False) == setup.drop_ids
    tok = runtime.tokenizer
    ids = [think, *tok.encode("hm", add_special_tokens=False), VISION_START, end_think,
           *tok.encode("ok", add_special_tokens=False)]
    out = parse_all(setup.pipeline(special_ids_to_drop=drop), ids)
    assert (out.reasoning, out.content) == ("hm", "ok")


@pytest.mark.parametrize("setup_name", ["parser", "parser_plain"])  # chat's Qwen3 profile, completions' plain one
def test_an_ignored_eos_splits_neither_a_character_nor_a_stop_string(qwen3_runtime, setup_name):
    """Under `ignore_eos` an EOS (`<|im_end|>`, `<|endoftext|>`) is an ordinary special, as vLLM detokenizes it:
    skipped (the default, or `skip_special_tokens` true), the bytes of "é" and the stop string "AB" around it still
    join; with `skip_special_tokens` false its text is in the reply."""
    from ember.parsers.initial import InitialState
    from ember.parsers.pipeline import parse_all
    from ember.server.generation import make_pipeline

    runtime, _ = qwen3_runtime
    setup = getattr(runtime, setup_name)
    tok = runtime.tokenizer
    T = tok.convert_tokens_to_ids
    assert tok.convert_tokens_to_string(["Ã", "©"]) == "é"  # the byte-level pieces of "é"
    for eos in runtime.model_info.eos_token_ids:
        ids = [T("x"), T("Ã"), eos, T("©"), T("A"), eos, T("B"), T("C")]
        for skip in (None, True, False):
            pipe = make_pipeline(setup, InitialState.CONTENT, stop=["AB"], include_stop_str_in_output=False,
                                 tools=None, skip_special_tokens=skip, ignore_eos=True)
            decoded = tok.decode(ids, skip_special_tokens=skip is not False)
            out = parse_all(pipe, ids)
            assert out.content == decoded.partition("AB")[0], (eos, skip)
            assert pipe.matched_stop == ("AB" if "AB" in decoded else None)


def test_an_eos_that_ends_a_harmony_message_stays_structure_under_ignore_eos(qwen3_runtime):
    """gpt-oss's `<|call|>` and `<|return|>` end a message whether or not the turn ends: only `<|endoftext|>`
    becomes an ordinary token."""
    import dataclasses

    from ember.parsers.profiles import get_profile

    runtime, _ = qwen3_runtime
    ids = {"<|call|>": 1, "<|return|>": 2, "<|endoftext|>": 3}
    setup = dataclasses.replace(runtime.parser, profile=get_profile("gpt_oss"), delimiter_ids=ids,
                                eos_ids=frozenset(ids.values()))
    assert setup.ignorable_eos_ids == {3}


# ------------------------------------------------------------------------------------ text_offset of generated tokens

def _forced_strict(ids: list[int], **body) -> dict:
    bias = {str(t): 100 - 5 * k for k, t in enumerate(ids)}
    return dict(logit_bias=bias, repetition_penalty=10.0, temperature=0, max_tokens=len(ids), return_token_ids=True,
                **body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_whose_text_is_dropped_moves_no_later_offset(qwen3_server, stream):
    """EOS under `ignore_eos` (and a special under `skip_special_tokens`) adds nothing to `text`: the offsets of the
    tokens after it still index `text`."""
    tok = qwen3_server.tokenizer
    T = tok.convert_tokens_to_ids
    cases = [([T("Hello"), IM_END, T("Ġworld"), T("!")], {"ignore_eos": True}),
             ([T("Hello"), VISION_START, T("Ġworld"), T("!")], {"skip_special_tokens": True})]
    for ids, extra in cases:
        body = _forced_strict(ids, prompt="x", logprobs=0, **extra)
        if stream:
            text, got, tokens, offsets, _ = _stream_completion(qwen3_server, body)
        else:
            c = _post(qwen3_server, "/v1/completions", body)["choices"][0]
            lp = c["logprobs"]
            text, got, tokens, offsets = c["text"], c["token_ids"], lp["tokens"], lp["text_offset"]
        assert got == ids
        assert text == "Hello world!"
        assert offsets == [0, 5, 5, 11], (tokens, offsets)


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_that_completes_a_stop_string_points_inside_the_text(qwen3_server, stream):
    tok = qwen3_server.tokenizer
    T = tok.convert_tokens_to_ids
    ids = [T("Hello"), T("Ġworld"), T("!")]
    body = _forced_strict(ids, prompt="x", logprobs=0, stop=["lo w"])
    if stream:
        text, got, _, offsets, reason = _stream_completion(qwen3_server, body)
    else:
        c = _post(qwen3_server, "/v1/completions", body)["choices"][0]
        text, got, offsets, reason = c["text"], c["token_ids"], c["logprobs"]["text_offset"], c["finish_reason"]
    assert (text, got, reason) == ("Hel", ids[:2], "stop")
    assert offsets == [0, 3]


def test_a_token_prompt_that_ends_inside_a_character_is_finished_by_the_output(qwen3_server):
    """"Smile: " and 😀's first two bytes, then its last two and "!": the text is "😀!" as vLLM's (its detokenizer
    primed with the prompt), streamed alike. An echo is the prompt as it reads alone ("Smile: �"), then that text
    (vLLM's concatenation), and the generated tokens' offsets index the 😀 in it."""
    prompt, gen = [10673, 457, 25, 220, 172, 253], [246, 222, 0]
    assert qwen3_server.tokenizer.decode(prompt + gen) == "Smile: 😀!"
    c = _post(qwen3_server, "/v1/completions", _forced(gen, prompt=prompt))["choices"][0]
    assert (c["text"], c["token_ids"]) == ("😀!", gen)
    assert _stream_completion(qwen3_server, _forced(gen, prompt=prompt))[:2] == ("😀!", gen)
    body = _forced(gen, prompt=prompt, echo=True, logprobs=0)
    c = _post(qwen3_server, "/v1/completions", body)["choices"][0]
    assert c["text"] == "Smile: \ufffd😀!"
    assert c["logprobs"]["text_offset"][len(prompt):] == [8, 8, 9]
    text, _, _, offsets, _ = _stream_completion(qwen3_server, body)
    assert (text, offsets) == (c["text"], c["logprobs"]["text_offset"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_final_flush_ends_the_choice_as_a_stop(qwen3_server, stream):
    """`max_tokens` cuts the reply inside 🙏 (its first three bytes): the held bytes are flushed as U+FFFD, which
    completes the stop string; the text is cut there, so the choice ended by the stop string (it said `length`)."""
    gen = [64, 172, 253, 247]  # "a" + F0 9F 99
    for stop, include, text in (("\ufffd", False, "a"), ("a\ufffd", True, "a\ufffd")):
        body = _forced(gen, prompt="x", stop=[stop], include_stop_str_in_output=include)
        if stream:
            got, ids, _, _, reason = _stream_completion(qwen3_server, body)
        else:
            c = _post(qwen3_server, "/v1/completions", body)["choices"][0]
            got, ids, reason = c["text"], c["token_ids"], c["finish_reason"]
            assert c["stop_reason"] == stop
        assert (got, ids, reason) == (text, gen, "stop")


# ---------------------------------------------------------------------------------------------- echo (stories260K)

@pytest.fixture(scope="module")
def stories_server(tmp_path_factory):
    from ember.engine import convert_llama2c
    from ember.server.config import ServeConfig

    src = shared_path("models", "stories260K")
    out = tmp_path_factory.mktemp("stories260K-serve")
    assert convert_llama2c.main([str(src / "stories260K.bin"), str(src / "tok512.bin"), str(out)]) == 0
    config = ServeConfig(model_dir=out, served_model_name="stories", max_num_seqs=4, kv_cache_blocks=64)
    with served(config) as srv:
        yield srv


@pytest.mark.parametrize("prompt, echoed, prompt_offsets", [
    ("héllo", "héllo", [0, 0, 1, 2, 4]),          # <s> ' h' 'é' 'll' 'o'
    ([1, 403, 407], "Once upon", [0, 0, 4]),      # <s> ' Once' ' upon'
])
def test_echo_offsets_index_the_echoed_text_and_never_decrease(stories_server, prompt, echoed, prompt_offsets):
    """The BOS adds no text and the SentencePiece leading space is not in the echo: the prompt's offsets index the
    echo, and the generated tokens' continue after it."""
    tok = stories_server.tokenizer
    ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
    assert ids[0] == tok.bos_token_id and len(ids) == len(prompt_offsets)
    body = dict(prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    c = _post(stories_server, "/v1/completions", body)["choices"][0]
    text, lp = c["text"], c["logprobs"]
    assert text.startswith(echoed)
    offsets = lp["text_offset"]
    assert offsets[:len(ids)] == prompt_offsets
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert offsets[len(ids)] == len(echoed)
    for token, at in zip(lp["tokens"][len(ids):], offsets[len(ids):]):
        assert text[at:at + len(token)] == token
    streamed, _, _, stream_offsets, _ = _stream_completion(stories_server, body)
    assert (streamed, stream_offsets) == (text, offsets)


@pytest.mark.parametrize("ids", [[403, 407], [1, 403, 407]])
def test_echo_of_a_token_prompt_reads_as_the_tokenizer_decodes_it(stories_server, ids):
    """No SentencePiece leading space (`tokenizer.decode`, /detokenize, vLLM); a BOS is left out as the output leaves
    it out (and as the string prompt "Once upon", the same IDs, echoes)."""
    tok = stories_server.tokenizer
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon"
    c = _post(stories_server, "/v1/completions", dict(prompt=ids, max_tokens=0, echo=True))["choices"][0]
    assert c["text"] == "Once upon"
    gen = _post(stories_server, "/v1/completions", dict(prompt=ids, max_tokens=2, temperature=0))["choices"][0]
    c = _post(stories_server, "/v1/completions", dict(prompt=ids, max_tokens=2, temperature=0, echo=True))
    assert c["choices"][0]["text"] == "Once upon" + gen["text"]


def test_after_a_bos_only_prompt_the_text_has_no_leading_space(stories_server):
    """The SentencePiece space of the first word is dropped when the prompt has no text, as `tokenizer.decode` and
    vLLM drop it (not after a prompt with text: " a time"), so a stop string " " matches no phantom space."""
    tok = stories_server.tokenizer
    body = dict(prompt=[1], max_tokens=4, temperature=0, logprobs=0, return_token_ids=True)
    c = _post(stories_server, "/v1/completions", body)["choices"][0]
    assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True) == "Once upon a time"
    assert c["logprobs"]["text_offset"] == [0, 4, 9, 11]
    text, _, _, offsets, _ = _stream_completion(stories_server, body)
    assert (text, offsets) == ("Once upon a time", [0, 4, 9, 11])
    assert _post(stories_server, "/v1/completions", dict(body, stop=[" "]))["choices"][0]["text"] == "Once"
    after = _post(stories_server, "/v1/completions", dict(body, prompt=c["token_ids"][:2], max_tokens=2))
    assert after["choices"][0]["text"] == " a time"


# ------------------------------------------------------------------------------------------- stop_reason (vLLM's)

def _forced_demo(ids: list[int], **body) -> dict:
    """`_forced` for the demo model, whose logits spread wider: bias steps of 30, a token once out scaled down."""
    bias = {str(t): 100 - 30 * k for k, t in enumerate(ids)}
    return dict(logit_bias=bias, repetition_penalty=10.0, temperature=0, max_tokens=len(ids), return_token_ids=True,
                **body)


def _stream_choices(srv, path: str, body: dict) -> list[dict]:
    """The choice objects of a stream's chunks, in order, as sent."""
    with httpx.stream("POST", srv.url + path, json={"model": srv.model, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [c for d in data for c in json.loads(d)["choices"]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stop_reason_names_the_stop_string_or_token_that_ended_the_choice(demo_server, path):
    """vLLM's `stop_reason`: the matched stop string, the `stop_token_ids` token or another end token of
    generation_config.json (the demo's `<|endoftext|>`), else null (the model's EOS, even one listed in
    `stop_token_ids`, and length); the stream's finishing chunk holds the body's. Chat chunks before it hold no
    `stop_reason`, completion chunks hold null (as vLLM's)."""
    prompt = {"messages": [{"role": "user", "content": "x"}]} if path.endswith("chat/completions") else {"prompt": "x"}
    tok = demo_server.tokenizer
    a, b, c, eos_id = [*tok.convert_tokens_to_ids(["A", "B", "C"]), tok.eos_token_id]
    other_end = tok.convert_tokens_to_ids("<|endoftext|>")
    assert other_end in demo_server.runtime.model_info.eos_token_ids and other_end != eos_id
    abc = _forced_demo([a, b, c], **prompt)
    eos = dict(logit_bias={str(eos_id): 100}, temperature=0, max_tokens=2, **prompt)  # the chat prompt holds EOS
    end = dict(logit_bias={str(other_end): 100}, temperature=0, max_tokens=2, **prompt)
    cases = [(abc, {"stop": ["B"]}, "stop", "B"), (abc, {"stop_token_ids": [b]}, "stop", b),
             (eos, {}, "stop", None), (eos, {"stop_token_ids": [eos_id]}, "stop", None),
             (end, {}, "stop", other_end), (abc, {}, "length", None)]
    for forced, extra, reason, stop_reason in cases:
        body = {**forced, **extra}
        choice = _post(demo_server, path, body)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == (reason, stop_reason), extra
        *before, last = _stream_choices(demo_server, path, body)
        assert (last["finish_reason"], last["stop_reason"]) == (reason, stop_reason), extra
        if "messages" in prompt:
            assert all("stop_reason" not in ch for ch in before)
        else:
            assert all(ch["stop_reason"] is None for ch in before)


@pytest.mark.parametrize("end", [ChoiceEnd("stop_string", stop_string="é\"n"), ChoiceEnd("eos", stop_token=33)])
def test_chat_fast_path_writes_stop_reason_as_the_chunk_dicts(end):
    from ember.server.openai_encoder import ChatChoiceEncoder, ChunkMeta, sse_line

    meta = ChunkMeta(id="chatcmpl-x", created=1, model="m", return_token_ids=True, include_usage=True)
    step = ChoiceStep(0, [TokenInfo(5, channel="content")], [ContentDelta("hi")], end)
    want = "".join(sse_line(ch) for ch in ChatChoiceEncoder(meta, 0, lambda t: b"hi").step(step))
    assert ChatChoiceEncoder(meta, 0, lambda t: b"hi").step_sse(step) == want
    assert want.count('"stop_reason"') == 1


def test_a_stop_token_that_is_a_delimiter_leaves_no_text(demo_server):
    """`stop_token_ids` naming a delimiter (`<tool_call>` in the answer, `</think>` in a thought): the reply ends
    there without its text."""
    tok = demo_server.tokenizer
    a = tok.convert_tokens_to_ids("A")
    for delim, thinking, field in (("<tool_call>", False, "content"), ("</think>", True, "reasoning_content")):
        d = tok.convert_tokens_to_ids(delim)
        body = _forced_demo([a, d], messages=[{"role": "user", "content": "x"}], stop_token_ids=[d],
                            chat_template_kwargs={"enable_thinking": thinking})
        choice = _post(demo_server, "/v1/chat/completions", body)["choices"][0]
        assert (choice["message"][field], choice["stop_reason"]) == ("A", d), choice


# ------------------------------------------------------------- text_offset of tokens held for a stop string (streamed)

def _completion_steps(runtime, ids: list[int], cuts: tuple[int, ...], stop: list[str]) -> list[ChoiceStep]:
    """`run_choice`'s steps for a completion that generates ``ids``, the engine's outputs split before the positions
    ``cuts`` (as a lagging client's coalesced outputs split them)."""
    import asyncio
    from types import SimpleNamespace

    from ember.engine.params import RequestOutput, SamplingParams, TokenLogprob
    from ember.parsers.initial import InitialState
    from ember.server.generation import ChoiceSpec, GenRequest, make_pipeline, run_choice

    bounds = [0, *cuts, len(ids)]

    async def generate(prompt_ids, params, *, request_id, constraint):
        for a, b in zip(bounds, bounds[1:]):
            done = b == len(ids)
            yield RequestOutput(request_id, ids[a:b], [TokenLogprob(t, -1.0) for t in ids[a:b]], finished=done,
                                finish_reason="length" if done else None)

    pipe = make_pipeline(runtime.parser_plain, InitialState.CONTENT, stop=stop, include_stop_str_in_output=False,
                         tools=None)
    req = GenRequest("cmpl-x", [ChoiceSpec([1], SamplingParams(max_tokens=len(ids), logprobs=0), pipe)])
    rt = SimpleNamespace(engine=SimpleNamespace(generate=generate), stopping=None, in_flight=set(),
                         request_log=None, model_info=runtime.model_info, tokenizer=runtime.tokenizer)

    async def steps() -> list[ChoiceStep]:
        return [s async for s in run_choice(rt, req, 0)]
    return asyncio.run(steps())


@pytest.mark.parametrize("stop, text, offsets", [
    (["ABC"], "x", [0, 1, 1, 1]),           # "ABC" completes at C: "B", held, starts past the cut text
    (["ABD"], "xABCD", [0, 1, 2, 3, 4]),    # "AB" held, then released with "C"
    (["CD"], "xAB", [0, 1, 2, 3, 3]),
])
def test_streamed_offsets_of_text_held_for_a_stop_string_equal_the_body(qwen3_runtime, stop, text, offsets):
    """A token whose text the stop matcher holds back may start past the text the choice ends with: in every split
    into chunks its streamed `text_offset` is the body's (at most the text's length), and each token's logprob rides
    in exactly one chunk, in order."""
    import itertools

    from ember.server.openai_encoder import ChunkMeta, CompletionChoiceEncoder, fold_completion

    runtime, _ = qwen3_runtime
    ids = runtime.tokenizer.convert_tokens_to_ids(["x", "A", "B", "C", "D"])
    meta = ChunkMeta(id="cmpl-x", created=1, model="m", logprobs=True, return_token_ids=True)
    n = len(offsets)
    for k in range(len(ids)):
        for cuts in itertools.combinations(range(1, len(ids)), k):
            enc = CompletionChoiceEncoder(meta, 0, runtime.token_bytes.token_bytes)
            chunks = [ch for s in _completion_steps(runtime, ids, cuts, stop) for ch in enc.step(s)]
            streamed = [o for ch in chunks if ch["choices"][0]["logprobs"] for o in ch["choices"][0]["logprobs"][
                "text_offset"]]
            assert streamed == offsets, cuts
            for ch in chunks:
                c = ch["choices"][0]
                assert len(c["token_ids"]) == len(c["logprobs"]["tokens"] if c["logprobs"] else ())
            body = fold_completion(chunks, usage_body=None)["choices"][0]
            assert (body["text"], body["token_ids"], body["logprobs"]["text_offset"]) == (text, ids[:n], offsets)


def test_streamed_offsets_of_a_cut_stop_string_equal_the_body(qwen3_server):
    """Through the server: "B", held for the stop string "ABC" and cut with it, starts where the text ends in the
    stream as in the body."""
    T = qwen3_server.tokenizer.convert_tokens_to_ids
    body = _forced_strict([T("Hello"), T("A"), T("B"), T("C")], prompt="x", logprobs=0, stop=["ABC"])
    c = _post(qwen3_server, "/v1/completions", body)["choices"][0]
    assert (c["text"], c["logprobs"]["text_offset"]) == ("Hello", [0, 5, 5, 5])
    text, _, _, offsets, _ = _stream_completion(qwen3_server, body)
    assert (text, offsets) == ("Hello", [0, 5, 5, 5])
