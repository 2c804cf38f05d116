"""Sampler semantics on hand-made logits: top-k / top-p / min-p keep exactly the documented tokens, temperature draws
follow the softmax, penalties move the argmax, seeded rows are reproducible."""
from __future__ import annotations

import math

import torch

from ember.engine.params import SamplingParams
from ember.engine.sampler import Sampler
from ember.engine.sequence import Sequence

PROBS = [0.4, 0.3, 0.2, 0.1]


def _rows(n: int, params: SamplingParams, outputs: list[int] | None = None) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(f"r{i}", [7], params)
        s.output_token_ids = list(outputs or [])
        seqs.append(s)
    return seqs


def _logits(n: int, probs=PROBS, vocab: int = 8) -> torch.Tensor:
    row = torch.full((vocab,), -1e9)
    row[: len(probs)] = torch.tensor(probs).log()
    return row.repeat(n, 1)


def _draw(params: SamplingParams, n: int = 3000) -> list[int]:
    torch.manual_seed(0)
    return Sampler(8, torch.device("cpu"))(_logits(n), _rows(n, params), set()).token_ids


def test_top_k_top_p_min_p_keep_the_documented_tokens():
    assert set(_draw(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.5))) == {0, 1}  # 0.4 < 0.5, 0.4+0.3 >= 0.5
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.75))) == {0, 1, 2}
    assert set(_draw(SamplingParams(temperature=1.0, min_p=0.6))) == {0, 1}  # keep p >= 0.6 * 0.4
    assert set(_draw(SamplingParams(temperature=1.0))) == {0, 1, 2, 3}
    # a top_k past any float (a 310-digit JSON integer) keeps every token; it failed the whole batch's step
    assert set(_draw(SamplingParams(temperature=1.0, top_k=10**309))) == {0, 1, 2, 3}
    # min_p first, as vLLM: it keeps 0.4, 0.3, 0.2 (renormalised 4/9, 3/9, 2/9), whose 0.75 nucleus is the first two
    assert set(_draw(SamplingParams(temperature=1.0, min_p=0.4, top_p=0.75))) == {0, 1}


def _draw_from(probs: list[float], params: SamplingParams, n: int = 2000) -> set[int]:
    torch.manual_seed(0)
    return set(Sampler(8, torch.device("cpu"))(_logits(n, probs), _rows(n, params), set()).token_ids)


def test_ties_follow_vllms_top_k_and_top_p_rules():
    """vLLM keeps every token tied with the k-th logit, and top-p keeps the smallest set whose probability reaches
    top_p: a token whose predecessors already reach it is dropped (equal logits, e.g. untrained reserved tokens)."""
    tied = [0.3, 0.3, 0.3, 0.1]
    assert _draw_from(tied, SamplingParams(temperature=1.0, top_k=1)) == {0, 1, 2}
    assert _draw_from(tied, SamplingParams(temperature=1.0, top_k=3)) == {0, 1, 2}
    halves = [0.5, 0.5]
    assert len(_draw_from(halves, SamplingParams(temperature=1.0, top_p=0.5))) == 1
    assert _draw_from(halves, SamplingParams(temperature=1.0, top_p=0.51)) == {0, 1}


def test_min_tokens_holds_back_eos_also_under_ignore_eos():
    """vLLM bans the EOS tokens until `min_tokens` whether or not `ignore_eos` is set (EOS would not stop the reply,
    but the first tokens are still not EOS)."""
    s = Sampler(8, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert s(_logits(1), _rows(1, params), {0}).token_ids == [1]
    assert s(_logits(1), _rows(1, params, outputs=[1, 1]), {0}).token_ids == [0]  # min_tokens reached


def test_temperature_draws_follow_the_softmax():
    n = 4000
    for temp in (1.0, 0.5):
        toks = _draw(SamplingParams(temperature=temp), n)
        want = torch.tensor(PROBS) ** (1 / temp)
        want = want / want.sum()
        for t in range(4):
            freq = toks.count(t) / n
            assert abs(freq - float(want[t])) < 4 * math.sqrt(float(want[t]) * (1 - float(want[t])) / n) + 1e-3


def test_penalties_move_the_argmax():
    s = Sampler(8, torch.device("cpu"))
    flat = torch.zeros(1, 8)
    flat[0, :4] = torch.tensor([3.0, 2.9, 2.8, 2.7])
    assert s(flat, _rows(1, SamplingParams(temperature=0.0), [0, 0, 1]), set()).token_ids == [0]
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.2)  # 3.0-0.4, 2.9-0.2, 2.8 -> token 2
    assert s(flat, _rows(1, freq, [0, 0, 1]), set()).token_ids == [2]
    pres = SamplingParams(temperature=0.0, presence_penalty=0.25)  # 2.75, 2.65, 2.8 -> token 2
    assert s(flat, _rows(1, pres, [0, 1]), set()).token_ids == [2]
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)  # seen token 0: 3.0 / 2 -> token 1
    assert s(flat, _rows(1, rep, [0]), set()).token_ids == [1]


def test_settings_past_float32s_range_keep_the_top_token():
    """A top_p that float32 rounds to 0 (1e-46) cut every token, so each step drew token 0 from a row of NaN; a
    repetition penalty that small made seen logits inf (NaN log-probs). Both now keep the top token, as vLLM does."""
    s = Sampler(8, torch.device("cpu"))
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-46)
    assert set(s(_logits(50, [0.1, 0.2, 0.6, 0.1]), _rows(50, tiny_p), set()).token_ids) == {2}
    flat = torch.zeros(1, 8)
    flat[0, :4] = torch.tensor([3.0, 2.9, 2.8, 2.7])
    for penalty in (1e-40, 1e-300):
        out = s(flat, _rows(1, SamplingParams(temperature=0.0, repetition_penalty=penalty, logprobs=1), [1]), set())
        assert out.token_ids == [1]  # the seen token's positive logit, divided by a tiny penalty, is the largest
        assert math.isfinite(out.logprobs[0].logprob), out.logprobs


def test_seeded_rows_reproduce_regardless_of_neighbours():
    sp = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(8, torch.device("cpu"))(_logits(1), _rows(1, sp), set()).token_ids[0]
    s1, s2 = Sampler(8, torch.device("cpu")), Sampler(8, torch.device("cpu"))
    seq_a = _rows(1, sp)
    seq_b = _rows(1, sp)
    others = _rows(5, SamplingParams(temperature=1.0))
    run_a, run_b = [], []
    for _ in range(20):  # each token appended, as the engine does: a seeded draw follows its output position
        run_a.append(s1(_logits(1), seq_a, set()).token_ids[0])
        seq_a[0].output_token_ids.append(run_a[-1])
        run_b.append(s2(_logits(6), others[:2] + seq_b + others[2:], set()).token_ids[2])
        seq_b[0].output_token_ids.append(run_b[-1])
    assert run_a == run_b and run_a[0] == alone
    assert len(set(run_a)) > 1


def test_the_callers_logits_stay_as_they_were():
    """Biases, allowed tokens, bans, penalties and greedy or sampled rows all read the logits they are given without
    editing them: the runner's (or a CUDA graph's) logits are still the model's after sampling."""
    s = Sampler(8, torch.device("cpu"))
    for params, want in ((SamplingParams(temperature=0.0), 0),
                         (SamplingParams(temperature=0.0, logit_bias={3: 50.0}), 3),
                         (SamplingParams(temperature=0.0, allowed_token_ids=[2]), 2),
                         (SamplingParams(temperature=0.0, min_tokens=2), 1),
                         (SamplingParams(temperature=0.0, repetition_penalty=5.0), 1),
                         (SamplingParams(temperature=0.7, top_k=1), 0)):
        logits = _logits(1)
        before = logits.clone()
        seq = Sequence("r", [7], params)
        seq.output_token_ids = [0]
        assert s(logits, [seq], {0}).token_ids == [want], params  # each edit took effect, on a copy
        assert torch.equal(logits, before), params
