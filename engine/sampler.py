"""Turning a batch of next-token logits into tokens, vectorised over the batch, with one device -> host read.

Order per row: logit_bias, min_tokens (stop tokens masked), repetition/frequency/presence penalties, the constraint
bitmask, then logprobs (log-softmax of these processed logits, before temperature), then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw. Draws use the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``;
a seeded request draws the ``E`` of its output token ``i`` from a generator seeded with (seed, ``i``), so its tokens
depend neither on the rest of the batch nor on how many positions a step computes.

A row may sit ahead of its sequence (a speculative chunk's later positions, `ember.engine.speculative`): it samples
as if the drafts before it had been emitted, for its penalties, banned words, ``min_tokens`` and seeded draw alike,
and its sampled token counts toward the penalties only when every draft before it was sampled as drafted.

Host syncs: per-row settings, logit-bias / ban indices and the packed int32 constraint bitmask go up through
persistent pinned buffers with non-blocking copies (`ember.engine.staging`); the bitmask is expanded on the device;
penalties read per-request token counts kept on the device (`ember.engine.penalties`); greedy and sampled rows are
chosen with ``torch.where`` (which rows draw is known from the requests, never read back). The only read is one
transfer at the end: the sampled IDs, packed with the "no token allowed" flags of constrained rows and the logprobs
when any row asks for them. Every shape depends on the batch and the requests' settings only, never on device
values. Asked to defer (asynchronous scheduling), the sampler starts that transfer into pinned memory and returns at
once: `DeferredSample` keeps the tokens on the device for the next step's inputs and reads them when asked.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from ember.engine.constraint import BitmaskFiller, Constraint, LookaheadConstraint, bitmask_words, fill_bitmasks_serial
from ember.engine.params import SamplingParams, TokenLogprob
from ember.engine.penalties import PenaltyState
from ember.engine.pooling import POOLING_TYPES
from ember.engine.sequence import Sequence
from ember.engine.staging import Staging

GREEDY_EPS = 1e-5  # a temperature below this is greedy (argmax)
_T, _TOP_P, _MIN_P, _TOP_K, _REP, _FREQ, _PRES = range(7)  # columns of the per-row settings


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One per row; undefined (-1) for rows in ``errors``."""
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str] = field(default_factory=dict)
    """Rows that could not sample (their constraint failed or allowed no token), with the reason."""
    rejected: set[int] = field(default_factory=set)
    """The rows of ``errors`` whose request's own settings (allowed tokens, bad words, min_tokens) left no token."""


@dataclass
class DeferredSample:
    """A step's sampling whose one read has started but not been waited for: ``tokens`` (int64 ``[S]``, on the
    device) can feed the next step's inputs now; `result` waits for this step's transfer alone and unpacks it."""

    tokens: torch.Tensor
    _host: torch.Tensor
    _done: torch.cuda.Event | None
    _unpack: Callable[[list[list[float]]], SamplerOutput]

    def result(self) -> SamplerOutput:
        if self._done is not None:
            self._done.synchronize()
        return self._unpack(self._host.tolist())


def validate_params(p: SamplingParams, vocab_size: int, max_logprobs: int = 20) -> None:
    """ValueError naming the field when a setting is out of range."""
    if p.pooling is not None and p.pooling not in POOLING_TYPES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)} (or None), got {p.pooling!r}")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if p.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {p.min_tokens}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    if not p.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {p.top_k}")
    if not 0 <= p.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    if not p.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not -2 <= v <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {v}")
    for tok, bias in (p.logit_bias or {}).items():
        if not -100 <= bias <= 100:  # the OpenAI API's range; an infinite or NaN bias would poison the softmax
            raise ValueError(f"logit_bias of token {tok} must be in [-100, 100], got {bias}")
    most = vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None and not 0 <= v <= most:
            raise ValueError(f"{name} must be in [0, {most}] (max_logprobs), got {v}")
    if p.token_type_start is not None and p.token_type_start < 0:
        raise ValueError(f"token_type_start must be >= 0, got {p.token_type_start}")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise ValueError("allowed_token_ids must not be empty")
    if p.bad_words_ids is not None and not all(p.bad_words_ids):
        raise ValueError("bad_words_ids must not hold an empty sequence")
    for tok in [*(p.logit_bias or {}), *p.stop_token_ids, *(p.allowed_token_ids or ()),
                *(t for w in p.bad_words_ids or () for t in w)]:
        if not 0 <= int(tok) < vocab_size:
            raise ValueError(f"token id {tok} in logit_bias/stop_token_ids/allowed_token_ids/bad_words is outside "
                             f"the vocabulary (0..{vocab_size - 1})")


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output token ``position``: splitmix64 of the pair, so nearby seeds
    and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _no_token_left(seq: Sequence) -> str:
    """Why ``seq``'s row has no token it may sample: its grammar's own error, or the settings that together
    exclude every token."""
    c = seq.constraint
    msg = c.error_message() if c is not None and hasattr(c, "error_message") else None
    if msg:
        return msg
    p = seq.params
    limits = p.allowed_token_ids or p.bad_words_ids or seq.num_output_tokens < p.min_tokens
    if c is not None and not limits:
        return "no token may be sampled here: the structured-output constraint allows none"
    settings = "allowed_token_ids, bad_words and min_tokens (which bans the stop tokens until then)"
    if c is not None:
        settings = "the structured-output constraint with " + settings
    return f"no token may be sampled here: {settings} exclude every one"


def _completing_bad_words(output: list[int], words: Seq[Seq[int]]) -> set[int]:
    """The last token of each bad word whose other tokens end ``output``."""
    out = set()
    for w in words:
        k = len(w) - 1
        if k == 0 or (len(output) >= k and output[-k:] == list(w[:k])):
            out.add(int(w[-1]))
    return out


@dataclass
class _After:
    """A speculative row's view of its sequence's constraint: the mask once the drafts before the row are accepted."""

    constraint: LookaheadConstraint
    draft: Seq[int]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.constraint.fill_bitmask_after(self.draft, bitmask, row)


class _Uploads:
    """Host lists packed into one staging buffer and uploaded with one copy; `get` returns each as a device view."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.parts: dict[str, list] = {}

    def add(self, name: str, values: list) -> None:
        self.parts[name] = values

    def upload(self) -> dict[str, torch.Tensor]:
        total = sum(len(v) for v in self.parts.values())
        if total == 0:
            return {}
        host = self.staging.host(total)
        offsets, o = {}, 0
        for name, values in self.parts.items():
            host[o:o + len(values)] = values
            offsets[name] = (o, o + len(values))
            o += len(values)
        dev = self.staging.upload(total)
        return {name: dev[a:b] for name, (a, b) in offsets.items()}


class Sampler:
    """Samples one token per row. Holds the per-request generators of seeded requests and the device-side token
    counts of requests with penalties."""

    def __init__(self, vocab_size: int, device: torch.device, bitmask_filler: BitmaskFiller | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.bitmask_filler = bitmask_filler
        self._seeded = torch.Generator(device=self.device)
        self._penalties = PenaltyState(vocab_size, self.device)
        self._f32 = Staging(torch.float32, self.device)
        self._i64 = Staging(torch.int64, self.device)
        self._bitmask = Staging(torch.int32, self.device, capacity=bitmask_words(vocab_size) * 4)
        vocab = torch.arange(vocab_size, device=self.device)
        self._word_of = vocab // 32  # token -> its bitmask word, and its bit in it
        self._bit_of = (vocab % 32).to(torch.int32)
        self._neg_inf = torch.tensor(float("-inf"), device=self.device)

    def forget(self, request_id: str) -> None:
        self._penalties.forget(request_id)

    def drafts_kept(self, seq: Sequence, kept: int) -> None:
        """``kept`` draft tokens of ``seq``'s speculative chunk were kept (its penalty counts already hold them)."""
        self._penalties.advance(seq, kept)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: set[int],
                 ahead: Seq[Seq[int]] | None = None, defer: bool = False) -> SamplerOutput | DeferredSample:
        """One token per row of ``logits``; ``seqs[i]`` is row ``i``'s sequence. ``ahead[i]``: the draft tokens
        between that sequence's end and row ``i``'s position (rows of a speculative chunk, in order; () for a
        sequence's own next token). With ``defer``, a `DeferredSample` instead (a constrained row's grammar must
        accept its token before the sequence's next row is masked)."""
        n, v = logits.shape
        ahead = ahead or [()] * n
        params = [s.params for s in seqs]
        errors: dict[int, str] = {}

        # ---- host side: what this step needs, from the requests alone
        up = _Uploads(self._i64)
        bias_rows, bias_cols, bias_vals = [], [], []
        for i, p in enumerate(params):
            for tok, b in (p.logit_bias or {}).items():
                bias_rows.append(i), bias_cols.append(int(tok)), bias_vals.append(float(b))
        ban_rows, ban_cols = [], []
        allow_rows, allow_at, allow_cols = [], [], []
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.num_output_tokens + len(ahead[i]) < p.min_tokens:  # EOS too under ignore_eos, as vLLM bans it
                for tok in set(p.stop_token_ids) | eos_token_ids:
                    if 0 <= tok < v:
                        ban_rows.append(i), ban_cols.append(tok)
            if p.bad_words_ids:  # (a token banned twice is set to -inf twice)
                output = s.output_token_ids
                if ahead[i]:  # only the tail a bad word can reach: copying the whole output grew with its length
                    reach = max(map(len, p.bad_words_ids)) - 1
                    output = (output[len(output) - reach:] if reach else []) + list(ahead[i])
                for tok in _completing_bad_words(output, p.bad_words_ids):
                    ban_rows.append(i), ban_cols.append(tok)
            if p.allowed_token_ids:
                allow_at += [len(allow_rows)] * len(p.allowed_token_ids)
                allow_cols += p.allowed_token_ids
                allow_rows.append(i)
        pen_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                    or p.frequency_penalty != 0.0]
        pen_seqs = [seqs[i] for i in pen_rows]
        sample_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_EPS]
        con_rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        # rows whose allowed tokens, bans (bad words, stop tokens before min_tokens) may leave none (constrained
        # rows are checked after their bitmask)
        hard_rows = sorted(set(allow_rows).union(ban_rows).difference(con_rows)) if allow_rows or ban_rows else []
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        for name, values in (("bias_rows", bias_rows), ("bias_cols", bias_cols), ("ban_rows", ban_rows),
                             ("ban_cols", ban_cols), ("pen_rows", pen_rows), ("con_rows", con_rows),
                             ("allow_rows", allow_rows), ("allow_at", allow_at), ("allow_cols", allow_cols),
                             ("hard_rows", hard_rows)):
            if values:
                up.add(name, values)
        if pen_rows:
            slots, rb = self._penalties.slots_for(pen_seqs)
            up.add("pen_slots", slots)
            if any(ahead[i] for i in pen_rows):
                self._add_ahead(up, [ahead[i] for i in pen_rows])
            if rb.slots:
                for name in ("slots", "output_slots", "output_ids", "prompt_slots", "prompt_ids"):
                    up.add("rb_" + name, getattr(rb, name))
        settings = sample_rows or pen_rows
        floats = _Uploads(self._f32)
        if settings:
            floats.add("settings", [x for p in params for x in (
                p.temperature, p.top_p, p.min_p, float(min(p.top_k, v) if p.top_k > 0 else v), p.repetition_penalty,
                p.frequency_penalty, p.presence_penalty)])
        if bias_vals:
            floats.add("bias_vals", bias_vals)
        bitmask = self._fill_bitmasks([seqs[i].constraint if not ahead[i] else _After(seqs[i].constraint, ahead[i])
                                       for i in con_rows], v, con_rows, errors) if con_rows else None

        # ---- device side
        logits = logits.float()
        if bias_rows or allow_rows or ban_rows or pen_rows or con_rows:  # edited in place below: the caller's
            logits = logits.clone()  # tensor stays as it was (a greedy or plain sampling batch copies nothing)
        dev = up.upload()
        fdev = floats.upload()
        cfg = fdev["settings"].view(n, 7) if settings else None
        if bias_rows:
            logits.index_put_((dev["bias_rows"], dev["bias_cols"]), fdev["bias_vals"], accumulate=True)
        if allow_rows:
            keep = torch.zeros(len(allow_rows), v, dtype=torch.bool, device=logits.device)
            keep[dev["allow_at"], dev["allow_cols"]] = True
            logits[dev["allow_rows"]] = logits[dev["allow_rows"]].masked_fill(~keep, float("-inf"))
        if ban_rows:
            logits.index_put_((dev["ban_rows"], dev["ban_cols"]), self._neg_inf)
        if pen_rows:
            if "rb_slots" in dev:
                self._penalties.load(dev["rb_slots"], dev["rb_output_slots"], dev["rb_output_ids"],
                                     dev["rb_prompt_slots"], dev["rb_prompt_ids"])
            self._apply_penalties(logits, dev["pen_rows"], dev["pen_slots"], cfg, dev)
        dead = None
        if con_rows or hard_rows:
            dead = torch.zeros(n, device=logits.device)
        if hard_rows:
            dead.index_put_((dev["hard_rows"],), self._zero_dead(logits, dev["hard_rows"], logits[dev["hard_rows"]]))
        if con_rows:
            dead.index_put_((dev["con_rows"],), self._apply_bitmask(logits, dev["con_rows"], bitmask,
                                                                    filler_failed=bool(errors)))

        logprobs_all = torch.log_softmax(logits, dim=-1) if lp_rows else None
        tokens = logits.argmax(dim=-1)
        if sample_rows:
            sampled = self._sample(logits, cfg, seqs, sample_rows, ahead)
            tokens = sampled if len(sample_rows) == n else torch.where(cfg[:, _T] < GREEDY_EPS, tokens, sampled)
        if pen_rows:
            pen_tokens = tokens[dev["pen_rows"]]
            self._penalties.count_sampled([s for s, a in zip(pen_seqs, (ahead[i] for i in pen_rows)) if not a],
                                          dev["pen_slots"], pen_tokens,
                                          self._kept_rows(pen_tokens, dev) if "ahead_next" in dev else None)

        # ---- the one read: tokens, plus dead-row flags and logprobs when there are any
        cols = [tokens.unsqueeze(1)]
        k = max((params[i].logprobs for i in lp_rows), default=0)
        if dead is not None:
            cols.append(dead.unsqueeze(1))
        if logprobs_all is not None:
            cols.append(logprobs_all.gather(1, tokens.unsqueeze(1)))
            if k > 0:
                top_v, top_i = logprobs_all.topk(k, dim=-1)
                cols += [top_v, top_i]
        unpack = functools.partial(self._unpack, seqs=seqs, dead_rows=con_rows + hard_rows, errors=errors,
                                   lp_rows=lp_rows, k=k, has_dead=dead is not None)
        table = tokens.unsqueeze(1) if len(cols) == 1 else torch.cat([c.double() for c in cols], dim=1)
        if not defer:
            return unpack(table.tolist())
        if self.device.type != "cuda":
            return DeferredSample(tokens, table, None, unpack)
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return DeferredSample(tokens, host, done, unpack)

    def _fill_bitmasks(self, constraints: list[Constraint], v: int, con_rows: list[int],
                       errors: dict[int, str]) -> torch.Tensor:
        """Fill the constrained rows' packed bitmask on the host and upload it (int32 ``[m, ceil(V/32)]``)."""
        words = bitmask_words(v)
        m = len(constraints)
        host = self._bitmask.host_tensor(m * words).view(m, words)
        host.zero_()
        try:
            (self.bitmask_filler or fill_bitmasks_serial)(constraints, host)
        except Exception as e:  # the filler failed as a whole: every constrained row fails
            for i in con_rows:
                errors[i] = f"constraint failed while computing allowed tokens: {type(e).__name__}: {e}"
            host.fill_(-1)
        return self._bitmask.upload(m * words).view(m, words)

    def _apply_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                       filler_failed: bool) -> torch.Tensor:
        """Mask the constrained ``rows``' disallowed tokens to -inf on the device. Returns, per constrained row, 1.0
        where no token is left (its logits become 0 so the draw stays finite; the request ends with an error).
        When the filler failed (its error is already known) every constrained row is zeroed."""
        allowed = ((bitmask[:, self._word_of] >> self._bit_of) & 1).bool()
        return self._zero_dead(logits, rows, logits[rows].masked_fill(~allowed, float("-inf")),
                               zero_all=filler_failed)

    @staticmethod
    def _zero_dead(logits: torch.Tensor, rows: torch.Tensor, sub: torch.Tensor, zero_all: bool = False
                   ) -> torch.Tensor:
        """Write ``sub`` (the new logits of ``rows``) into ``logits``; 1.0 per row that has no token left (its logits
        become 0 so the draw stays finite; the request ends with an error), else 0.0. ``zero_all`` zeroes every row
        (their error is already known)."""
        dead = torch.isneginf(sub).all(dim=1)
        zero = torch.ones_like(dead) if zero_all else dead
        logits[rows] = torch.where(zero.unsqueeze(1), 0.0, sub)
        return dead.float()

    @staticmethod
    def _add_ahead(up: _Uploads, ahead: list[Seq[int]]) -> None:
        """Uploads for penalty rows ahead of their sequence (``ahead`` per penalty row): the drafts each row counts
        (``ahead_rows``, ``ahead_toks``), the draft at each row's own position (``ahead_next``, -1 at a chunk's
        last row) and the index of its chunk's first row (``ahead_first``)."""
        rows, toks, nxt, first = [], [], [], []
        for r, a in enumerate(ahead):
            rows += [r] * len(a)
            toks += a
            first.append(r - len(a))
            if r and a:
                nxt[-1] = a[-1]  # the row before this one, in the same chunk, was to sample this draft
            nxt.append(-1)
        up.add("ahead_rows", rows)
        up.add("ahead_toks", toks)
        up.add("ahead_next", nxt)
        up.add("ahead_first", first)

    @staticmethod
    def _kept_rows(tokens: torch.Tensor, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """1.0 for each penalty row whose token is kept: every earlier row of its chunk sampled its draft."""
        miss = (tokens != dev["ahead_next"]).long()
        before = miss.cumsum(0) - miss
        return (before == before[dev["ahead_first"]]).float()

    def _apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                         cfg: torch.Tensor, dev: dict[str, torch.Tensor]) -> None:
        sub = logits[rows]
        counts = self._penalties.counts[slots]
        if "ahead_rows" in dev:
            counts.index_put_((dev["ahead_rows"], dev["ahead_toks"]), torch.ones_like(dev["ahead_toks"],
                                                                                   dtype=torch.float32),
                              accumulate=True)
        present = counts > 0
        seen = self._penalties.prompt_seen[slots] | present
        c = cfg[rows]
        rep = c[:, _REP].clamp(min=torch.finfo(c.dtype).tiny).unsqueeze(1)  # a float32 0 would divide by zero
        big = torch.finfo(sub.dtype).max  # a tiny penalty's quotient stays a finite (huge) logit, not inf
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep).clamp(-big, big), sub)
        sub = sub - c[:, _FREQ].unsqueeze(1) * counts - c[:, _PRES].unsqueeze(1) * present.float()
        logits[rows] = sub

    def _sample(self, logits: torch.Tensor, cfg: torch.Tensor, seqs: Seq[Sequence],
                sample_rows: list[int], ahead: Seq[Seq[int]]) -> torch.Tensor:
        """A draw for every row (rows that are greedy get a token too, discarded by the caller)."""
        n, v = logits.shape
        params = [seqs[i].params for i in sample_rows]
        logits = logits / cfg[:, _T].clamp(min=GREEDY_EPS).unsqueeze(1)
        if any(p.min_p > 0 for p in params):  # first (vLLM): top-p takes its nucleus of what min_p kept
            probs = logits.softmax(dim=-1)
            thresh = cfg[:, _MIN_P].unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        use_top_k = any(0 < p.top_k < v for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if use_top_k:  # below the k-th logit (vLLM's rule: a tie with the k-th stays)
                kth = (cfg[:, _TOP_K].clamp(1, v).long() - 1).unsqueeze(1)
                sorted_logits = sorted_logits.masked_fill(sorted_logits < sorted_logits.gather(1, kth), float("-inf"))
            if use_top_p:  # past the smallest set whose probability reaches top_p (vLLM's)
                probs = sorted_logits.softmax(dim=-1)
                before = probs.cumsum(dim=-1) - probs
                top_p = cfg[:, _TOP_P]
                top_p = torch.where(top_p >= 1.0, torch.inf, top_p)  # "off" must not trim rounding-error tails
                cut = before >= top_p.unsqueeze(1)
                cut[:, 0] = False  # the top token stays, as in vLLM: a top_p float32 rounds to 0 cut every token
                sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i in sample_rows:
            seed = seqs[i].params.seed
            if seed is not None:
                self._seeded.manual_seed(position_seed(seed, seqs[i].num_output_tokens + len(ahead[i])))
                noise[i] = torch.empty(v, device=logits.device).exponential_(generator=self._seeded)
        # an exact 0 draw would make 0/0 = NaN, which argmax picks, for a token whose probability is 0
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _unpack(rows: list[list[float]], seqs: Seq[Sequence], dead_rows: list[int], errors: dict[int, str],
                lp_rows: list[int], k: int, has_dead: bool) -> SamplerOutput:
        """Host lists from the one read -> tokens, errors of rows left with no allowed token, logprobs."""
        n = len(rows)
        tokens = [int(r[0]) for r in rows]
        rejected = set()
        if has_dead:
            for i in dead_rows:
                if rows[i][1] and i not in errors:
                    errors[i] = _no_token_left(seqs[i])
                    rejected.add(i)
        for i in errors:
            tokens[i] = -1
        lps: list[TokenLogprob | None] = [None] * n
        first = 2 if has_dead else 1
        for i in lp_rows:
            if i in errors:
                continue
            r = rows[i]
            kk = seqs[i].params.logprobs
            top = [(int(r[first + 1 + k + m]), r[first + 1 + m]) for m in range(kk)] if kk else []
            lps[i] = TokenLogprob(token_id=tokens[i], logprob=r[first], top=top)
        return SamplerOutput(token_ids=tokens, logprobs=lps, errors=errors, rejected=rejected)
