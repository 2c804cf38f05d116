"""Legacy `/v1/completions` logprobs as OpenAI and vLLM clients read them: `text_offset` indexes the returned text
(also across characters split over several tokens), each position's `top_logprobs` holds its own token, and
`max_tokens: 0` with `echo` scores a prompt without generating."""
from __future__ import annotations

import openai
import pytest


def _offsets_index_the_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert offsets == sorted(offsets)
    for tok, at in zip(tokens, offsets):
        if "\ufffd" not in tok:  # a token of whole characters is found where its offset points
            assert text[at:at + len(tok)] == tok, (tok, at, text)


@pytest.mark.parametrize("prompt", ["café au lait", "日本語 😀 ok"])
def test_text_offsets_point_into_the_text_across_split_characters(demo_server, prompt):
    client = demo_server.openai()
    ask = dict(model=demo_server.model, prompt=prompt, echo=True, logprobs=1, max_tokens=8, temperature=1.0, seed=3)
    c = client.completions.create(**ask).choices[0]
    lp = c.logprobs
    n_prompt = len(demo_server.tokenizer.encode(prompt))
    _offsets_index_the_text(c.text, lp.tokens, lp.text_offset)
    assert lp.text_offset[n_prompt] == len(prompt)  # the first generated token starts right after the echo
    streamed = [o for ch in client.completions.create(**ask, stream=True) for x in ch.choices if x.logprobs
                for o in x.logprobs.text_offset]
    assert streamed == lp.text_offset


@pytest.mark.parametrize("prompt", ["e\u0301e\u0301 hi there", "Cafe\u0301 au lait"])
def test_offsets_index_a_prompt_the_tokenizer_normalises_as_it_was_sent(demo_server, prompt):
    """The tokenizer reads a decomposed accent as its NFC form, which is shorter; the echo is the prompt as sent, and
    the prompt tokens' offsets index that text (they indexed the normalised one, pointing before the words)."""
    client = demo_server.openai()
    ask = dict(model=demo_server.model, prompt=prompt, echo=True, logprobs=0, max_tokens=2, temperature=0)
    c = client.completions.create(**ask).choices[0]
    lp, n_prompt = c.logprobs, len(demo_server.tokenizer.encode(prompt))
    assert c.text.startswith(prompt) and lp.text_offset == sorted(lp.text_offset)
    plain = [(t, at) for t, at in zip(lp.tokens[:n_prompt], lp.text_offset) if t.isascii()]
    assert plain and all(c.text[at:at + len(t)] == t for t, at in plain), (plain, c.text)
    assert lp.text_offset[n_prompt] == len(prompt)
    streamed = [o for ch in client.completions.create(**ask, stream=True) for x in ch.choices if x.logprobs
                for o in x.logprobs.text_offset]
    assert streamed == lp.text_offset


def test_echoed_special_token_text_keeps_its_offsets(demo_server):
    """A string prompt that spells a special token (`<|im_end|>`) is echoed as given, and the offsets count that
    token's text, streamed or not."""
    client = demo_server.openai()
    ask = dict(model=demo_server.model, prompt="ab<|im_end|>cd", echo=True, logprobs=0, max_tokens=2, temperature=0)
    c = client.completions.create(**ask).choices[0]
    assert c.text.startswith("ab<|im_end|>cd")
    _offsets_index_the_text(c.text, c.logprobs.tokens, c.logprobs.text_offset)
    streamed = [o for ch in client.completions.create(**ask, stream=True) for x in ch.choices if x.logprobs
                for o in x.logprobs.text_offset]
    assert streamed == c.logprobs.text_offset


def test_streamed_prompt_token_ids_sit_in_the_choice(demo_server):
    """vLLM's stream choice carries `prompt_token_ids` (with `return_token_ids`), one list per prompt."""
    client = demo_server.openai()
    ids = [demo_server.tokenizer.encode(p) for p in ("Once", "upon")]
    chunks = list(client.completions.create(model=demo_server.model, prompt=["Once", "upon"], max_tokens=1,
                                            stream=True, extra_body={"return_token_ids": True}))
    got = {x.index: x.model_extra["prompt_token_ids"] for ch in chunks for x in ch.choices
           if "prompt_token_ids" in x.model_extra}
    assert got == {0: ids[0], 1: ids[1]}
    assert all("prompt_token_ids" not in ch.model_extra for ch in chunks)


def test_booleans_are_not_token_ids(demo_server):
    client = demo_server.openai()
    for field, prompt, extra in (("prompt", [True, 5], {}), ("stop_token_ids", "x", {"stop_token_ids": [True]}),
                                 ("allowed_token_ids", "x", {"allowed_token_ids": [False, 5]})):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=demo_server.model, prompt=prompt, max_tokens=1, extra_body=extra)
        assert field in e.value.body["param"], e.value.body


def test_a_character_split_over_tokens_has_one_offset(demo_server):
    """`é` is two byte tokens in the demo vocabulary: both sit at 0, and what follows starts at 1."""
    client = demo_server.openai()
    assert len(demo_server.tokenizer.encode("é")) == 2
    lp = client.completions.create(model=demo_server.model, prompt="é", echo=True, logprobs=0, max_tokens=2,
                                   temperature=0).choices[0].logprobs
    assert lp.text_offset[:3] == [0, 0, 1]


def test_top_logprobs_hold_the_sampled_and_the_prompt_token(demo_server):
    """OpenAI: "up to logprobs+1 elements"; vLLM puts the position's own token beside the best `logprobs` others."""
    client = demo_server.openai()
    prompt = "The capital of France is"
    n_prompt = len(demo_server.tokenizer.encode(prompt))
    for echo in (False, True):
        lp = client.completions.create(model=demo_server.model, prompt=prompt, echo=echo, logprobs=2, max_tokens=12,
                                       temperature=1.5, seed=1).choices[0].logprobs
        scored = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
        if echo:
            assert scored[0][2] is None and len(scored) == n_prompt + 12
            scored = scored[1:]
        for token, logprob, top in scored:
            assert top[token] == logprob and 2 <= len(top) <= 3
        assert any(len(top) == 3 for _, _, top in scored)  # a token outside the best two comes on top of them


def test_max_tokens_zero_with_echo_scores_the_prompt(demo_server):
    client = demo_server.openai()
    prompt = "Once upon a time"
    ids = demo_server.tokenizer.encode(prompt)
    scored = client.completions.create(model=demo_server.model, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    c = scored.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    one = client.completions.create(model=demo_server.model, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0).choices[0].logprobs
    assert c.logprobs.tokens == one.tokens[:len(ids)]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(one.token_logprobs[1:len(ids)], abs=1e-4)
    streamed = list(client.completions.create(model=demo_server.model, prompt=prompt, echo=True, max_tokens=0,
                                              stream=True))
    assert "".join(x.text for ch in streamed for x in ch.choices) == prompt
    assert [x.finish_reason for ch in streamed for x in ch.choices if x.finish_reason] == ["length"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=demo_server.model, prompt=prompt, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
