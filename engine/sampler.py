"""Turning a batch of next-token logits into tokens, vectorised over the batch.

Order per row: logit_bias, min_tokens (stop tokens masked), repetition/frequency/presence penalties, the constraint
bitmask, then logprobs (log-softmax of these processed logits, before temperature), then greedy argmax or
temperature -> top-k -> top-p -> min-p -> a draw. Draws use the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``;
a seeded request draws its ``E`` from its own ``torch.Generator``, one draw per step, so its tokens do not depend on
the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from ember.engine.constraint import BitmaskFiller, bitmask_words, fill_bitmasks_serial
from ember.engine.params import SamplingParams, TokenLogprob
from ember.engine.sequence import Sequence

_GREEDY_EPS = 1e-5


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One per row; undefined (-1) for rows in ``errors``."""
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str] = field(default_factory=dict)
    """Rows that could not sample (their constraint failed or allowed no token), with the reason."""


def validate_params(p: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the field when a setting is out of range."""
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
    if p.logprobs is not None and not 0 <= p.logprobs <= 20:
        raise ValueError(f"logprobs must be in [0, 20], got {p.logprobs}")
    for tok in list((p.logit_bias or {}).keys()) + list(p.stop_token_ids):
        if not 0 <= int(tok) < vocab_size:
            raise ValueError(f"token id {tok} in logit_bias/stop_token_ids is outside the vocabulary "
                             f"(0..{vocab_size - 1})")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


class Sampler:
    """Samples one token per row. Holds the per-request generators of seeded requests."""

    def __init__(self, vocab_size: int, device: torch.device, bitmask_filler: BitmaskFiller | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.bitmask_filler = bitmask_filler
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        g = self._generators.get(seq.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(seq.params.seed))
            self._generators[seq.request_id] = g
        return g

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: set[int]) -> SamplerOutput:
        n, v = logits.shape
        dev = logits.device
        logits = logits.float().clone()
        params = [s.params for s in seqs]
        errors: dict[int, str] = {}

        # logit_bias
        bias_rows, bias_cols, bias_vals = [], [], []
        for i, p in enumerate(params):
            for tok, b in (p.logit_bias or {}).items():
                bias_rows.append(i), bias_cols.append(int(tok)), bias_vals.append(float(b))
        if bias_rows:
            logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev)),
                              torch.tensor(bias_vals, device=dev), accumulate=True)

        # min_tokens: stop tokens are not allowed yet
        ban_rows, ban_cols = [], []
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
                for tok in stops:
                    if 0 <= tok < v:
                        ban_rows.append(i), ban_cols.append(tok)
        if ban_rows:
            logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")

        self._apply_penalties(logits, seqs)
        self._apply_constraints(logits, seqs, errors)

        want_lp = [p.logprobs is not None for p in params]
        logprobs_all = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        greedy = temps < _GREEDY_EPS
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            rows = (~greedy).nonzero().flatten()
            sub_seqs = [seqs[i] for i in rows.tolist()]
            tokens[rows] = self._sample(logits[rows] / temps[rows].unsqueeze(1), sub_seqs)

        token_list = tokens.tolist()
        for i in errors:
            token_list[i] = -1
        lps: list[TokenLogprob | None] = [None] * n
        if logprobs_all is not None:
            lp_rows = [i for i in range(n) if want_lp[i] and i not in errors]
            if lp_rows:
                idx = torch.tensor(lp_rows, device=dev)
                sel = logprobs_all[idx]
                chosen = sel.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
                k = max(params[i].logprobs for i in lp_rows)
                top_v, top_i = (sel.topk(k, dim=-1) if k > 0 else (None, None))
                top_v = top_v.tolist() if top_v is not None else None
                top_i = top_i.tolist() if top_i is not None else None
                for j, i in enumerate(lp_rows):
                    kk = params[i].logprobs
                    top = [(top_i[j][m], top_v[j][m]) for m in range(kk)] if kk and top_v is not None else []
                    lps[i] = TokenLogprob(token_id=token_list[i], logprob=chosen[j], top=top)
        return SamplerOutput(token_ids=token_list, logprobs=lps, errors=errors)

    def _apply_penalties(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
                or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
        if not rows:
            return
        dev, v = logits.device, logits.shape[1]
        idx = torch.tensor(rows, device=dev)
        sub = logits[idx]
        out_ids = _padded([seqs[i].output_token_ids for i in rows], v, dev)
        counts = torch.zeros(len(rows), v + 1, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        counts = counts[:, :v]
        rep = torch.tensor([seqs[i].params.repetition_penalty for i in rows], device=dev).unsqueeze(1)
        if bool((rep != 1.0).any()):
            prompt_ids = _padded([seqs[i].prompt_token_ids for i in rows], v, dev)
            seen = torch.zeros(len(rows), v + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, prompt_ids, True)
            seen = seen[:, :v] | (counts > 0)
            penalised = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalised, sub)
        freq = torch.tensor([seqs[i].params.frequency_penalty for i in rows], device=dev).unsqueeze(1)
        pres = torch.tensor([seqs[i].params.presence_penalty for i in rows], device=dev).unsqueeze(1)
        sub = sub - freq * counts - pres * (counts > 0).float()
        logits[idx] = sub

    def _apply_constraints(self, logits: torch.Tensor, seqs: Seq[Sequence], errors: dict[int, str]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return
        v = logits.shape[1]
        constraints = [seqs[i].constraint for i in rows]
        bitmask = torch.zeros(len(rows), bitmask_words(v), dtype=torch.int32)
        try:
            (self.bitmask_filler or fill_bitmasks_serial)(constraints, bitmask)
        except Exception as e:  # the filler failed as a whole: every constrained row fails
            for i in rows:
                errors[i] = f"constraint failed while computing allowed tokens: {type(e).__name__}: {e}"
            logits[torch.tensor(rows, device=logits.device)] = 0.0
            return
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)[:, :v].bool()
        allowed = allowed.to(logits.device)
        idx = torch.tensor(rows, device=logits.device)
        sub = logits[idx].masked_fill(~allowed, float("-inf"))
        dead = torch.isinf(sub).all(dim=1) & (sub < 0).all(dim=1)
        for j in dead.nonzero().flatten().tolist():
            i = rows[j]
            msg = constraints[j].error_message() if hasattr(constraints[j], "error_message") else None
            errors[i] = msg or "the constraint allows no next token"
            sub[j] = 0.0
        logits[idx] = sub

    def _sample(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        n, v = logits.shape
        dev = logits.device
        top_k = [s.params.top_k if s.params.top_k > 0 else v for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k < v for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(v, device=dev).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= torch.tensor(top_k, device=dev).unsqueeze(1),
                                                      float("-inf"))
            if any(p < 1.0 for p in top_p):
                probs = sorted_logits.softmax(dim=-1)
                before = probs.cumsum(dim=-1) - probs
                sorted_logits = sorted_logits.masked_fill(before > torch.tensor(top_p, device=dev).unsqueeze(1),
                                                          float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        min_p = [s.params.min_p for s in seqs]
        probs = logits.softmax(dim=-1)
        if any(m > 0 for m in min_p):
            thresh = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        noise = torch.empty_like(probs)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            noise[torch.tensor(unseeded, device=dev)] = torch.empty(len(unseeded), v, device=dev).exponential_()
        for i in seeded:
            noise[i] = torch.empty(v, device=dev).exponential_(generator=self._generator(seqs[i]))
        # an exact 0 draw would make 0/0 = NaN, which argmax picks, for a token whose probability is 0
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
