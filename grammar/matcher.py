"""llguidance at run time: one tokenizer per model, compiled grammars cached by source, one matcher per request.

`GrammarBackend` is built once per model (building the llguidance tokenizer takes about two seconds on the 151k-token
Qwen3 vocabulary). `GrammarBackend.validate` turns a grammar llguidance rejects into a `GrammarError` before anything
is scheduled; `GrammarBackend.constraint` gives each request (each choice) its own `GrammarConstraint`, the engine's
``Constraint``; `GrammarBackend.bitmask_filler` fills the masks of a whole batch in parallel, off the GIL, with an
``LLExecutor``.
"""
from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch as llgt
import torch

from .compiler import GrammarError, GrammarPlan, ThinkingBudget

__all__ = ["GrammarBackend", "GrammarConstraint", "build_ll_tokenizer", "model_vocab_size"]

_MAX_MESSAGE = 600

PROBE_STEPS = 8
"""Tokens a newly compiled grammar is walked before it is admitted (`GrammarBackend._probe`)."""


def build_ll_tokenizer(tokenizer: Any, *, vocab_size: int | None = None,
                       eos_ids: Iterable[int] = ()) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a transformers fast tokenizer or a ``tokenizers.Tokenizer``.

    ``vocab_size`` is the model's (the width of its logits, which may exceed the tokenizer's token count); ``eos_ids``
    are every token that ends generation (a transformers tokenizer's EOS is added), so a finished grammar can always
    be left.
    """
    own_eos = getattr(tokenizer, "eos_token_id", None)
    eos = list(dict.fromkeys([*eos_ids, *([own_eos] if isinstance(own_eos, int) else [])]))
    if not eos:
        raise ValueError("the grammar backend needs at least one EOS token id")
    if hasattr(tokenizer, "backend_tokenizer"):
        n_vocab = max(int(vocab_size or 0), len(tokenizer))
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
    else:
        n_vocab = max(int(vocab_size or 0), tokenizer.get_vocab_size(with_added_tokens=True))
        backend = tokenizer
    return llguidance.LLTokenizer(_without_unicode_normalization(backend.to_str()), n_vocab=n_vocab, eos_token=eos)


_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def _without_unicode_normalization(spec: str) -> str:
    """A tokenizer's JSON without its Unicode normalization steps. llguidance writes the text a grammar forces with
    the tokens its tokenizer gives that text, and Qwen3's composes ``e`` + U+0301 into ``é`` (NFC) first: those
    tokens spell other bytes, which the grammar refuses. The vocabulary is unchanged, and text already in the form
    tokenizes as before."""
    if not any(f'"type":"{form}"' in spec for form in _UNICODE_FORMS):
        return spec
    data = json.loads(spec)
    norm = data.get("normalizer") or {}
    if norm.get("type") in _UNICODE_FORMS:
        data["normalizer"] = None
    elif norm.get("type") == "Sequence":
        kept = [n for n in norm.get("normalizers", []) if n.get("type") not in _UNICODE_FORMS]
        data["normalizer"] = {**norm, "normalizers": kept} if kept else None
    else:
        return spec
    return json.dumps(data)


class _TextTokenizer:
    """The tokens and tokenizer of ``base`` (llguidance's own for a Hugging Face tokenizer), except that text never
    becomes a special or added token: llguidance writes the text a grammar forces with the tokens its tokenizer gives,
    and the Hugging Face one splits out an added token's spelling (``<think>`` in a JSON string), which the grammar
    then refuses, as a delimiter counts only when generated as its token. Such a token is spelled with ordinary
    tokens instead (the longest that match), and a result that does not spell the text exactly with them (an added
    token that strips the whitespace around it) gives way to ordinary tokens for the whole text. llguidance calls
    it, taking the GIL, for each mask computed where the grammar forces text, so it serves only the grammars that
    spell a special token (`GrammarBackend`)."""

    def __init__(self, base: llguidance.LLTokenizer, special_ids: Sequence[int]) -> None:
        self.base = base
        self.eos_token_id = base.eos_tokens[0]
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
        self.special_token_ids = list(special_ids)
        self._special = frozenset(self.special_token_ids)

    def llguidance(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer that calls this one."""
        base = self.base
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(self), n_vocab=base.vocab_size,
                                      eos_token=list(base.eos_tokens))

    def __call__(self, text: bytes) -> list[int]:
        ids = self.base.tokenize_bytes(text)
        if self._special.isdisjoint(ids):
            return ids
        out: list[int] = []
        for i in ids:
            out += self.base.greedy_tokenize(self.base.decode_str([i])) if i in self._special else [i]
        if self._special.isdisjoint(out) and self.base.decode_bytes(out) == text:
            return out
        return self.base.greedy_tokenize(text.decode())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def model_vocab_size(model_dir: str | Path) -> int | None:
    cfg = _read_json(Path(model_dir) / "config.json")
    v = cfg.get("vocab_size")
    if v is None and isinstance(cfg.get("text_config"), dict):
        v = cfg["text_config"].get("vocab_size")
    return int(v) if v is not None else None


def _clean(message: str) -> str:
    """llguidance's message without the echo of our generated grammar source."""
    keep = []
    for line in message.splitlines():
        if line.startswith("<grammar>") or line.startswith("<state>"):
            break
        if line.lstrip().startswith("|") or (line.strip().startswith("^") and set(line.strip()) <= {"^"}):
            continue
        if line.strip() and line.lstrip()[:1].isdigit() and " | " in line:
            continue
        keep.append(line.strip())
    text = " ".join(k for k in keep if k)
    text = re.sub(r"^at \d+\(\d+\): (?=failed to compile JSON schema)", "", text)  # a place in OUR grammar source
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


_STATE = ("_last", "in_reasoning", "_closed_once", "_may_open", "reasoning_tokens", "_error")
"""`GrammarConstraint`'s own state besides its matcher's, which `GrammarConstraint.fill_bitmask_after` restores."""


class GrammarConstraint:
    """One request's (one choice's) constraint: an llguidance matcher and/or a thinking budget.

    Implements the engine's ``Constraint`` protocol. A rejected token, or a matcher that failed (a lexer that ran out
    of fuel or states while computing a mask, after which llguidance would allow only EOS), ends the request with
    ``error_message()``; a matcher that only allows EOS reports ``is_terminated()``. ``on_failure`` is called when
    the matcher fails.
    """

    def __init__(self, matcher: llguidance.LLMatcher | None, budget: ThinkingBudget | None, vocab_size: int,
                 eos_ids: Iterable[int] = (), on_failure: Callable[[], None] | None = None) -> None:
        self.matcher = matcher
        self.on_failure = on_failure
        self.eos_ids = frozenset(eos_ids)
        self._last: int | None = None
        self.budget = budget
        self.vocab_size = vocab_size
        self.in_reasoning = bool(budget and budget.starts_in_reasoning)
        self._closed_once = False
        self._may_open = True  # as the parser: a stray close before any thought turns later opens into text
        self.reasoning_tokens = 0
        self._error: str | None = None

    def must_close(self) -> bool:
        """True when only the close delimiter may come next: the budget is spent and the grammar lets the thought
        end here. A thought whose last token began a UTF-8 character cannot end before the character does, so it
        runs a token or so past the budget, as the grammar allows, until it can."""
        b = self.budget
        return b is not None and self.in_reasoning and self.reasoning_tokens >= b.tokens and (
            self.matcher is None or self._error is not None or self.matcher.validate_tokens([b.close_id]) == 1)

    def needs_matcher_mask(self) -> bool:
        return self.matcher is not None and self._error is None and not self.must_close()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of a host (CPU) int32 bitmask; the engine uploads the packed mask itself."""
        if self.must_close():
            _only(bitmask, row, self.budget.close_id)
        elif self.matcher is not None and self._error is None:
            llgt.fill_next_token_bitmask(self.matcher, bitmask, row)
            self.matcher_ok()
        else:
            bitmask[row].fill_(-1)

    def accept_token(self, token_id: int) -> bool:
        if self._error is not None:
            return False
        b = self.budget
        if b is not None:
            if self.in_reasoning:
                if token_id == b.close_id or token_id in b.implicit_end_ids:
                    self.in_reasoning = False
                    self._closed_once = True
                elif self.must_close():
                    self._error = f"thinking budget of {b.tokens} tokens is spent but token {token_id} is not the " \
                                  f"close delimiter {b.close_id}"
                    return False
                else:
                    self.reasoning_tokens += 1
            elif b.open_id is not None and token_id == b.open_id and self._may_open:
                self.in_reasoning = True
            elif token_id == b.close_id and not self._closed_once:
                self._may_open = False
        self._last = token_id
        if self.matcher is None:
            return True
        if not self.matcher_ok():
            return False
        if not self.matcher.consume_token(token_id):
            self._fail(f"structured output: token {token_id} rejected by the grammar: "
                       f"{_clean(self.matcher.get_error())}")
            return False
        return self.matcher_ok()

    def matcher_ok(self) -> bool:
        """False (the request's error recorded) once the matcher has failed; it then masks all but EOS, which must
        not pass for a completed answer."""
        if self.matcher is not None and self._error is None and self.matcher.is_error():
            self._fail(f"structured output: the grammar failed: {_clean(self.matcher.get_error())}")
        return self._error is None

    def _fail(self, message: str) -> None:
        self._error = message
        if self.on_failure is not None:
            self.on_failure()

    def fill_bitmask_after(self, draft: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """The mask once ``draft`` were accepted (the engine's ``LookaheadConstraint``): the tokens are accepted,
        the row filled, then the matcher rolled back and the budget's state restored. A row past a token the
        grammar or the budget refuses allows every token (it is never kept)."""
        saved = [getattr(self, name) for name in _STATE]
        consumed = 0
        try:
            for tok in draft:
                # a stopped matcher takes EOS (its only allowed token) without recording it, though validate refuses
                repeat_eos = self.matcher is not None and tok in self.eos_ids and self.matcher.is_stopped()
                # checked first: a matcher that refused a token would be left in its error state
                refused = self.matcher is not None and not repeat_eos and self.matcher.validate_tokens([tok]) != 1
                if refused or not self.accept_token(tok):
                    bitmask[row].fill_(-1)
                    return
                consumed += self.matcher is not None and not repeat_eos
            self.fill_bitmask(bitmask, row)
        finally:
            if consumed:
                self.matcher.rollback(consumed)
            for name, value in zip(_STATE, saved):
                setattr(self, name, value)

    def is_terminated(self) -> bool:
        """The grammar is complete and only EOS could follow (a sampled EOS is left to the engine's own stop)."""
        return self.matcher is not None and self._error is None and self._last not in self.eos_ids \
            and self.matcher.is_stopped() and not self.matcher.is_error()

    def error_message(self) -> str | None:
        return self._error


def _allowed(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The tokens one int32 bitmask row allows, as a bool tensor of ``vocab_size``."""
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def _only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    bitmask[row].zero_()
    word, bit = divmod(token_id, 32)
    value = 1 << bit
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


_LITERAL_WRAPPERS = "\\[]\"'() \t\n?:^$"
"""Characters regex, Lark and JSON syntax puts around or between the characters of literal text; `GrammarBackend`
deletes those no special token's spelling holds before looking for spellings in a grammar."""


class GrammarBackend:
    """llguidance for one model: its tokenizer, an executor, and compiled grammars cached by their source text."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, *, threads: int | None = None,
                 cache_size: int = 256, limits: llguidance.LLParserLimits | None = None) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size: int = ll_tokenizer.vocab_size
        self.eos_ids: tuple[int, ...] = tuple(ll_tokenizer.eos_tokens)
        self.executor = llguidance.LLExecutor(threads) if threads else llguidance.LLExecutor()
        self.limits = limits
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._specials: torch.Tensor | None = None
        self._blanks: tuple[torch.Tensor, torch.Tensor] | None = None
        special_ids = [i for i in range(self.vocab_size) if ll_tokenizer.is_special_token(i)]
        spellings = {t for i in special_ids if len(t := ll_tokenizer.decode_str([i])) > 1}
        spellings |= {json.dumps(t)[1:-1] for t in spellings}  # as an ASCII-escaped JSON string holds it
        # the grammar source is searched with the syntax around literal text deleted (regex escapes and one-character
        # classes, quotes of Lark literals side by side, groups), so `<\|im_end\|>` or `<thin[k]>` is seen too
        self._unwrap = {ord(c): None for c in _LITERAL_WRAPPERS if not any(c in t for t in spellings)}
        skeletons = {t.translate(self._unwrap) for t in spellings}
        self._spells_special = (re.compile("|".join(map(re.escape, sorted(skeletons, key=len, reverse=True))))
                                if spellings else None)
        self._special_ids = special_ids
        self._text_tokenizer: llguidance.LLTokenizer | None = None

    def _tokenizer_for(self, grammar: str) -> llguidance.LLTokenizer:
        """The model's llguidance tokenizer, or for a grammar whose text spells a special token (a const
        ``"<think>"``) `_TextTokenizer`'s, which writes forced text in ordinary tokens (at a Python call per forced
        text, which other threads holding the GIL slow down: the others never pay it)."""
        if self._spells_special is None or self._spells_special.search(grammar.translate(self._unwrap)) is None:
            return self.ll_tokenizer
        with self._lock:
            if self._text_tokenizer is None:
                self._text_tokenizer = _TextTokenizer(self.ll_tokenizer, self._special_ids).llguidance()
            return self._text_tokenizer

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any, *, vocab_size: int | None = None, eos_ids: Iterable[int] = (),
                       **kwargs: Any) -> "GrammarBackend":
        return cls(build_ll_tokenizer(hf_tokenizer, vocab_size=vocab_size, eos_ids=eos_ids), **kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, eos_ids: Iterable[int], hf_tokenizer: Any | None = None,
                        **kwargs: Any) -> "GrammarBackend":
        """From a checkpoint folder: its tokenizer and ``config.json`` vocab size. ``eos_ids`` come from the caller
        (the engine's one rule, `ember.engine.eos.end_of_turn_ids`, which the server reads from the engine's
        `ModelInfo`), so grammar, engine and parsers end turns on the same IDs."""
        if hf_tokenizer is None:
            from transformers import AutoTokenizer

            hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls.from_tokenizer(hf_tokenizer, vocab_size=model_vocab_size(model_dir),
                                  eos_ids=eos_ids, **kwargs)

    # -------------------------------------------------------------------------------------------- admission

    def validate(self, grammar: str, field: str = "response_format") -> None:
        """Raise `GrammarError` naming ``field`` and llguidance's reason when ``grammar`` cannot be used."""
        self._compiled(grammar, field)

    def _compiled(self, grammar: str, field: str) -> llguidance.LLMatcher:
        with self._lock:
            m = self._cache.get(grammar)
            if m is not None:
                self._cache.move_to_end(grammar)
                return m
        kwargs = {"limits": self.limits} if self.limits is not None else {}
        tokenizer = self._tokenizer_for(grammar)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, **kwargs)
        if is_error:
            raise GrammarError(f"{field}: invalid structured-output grammar: {_clean(messages[0])}")
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0, **kwargs)
        if m.is_error():
            raise GrammarError(f"{field}: invalid structured-output grammar: {_clean(m.get_error())}")
        failure = self._probe(m)
        if failure is not None:
            raise GrammarError(f"{field}: invalid structured-output grammar: {_clean(failure)}")
        with self._lock:
            self._cache[grammar] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m

    def _probe(self, compiled: llguidance.LLMatcher) -> str | None:
        """Why a copy of ``compiled`` fails within its first `PROBE_STEPS` tokens (None: it does not).

        llguidance builds its lexer lazily, so a grammar whose lexer runs out of fuel or states fails only at the mask
        that needs it; the probe catches what fails early on one path: at each step the first structure token the
        mask allows (a delimiter such as ``</think>`` or ``<tool_call>``, which leads out of free text), else its
        lowest token that is not whitespace alone, else its longest (whitespace before a JSON answer is bounded: the
        longest runs out in a few steps, where one tab at a time used up the walk before the answer began). Its copy
        shares ``compiled``'s lexer, which a failure leaves broken (the grammar is then not cached)."""
        probe = compiled.deep_copy()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(1, words, dtype=torch.int32)
        not_eos = ~self._eos_mask()
        for _ in range(PROBE_STEPS):
            llgt.fill_next_token_bitmask(probe, bitmask, 0)
            if probe.is_error():
                return probe.get_error()
            allowed = _allowed(bitmask[0], self.vocab_size) & not_eos
            if probe.is_stopped() or not allowed.any():
                return None
            special = (allowed & self._special_mask()).nonzero()
            blank, length = self._blanks_and_lengths()
            solid = (allowed & ~blank).nonzero()
            token = int(special[0] if len(special) else solid[0] if len(solid)
                        else torch.where(allowed, length, -1).argmax())
            if not probe.consume_token(token):
                return probe.get_error()
        return None

    def _special_mask(self) -> torch.Tensor:
        if self._specials is None:
            self._specials = torch.zeros(self.vocab_size, dtype=torch.bool)
            self._specials[self._special_ids] = True
        return self._specials

    def _blanks_and_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Which tokens are whitespace alone, and every token's length in bytes."""
        if self._blanks is None:
            pieces = [self.ll_tokenizer.decode_bytes([i]) for i in range(self.vocab_size)]
            self._blanks = (torch.tensor([bool(b) and not b.strip() for b in pieces]),
                            torch.tensor([len(b) for b in pieces]))
        return self._blanks

    def _eos_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[list(self.eos_ids)] = True
        return mask

    def _forget(self, grammar: str, compiled: llguidance.LLMatcher) -> None:
        """Drop ``grammar``'s cache entry while it is still ``compiled``: every copy of a compiled matcher shares its
        lexer, which a failure in one of them leaves broken for all."""
        with self._lock:
            if self._cache.get(grammar) is compiled:
                del self._cache[grammar]

    def cached(self, grammar: str) -> bool:
        """Whether ``grammar`` is compiled and cached (requests with the same source skip compilation)."""
        with self._lock:
            return grammar in self._cache

    def constraint(self, plan: GrammarPlan, field: str | None = None) -> GrammarConstraint:
        """A fresh constraint for one request/choice (a copy of the cached compiled matcher); `GrammarError` naming
        ``field`` (default: the plan's) when the grammar is invalid."""
        field = field or plan.field
        if plan.budget is not None and plan.budget.close_id >= self.vocab_size:
            raise GrammarError(f"{field}: close delimiter {plan.budget.close_id} is outside the vocabulary")
        if plan.grammar is None:
            return GrammarConstraint(None, plan.budget, self.vocab_size, self.eos_ids)
        compiled = self._compiled(plan.grammar, field)
        return GrammarConstraint(compiled.deep_copy(), plan.budget, self.vocab_size, self.eos_ids,
                                 on_failure=lambda: self._forget(plan.grammar, compiled))

    # ------------------------------------------------------------------------------------------------ steps

    def bitmask_filler(self):
        """The engine's ``BitmaskFiller``: rows of grammar constraints in parallel off the GIL, others in turn. The
        engine's bitmask may be narrower than this vocabulary, where the tokenizer has tokens past the model's logits
        (a pad or special token added without resizing the embeddings): those tokens can never be drawn, so only the
        model's columns are written."""
        words = (self.vocab_size + 31) // 32

        def fill(constraints: Sequence[Any], bitmask: torch.Tensor) -> None:
            if not (bitmask.is_cpu and bitmask.is_contiguous() and bitmask.dtype == torch.int32
                    and bitmask.dim() == 2 and 0 < bitmask.shape[1] <= words):
                raise ValueError(f"bitmask must be a contiguous host int32 [rows, <= {words}] tensor for a "
                                 f"{self.vocab_size}-token vocabulary, got {bitmask.dtype} {tuple(bitmask.shape)} "
                                 f"on {bitmask.device}")
            model_mask = bitmask
            if bitmask.shape[1] < words:
                bitmask = torch.zeros((bitmask.shape[0], words), dtype=torch.int32)
            _fill(constraints, bitmask)
            if bitmask is not model_mask:
                model_mask.copy_(bitmask[:, :model_mask.shape[1]])

        def _fill(constraints: Sequence[Any], bitmask: torch.Tensor) -> None:
            par: list[tuple[llguidance.LLMatcher, int]] = []
            for row, c in enumerate(constraints):
                if isinstance(c, GrammarConstraint) and c.needs_matcher_mask():
                    par.append((c.matcher, row))
                else:
                    c.fill_bitmask(bitmask, row)
            if par:
                llgt.fill_next_token_bitmask_par(self.executor, par, bitmask)
                for _, row in par:
                    constraints[row].matcher_ok()

        return fill
