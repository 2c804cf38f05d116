"""Per-token bytes, the UTF-8 assembler and delimiter resolution, checked against the real tokenizers' own decode."""
from __future__ import annotations

import functools
import gzip
import random

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from ember.parsers.tokens import TokenBytes, Utf8Assembler, resolve_delimiters
from tests.conftest import shared_path, write_shared_tokenizer


@functools.lru_cache(maxsize=None)
def load_tokenizer(name: str) -> Tokenizer:
    """A real tokenizer from ../shared/data/tokenizers (gzip'd tokenizer.json); skips where absent."""
    p = shared_path("tokenizers", name, "tokenizer.json.gz")
    return Tokenizer.from_str(gzip.decompress(p.read_bytes()).decode())


@functools.lru_cache(maxsize=None)
def load_token_bytes(name: str) -> TokenBytes:
    return TokenBytes.from_tokenizer(load_tokenizer(name))


@functools.lru_cache(maxsize=None)
def demo_tokenizer() -> Tokenizer:
    """The demo model's byte-level BPE (Qwen3 specials as single tokens); needs no ../shared."""
    from ember.engine.demo import build_tokenizer

    return build_tokenizer()


def sentencepiece_tokenizer(pieces: list[tuple[str, float]]) -> Tokenizer:
    """A Llama-2-style SentencePiece BPE: ``▁`` for spaces, ``<0xNN>`` byte fallback, leading space stripped."""
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


def stories_tokenizer() -> Tokenizer:
    """stories260K's real 512-piece llama2.c vocabulary, as the project's llama2.c converter builds it."""
    from ember.engine.convert_llama2c import build_tokenizer, read_llama2c_tokenizer

    return build_tokenizer(read_llama2c_tokenizer(shared_path("models", "stories260K", "tok512.bin"), 512))


def assemble(tb: TokenBytes, ids: list[int]) -> tuple[str, list[str]]:
    asm = Utf8Assembler()
    parts = [asm.feed(tb.token_bytes(i)) for i in ids] + [asm.flush()]
    return "".join(parts), parts


def random_ids(tok: Tokenizer, tb: TokenBytes, rng: random.Random, n: int) -> list[list[int]]:
    size = tok.get_vocab_size(with_added_tokens=True)
    added = sorted(tb.added.values())
    out = []
    for _ in range(n):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 16))]
        if rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(added))
        out.append(ids)
    return out


TEXTS = ["Hello <think>wo</think> 😊 naïve café — 你好世界\n\tx = {\"a\": [1, 2]}",
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>",
         "emoji 👩‍👩‍👧 and combining e\u0301 and CJK 東京 and \u00a0nbsp"]


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3", "gpt-oss"])
def test_real_tokenizer_bytes_decode_like_the_tokenizer(name):
    tok, tb = load_tokenizer(name), load_token_bytes(name)
    assert not tb.strips_leading_space
    rng = random.Random(name)
    cases = random_ids(tok, tb, rng, 400) + [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    for ids in cases:
        text, parts = assemble(tb, ids)
        assert text == tok.decode(ids, skip_special_tokens=False), ids
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False).ids
        _, parts = assemble(tb, ids)
        assert "\ufffd" not in "".join(parts), "a character split across tokens was surfaced broken"
    for i in rng.sample(range(tok.get_vocab_size(with_added_tokens=True)), 2000):
        assert tb.decode([i]) == tok.decode([i], skip_special_tokens=False)


def test_special_tokens_are_their_literal_text():
    tb = load_token_bytes("qwen3")
    assert tb.token_bytes(151645) == b"<|im_end|>" and 151645 in tb.special_ids
    assert tb.token_bytes(151667) == b"<think>" and 151667 not in tb.special_ids
    assert tb.added_token_id("<|im_end|>") == 151645
    assert tb.token_bytes(151935) == b"" and tb.token_bytes(10**7) == b""
    ds = load_token_bytes("deepseek-v3")
    assert ds.token_bytes(1) == "<｜end▁of▁sentence｜>".encode()


def test_transformers_tokenizer_gives_the_same_table(tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(write_shared_tokenizer("qwen3", tmp_path))
    tb, ref = TokenBytes.from_tokenizer(hf), load_token_bytes("qwen3")
    assert tb.vocab_size == ref.vocab_size
    rng = random.Random(1)
    for ids in random_ids(load_tokenizer("qwen3"), ref, rng, 100):
        assert tb.decode(ids) == ref.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    assert resolve_delimiters(hf, ["<think>", "</think>"]) == {"<think>": 151667, "</think>": 151668}


def test_demo_tokenizer_bytes_decode_like_the_tokenizer():
    tok = demo_tokenizer()
    tb = TokenBytes.from_tokenizer(tok)
    for ids in random_ids(tok, tb, random.Random(2), 300):
        assert assemble(tb, ids)[0] == tok.decode(ids, skip_special_tokens=False)


SP_PIECES = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
             + [(p, -1.0) for p in ["▁", "▁the", "▁cat", "▁sat", "a", "c", "t", "h", "e", "s", "▁c", "▁s"]])


def test_sentencepiece_byte_fallback_and_spaces():
    tok = sentencepiece_tokenizer(SP_PIECES)
    tb = TokenBytes.from_tokenizer(tok)
    assert tb.strips_leading_space
    v = tok.get_vocab()
    ids = [v["▁the"], v["▁cat"], v["▁s"], v["a"], v["t"], v["▁"]] + [v[f"<0x{b:02X}>"] for b in "😊".encode()]
    ids += [v["▁"]] + [v[f"<0x{b:02X}>"] for b in "é".encode()]
    text, parts = assemble(tb, ids)
    assert text == " the cat sat 😊 é"
    assert "\ufffd" not in "".join(parts)
    # the tokenizer's decode drops the output's one leading space; the bytes keep it (normalised once)
    assert text[1:] == tok.decode(ids, skip_special_tokens=False)
    rng = random.Random(3)
    for ids in random_ids(tok, tb, rng, 300):
        text = assemble(tb, ids)[0]
        expected = tok.decode(ids, skip_special_tokens=False)
        if text.startswith(" ") and not expected.startswith(" "):
            text = text[1:]
        if "\ufffd" not in expected:  # ByteFallback writes one U+FFFD per bad byte token; UTF-8 'replace' may merge
            assert text == expected, ids


def test_stories260k_llama2c_vocabulary():
    tok = stories_tokenizer()
    tb = TokenBytes.from_tokenizer(tok)
    assert tb.token_bytes(3 + 0x0A) == b"\n" and tb.token_bytes(259) == b" t"
    story = shared_path("models", "stories260K", "expected_greedy_t0.txt").read_text()
    ids = tok.encode(story, add_special_tokens=False).ids
    assert len(ids) < len(story) / 2          # real merges: mostly whole-word pieces
    text, parts = assemble(tb, ids)
    assert text == " " + story and text[1:] == tok.decode(ids, skip_special_tokens=False)
    assert "\ufffd" not in "".join(parts)
    rng = random.Random(4)
    for ids in random_ids(tok, tb, rng, 200):
        text, expected = assemble(tb, ids)[0], tok.decode(ids, skip_special_tokens=False)
        if text.startswith(" ") and not expected.startswith(" "):
            text = text[1:]
        if "\ufffd" not in expected:
            assert text == expected, ids


@settings(max_examples=200, deadline=None)
@given(st.text(), st.data())
def test_assembler_emits_whole_characters_only(text, data):
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    asm = Utf8Assembler()
    parts, prev = [], 0
    for c in cuts + [len(raw)]:
        parts.append(asm.feed(raw[prev:c]))
        prev = c
    parts.append(asm.flush())
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts) or "\ufffd" in text


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.data())
def test_assembler_broken_bytes_match_whole_decode(raw, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    asm = Utf8Assembler()
    out, prev = [], 0
    for c in cuts + [len(raw)]:
        out.append(asm.feed(raw[prev:c]))
        prev = c
    out.append(asm.flush())
    assert "".join(out) == raw.decode("utf-8", "replace")


def test_assembler_flush_gives_replacement_for_dangling_bytes():
    asm = Utf8Assembler()
    assert asm.feed("😊".encode()[:2]) == "" and asm.pending
    assert asm.flush() == "\ufffd" and not asm.pending
    assert asm.feed(b"ok") == "ok"


def test_delimiters_resolve_to_single_tokens_qwen3():
    tok = load_tokenizer("qwen3")
    got = resolve_delimiters(tok, ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>",
                                   "<function=", "</parameter>", "e\u0301"])
    assert got == {"<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658,
                   "<|im_end|>": 151645, "<function=": None, "</parameter>": None,
                   "e\u0301": None}  # NFC makes it one token "é", which does not decode back to the same text


def test_delimiters_resolve_to_single_tokens_gpt_oss():
    tok = load_tokenizer("gpt-oss")
    names = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>", "<|constrain|>"]
    got = resolve_delimiters(tok, names + ["<think>"])
    expected = {n: tok.token_to_id(n) for n in names}
    assert all(isinstance(i, int) for i in expected.values())
    assert {n: got[n] for n in names} == expected
    assert expected["<|channel|>"] == 200005 and expected["<|return|>"] == 200002 and expected["<|call|>"] == 200012
    assert got["<think>"] is None


def test_delimiters_resolve_deepseek_v3():
    tok = load_tokenizer("deepseek-v3")
    names = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
             "<｜end▁of▁sentence｜>"]
    got = resolve_delimiters(tok, names + ["<think>", "</think>"])
    assert {n: got[n] for n in names} == {n: tok.token_to_id(n) for n in names}
    assert got["<｜tool▁calls▁begin｜>"] == 128806 and got["<｜end▁of▁sentence｜>"] == 1
    # DeepSeek-V3 has no thinking tokens: the tags are several ordinary tokens, so they are matched as text
    assert got["<think>"] is None and got["</think>"] is None


def test_delimiters_demo_tokenizer():
    got = resolve_delimiters(demo_tokenizer(), ["<think>", "</think>", "<tool_call>", "</tool_call>", "<think"])
    assert all(isinstance(got[t], int) for t in ["<think>", "</think>", "<tool_call>", "</tool_call>"])
    assert got["<think"] is None


def test_profile_delimiter_ids_keep_only_single_tokens():
    from ember.parsers.profiles import get_profile
    from ember.parsers.tokens import profile_delimiter_ids

    assert profile_delimiter_ids(load_tokenizer("qwen3"), get_profile("qwen3")) == {
        "<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658,
        "<|im_end|>": 151645, "<|endoftext|>": 151643}
    ds = profile_delimiter_ids(load_tokenizer("deepseek-v3"), get_profile("deepseek_r1"))
    assert "<think>" not in ds and "</think>" not in ds  # several tokens there: matched as text
    assert ds == {"<｜end▁of▁sentence｜>": 1, "<｜tool▁calls▁begin｜>": 128806, "<｜tool▁calls▁end｜>": 128807,
                  "<｜tool▁call▁begin｜>": 128808, "<｜tool▁call▁end｜>": 128809, "<｜tool▁sep｜>": 128814}


def test_a_tokenizer_without_a_tokenizers_backend_is_a_clear_error():
    with pytest.raises(TypeError, match="tokenizers"):
        TokenBytes.from_tokenizer(object())
