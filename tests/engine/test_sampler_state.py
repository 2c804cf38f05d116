"""The sampler's device-side state: per-request penalty counts track exactly the tokens each request generated
(across steps, after a slot is reused or the table grows, and when a request ID comes back with another sequence),
and greedy rows in a batch that also samples keep their argmax."""
from __future__ import annotations

import collections

import pytest
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
    got = []
    for _ in range(20):
        got.append(s(logits, seqs, set()).token_ids)
        for seq, tok in zip(seqs, got[-1]):
            seq.output_token_ids.append(tok)
    want = logits.argmax(dim=-1).tolist()
    for toks in got:
        assert [toks[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]
    assert len({tuple(t[i] for i in (1, 3, 5)) for t in got}) > 1  # the hot rows do draw


def test_a_row_ahead_of_its_sequence_samples_as_if_the_drafts_were_emitted():
    """A speculative chunk's rows: each gets the tokens, logprobs, bans and penalties of a sequence that had already
    emitted the drafts before it, and afterwards the counts hold exactly the kept tokens."""
    torch.manual_seed(2)
    params = SamplingParams(temperature=0.9, seed=5, frequency_penalty=0.9, presence_penalty=0.5,
                            repetition_penalty=1.3, bad_words_ids=[[3, 4]], logprobs=3, min_tokens=4,
                            stop_token_ids=[6])
    logits = torch.randn(4, V)

    def alone(outputs: list[int], row: torch.Tensor) -> tuple[int, list]:
        seq = Sequence("r", [1, 9], params)
        seq.output_token_ids = list(outputs)
        out = Sampler(V, torch.device("cpu"))(row.unsqueeze(0), [seq], set())
        return out.token_ids[0], out.logprobs[0]

    emitted = [2, 3]  # what plain decoding emits next, one token at a time
    for j in range(3):
        emitted.append(alone(emitted, logits[j])[0])
    drafts = (emitted[2], emitted[3], (emitted[4] + 1) % V)  # two right, the third wrong
    s = Sampler(V, torch.device("cpu"))
    seq = Sequence("r", [1, 9], params)
    seq.output_token_ids = [2, 3]
    out = s(logits, [seq] * 4, set(), ahead=[drafts[:j] for j in range(4)])
    for j in range(4):
        tok, lp = alone([2, 3, *drafts[:j]], logits[j])
        assert out.token_ids[j] == tok and out.logprobs[j].logprob == pytest.approx(lp.logprob)
        assert [t for t, _ in out.logprobs[j].top] == [t for t, _ in lp.top]
        assert [x for _, x in out.logprobs[j].top] == pytest.approx([x for _, x in lp.top])
    assert out.token_ids[:3] == emitted[2:]
    s.drafts_kept(seq, 2)
    seq.output_token_ids += out.token_ids[:3]
    assert _counts(s, seq) == {t: float(c) for t, c in collections.Counter(seq.output_token_ids).items()}
    s(torch.randn(1, V), [seq], set())  # the next step finds the slot current: nothing rebuilt
    assert s._penalties._slots["r"].counted == len(seq.output_token_ids) + 1
