"""The sampler's device-side state: per-request penalty counts track exactly the tokens each request generated
(across steps, after a slot is reused or the table grows, and when a request ID comes back with another sequence),
and greedy rows in a batch that also samples keep their argmax."""
from __future__ import annotations

import collections

import torch

from ember.engine.params import SamplingParams
from ember.engine.sampler import Sampler
from ember.engine.sequence import Sequence

V = 40


def _counts(sampler: Sampler, seq: Sequence) -> dict[int, float]:
    slot = sampler._penalties._slots[seq.request_id].index
    row = sampler._penalties.counts[slot]
    return {t: float(row[t]) for t in range(V) if row[t] != 0}


def test_penalty_counts_follow_the_generated_tokens():
    torch.manual_seed(0)
    s = Sampler(V, torch.device("cpu"))
    pen = SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3)
    seqs = [Sequence(f"r{i}", [1, 2, 3 + i], pen) for i in range(7)]
    seqs.append(Sequence("plain", [4], SamplingParams(temperature=1.0)))
    for step in range(12):
        out = s(torch.randn(len(seqs), V), seqs, set())
        for seq, tok in zip(seqs, out.token_ids):
            seq.append_token(tok)
        for seq in seqs:
            if seq.params.frequency_penalty:
                want = collections.Counter(seq.output_token_ids)
                assert _counts(s, seq) == {t: float(c) for t, c in want.items()}
        if step in (3, 7):  # one request ends, two arrive: one reuses the freed slot, then the 8-slot table grows
            s.forget(seqs[0].request_id)
            seqs = seqs[1:] + [Sequence(f"n{step}a", [5], pen), Sequence(f"n{step}b", [6, 6], pen)]
    assert s._penalties.counts.shape[0] == 16
    assert "plain" not in s._penalties._slots
    assert sum(1 for _ in s._penalties._slots) == len(seqs) - 1

    again = Sequence("r2", [1], pen)  # a live ID, now another Sequence: its counts are rebuilt from it
    again.output_token_ids = [9, 9]
    s(torch.randn(1, V), [again], set())
    assert sum(_counts(s, again).values()) == 3.0 and _counts(s, again)[9] >= 2.0


def test_greedy_rows_keep_their_argmax_next_to_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, seed=4)
    seqs = [Sequence(f"q{i}", [1], greedy if i % 2 == 0 else hot) for i in range(6)]
    s = Sampler(V, torch.device("cpu"))
    got = [s(logits, seqs, set()).token_ids for _ in range(20)]
    want = logits.argmax(dim=-1).tolist()
    for toks in got:
        assert [toks[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]
    assert len({tuple(t[i] for i in (1, 3, 5)) for t in got}) > 1  # the hot rows do draw
