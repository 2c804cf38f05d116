"""Tokenizer facts the parsers need: the bytes of every token, a UTF-8 assembler, single-token delimiters.

Parsing is driven by token IDs; text is rebuilt per token from a byte table built once per tokenizer, so no
detokenizer ever lags or rewrites earlier text. Two vocabularies are understood: byte-level BPE (GPT-2 byte map:
Qwen, DeepSeek, gpt-oss, Llama 3) and SentencePiece (``▁`` is a space, ``<0xNN>`` pieces are raw bytes). Added and
special tokens are their literal text. Concatenating the bytes of ``ids`` and decoding them as UTF-8 (U+FFFD for broken
sequences) gives ``tokenizer.decode(ids, skip_special_tokens=False)``, except that SentencePiece decoders drop one
leading space of the whole output (``strips_leading_space`` says so). What the prompt's end means for the output's text
(a character it leaves unfinished, a leading space to drop) is a `PromptContext`.
"""
from __future__ import annotations

import codecs
import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TokenBytes", "Utf8Assembler", "PromptContext", "resolve_delimiters", "profile_delimiter_ids",
           "gpt2_byte_decoder"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level alphabet reversed: printable stand-in character -> the byte it encodes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_steps(state: Any) -> list[dict]:
    """A tokenizers decoder (its JSON form) flattened into its list of steps."""
    if state is None:
        return []
    if state.get("type") == "Sequence":
        steps: list[dict] = []
        for d in state.get("decoders", []):
            steps.extend(_decoder_steps(d))
        return steps
    return [state]


class TokenBytes:
    """Per-token byte table, built once per tokenizer and shared by every request.

    ``token_bytes(id)`` is the exact byte string the token contributes to the output (``b""`` for ids the tokenizer
    does not know, e.g. padding rows of the embedding); ``token_text(id)`` is the same bytes as ``str`` when they are
    complete UTF-8 on their own, else ``None`` (the pipeline's fast path).
    """

    def __init__(self, table: Sequence[bytes], *, special_ids: Iterable[int] = (),
                 added: Mapping[str, int] | None = None, strips_leading_space: bool = False,
                 spells_every_char: bool = False) -> None:
        self._bytes: list[bytes] = list(table)
        self._text: list[str | None] = [_complete_text(b) for b in self._bytes]
        self.vocab_size: int = len(self._bytes)
        self.special_ids: frozenset[int] = frozenset(special_ids)
        self.added: dict[str, int] = dict(added or {})
        self.strips_leading_space: bool = strips_leading_space
        self.spells_every_char: bool = spells_every_char
        """Every character of a text reaches some token (byte-level BPE, or BPE with byte fallback, normalized at most
        by Unicode normal forms), so no token count lets an arbitrarily long text through; a WordPiece or Unigram
        tokenizer may drop whitespace and accents, or make a word of any length one unknown token."""

    @property
    def bytes_table(self) -> Sequence[bytes]:
        """Every token's bytes, indexed by id (read-only use: the pipeline's hot loop)."""
        return self._bytes

    @property
    def text_table(self) -> Sequence[str | None]:
        """Every token's text where its bytes are complete UTF-8 on their own, else None."""
        return self._text

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""

    def token_text(self, token_id: int) -> str | None:
        if 0 <= token_id < self.vocab_size:
            return self._text[token_id]
        return ""

    def added_token_id(self, text: str) -> int | None:
        """The id of the added/special token whose literal text is ``text``, if the tokenizer has one."""
        return self.added.get(text)

    def decode(self, token_ids: Iterable[int]) -> str:
        """All bytes of ``token_ids`` as text, U+FFFD for broken sequences (what the pipeline surfaces in total)."""
        return b"".join(self.token_bytes(i) for i in token_ids).decode("utf-8", "replace")

    @classmethod
    def from_tokenizer(cls, tok: Any) -> "TokenBytes":
        """Build the table from a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer."""
        backend = _backend(tok)
        if backend is None:
            raise TypeError("TokenBytes needs a `tokenizers`-backed tokenizer (a tokenizers.Tokenizer or a "
                            f"transformers fast tokenizer / TokenizersBackend), got {type(tok).__name__}")
        return cls._from_backend(backend)

    @classmethod
    def _from_backend(cls, tk: Any) -> "TokenBytes":
        vocab: dict[str, int] = tk.get_vocab(with_added_tokens=True)
        added_tokens = tk.get_added_tokens_decoder()
        decoder_state = json.loads(tk.decoder.__getstate__()) if tk.decoder is not None else None
        steps = _decoder_steps(decoder_state)
        kinds = {s.get("type") for s in steps}
        byte_fallback = "ByteFallback" in kinds or bool(getattr(tk.model, "byte_fallback", False))
        strips = False
        space_char: str | None = None
        for s in steps:
            t = s.get("type")
            if t == "Replace" and s.get("content") == " ":
                space_char = s.get("pattern", {}).get("String")
            elif t == "Metaspace":
                space_char = s.get("replacement", "▁")
                scheme = s.get("prepend_scheme", "always" if s.get("add_prefix_space", True) else "never")
                strips = strips or scheme != "never"
            elif t == "Strip" and s.get("content") == " " and s.get("start", 0) >= 1:
                strips = True
        if "ByteLevel" in kinds:
            piece = _byte_level_piece()
        else:
            piece = _sentencepiece_piece(space_char, byte_fallback)
        size = max(vocab.values(), default=-1) + 1
        table = [b""] * size
        for text, i in vocab.items():
            table[i] = piece(text)
        added: dict[str, int] = {}
        special: list[int] = []
        for i, at in added_tokens.items():
            content = at.content
            if i >= size:
                table.extend([b""] * (i + 1 - size))
                size = i + 1
            table[i] = content.encode("utf-8")
            added[content] = i
            if at.special:
                special.append(i)
        every_char = (type(tk.model).__name__ == "BPE" and ("ByteLevel" in kinds or byte_fallback)
                      and _keeps_every_char(tk.normalizer))
        return cls(table, special_ids=special, added=added, strips_leading_space=strips, spells_every_char=every_char)


_KEEPING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})


def _keeps_every_char(normalizer: Any) -> bool:
    """Whether ``normalizer`` (a tokenizers normalizer, or None) removes no character but by Unicode composition: it
    is made of normal forms, lowercasing, prepending, and replacements of a literal by a text at least as long."""
    if normalizer is None:
        return True
    state = json.loads(normalizer.__getstate__())
    steps = state.get("normalizers") or [] if state.get("type") == "Sequence" else [state]
    for step in steps:
        kind = step.get("type")
        if kind == "Replace":
            pattern = (step.get("pattern") or {}).get("String")
            if pattern is None or len(step.get("content") or "") < len(pattern):
                return False
        elif kind not in _KEEPING_NORMALIZERS:
            return False
    return True


def _complete_text(b: bytes) -> str | None:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _backend(tok: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tok`` (itself, or a transformers fast tokenizer's), else None."""
    if hasattr(tok, "get_added_tokens_decoder") and hasattr(tok, "decoder") and hasattr(tok, "model"):
        return tok
    for name in ("backend_tokenizer", "_tokenizer"):
        inner = getattr(tok, name, None)
        if inner is not None and hasattr(inner, "get_added_tokens_decoder"):
            return inner
    return None


def _byte_level_piece():
    dec = gpt2_byte_decoder()

    def piece(text: str) -> bytes:
        try:
            return bytes(dec[c] for c in text)
        except KeyError:
            return text.encode("utf-8")

    return piece


def _sentencepiece_piece(space_char: str | None, byte_fallback: bool):
    def piece(text: str) -> bytes:
        if byte_fallback:
            m = _BYTE_PIECE.fullmatch(text)
            if m:
                return bytes([int(m.group(1), 16)])
        if space_char:
            text = text.replace(space_char, " ")
        return text.encode("utf-8")

    return piece


class Utf8Assembler:
    """Per-request UTF-8 assembler: bytes in, whole characters out.

    A character split across tokens is held until complete. Broken bytes become U+FFFD exactly as
    ``bytes.decode("utf-8", "replace")`` of the whole output would give them; ``flush()`` turns a dangling
    incomplete sequence into U+FFFD (at a delimiter token or at finish). ``seed``: the prompt's unfinished character
    (`PromptContext.tail`), held as if fed first, so generated bytes that finish it give it whole.
    """

    __slots__ = ("_held", "_seed_only")

    def __init__(self, seed: bytes = b"") -> None:
        self._held = seed
        self._seed_only = bool(seed)  # what is held is the seed alone: no generated byte has joined it

    @property
    def pending(self) -> bool:
        return bool(self._held)

    def feed(self, data: bytes) -> str:
        if self._held:
            if not data:
                return ""
            data = self._held + data
            self._held = b""
            self._seed_only = False
        n = len(data)
        # The only bytes held are an incomplete multi-byte sequence at the very end (at most 3 bytes).
        for back in range(1, min(3, n) + 1):
            b = data[n - back]
            if b & 0xC0 == 0x80:
                continue
            need = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 1
            if need > back:
                self._held = data[n - back:]
                data = data[: n - back]
            break
        return data.decode("utf-8", "replace")

    def flush(self, final: bool = False) -> str:
        """The held bytes as text (U+FFFD); with ``final`` (the output ends) a seed no generated byte joined is
        dropped instead: it is the prompt's text, not the output's."""
        held, self._held = self._held, b""
        if final and self._seed_only:
            held = b""
        self._seed_only = False
        return held.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class PromptContext:
    """What the prompt's end means for the text of the output that continues it, as vLLM's detokenizer (primed
    with the prompt's last tokens) and ``tokenizer.decode(prompt + output)`` read it.

    ``tail``: the prompt's trailing bytes that begin a character without finishing it (at most 3): the output's first
    bytes may finish it, and the character is then the output's first text, whole. ``strip_space``: the decoder
    drops one leading space (SentencePiece) and the prompt has no text, so the output's first character is that
    space and is dropped. The default, no context, changes nothing.
    """

    tail: bytes = b""
    strip_space: bool = False

    @classmethod
    def of(cls, tb: TokenBytes, prompt_ids: Sequence[int], drop: Collection[int] = ()) -> "PromptContext":
        """The context of ``prompt_ids``, whose tokens in ``drop`` add no text (as in the echoed prompt)."""
        last = b""
        for tid in reversed(prompt_ids):
            if tid not in drop:
                last = tb.token_bytes(tid) + last
                if len(last) >= 3:
                    break
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(last[-3:])
        return cls(decoder.getstate()[0], tb.strips_leading_space and not last)


def _encode_ids(tok: Any, text: str) -> list[int]:
    enc = tok.encode(text, add_special_tokens=False)
    return list(getattr(enc, "ids", enc))


def _decode_ids(tok: Any, ids: list[int]) -> str:
    try:
        return tok.decode(ids, skip_special_tokens=False)
    except TypeError:
        return tok.decode(ids)


def resolve_delimiters(tok: Any, texts: Iterable[str]) -> dict[str, int | None]:
    """Each delimiter text -> its token id if it encodes to exactly one token that decodes back to the same text.

    ``None`` means the delimiter is not one token in this vocabulary; the parsers then match it as text.
    """
    out: dict[str, int | None] = {}
    for text in texts:
        ids = _encode_ids(tok, text)
        out[text] = ids[0] if len(ids) == 1 and _decode_ids(tok, ids) == text else None
    return out


def profile_delimiter_ids(tok: Any, profile: Any) -> dict[str, int]:
    """A profile's token-ID terminals that are single tokens here: terminal text -> id (the machine's
    ``delimiter_ids``). Terminals that are not one token are left out and matched as text."""
    texts = [profile.terminals[n] for n in sorted(profile.token_id_terminals) if n in profile.terminals]
    return {t: i for t, i in resolve_delimiters(tok, texts).items() if i is not None}
