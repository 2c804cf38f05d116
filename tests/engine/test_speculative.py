"""N-gram speculative decoding: a speculating request emits exactly the tokens plain decoding emits (greedy or seeded,
with penalties, bans and logprobs; stops, lengths and the requests beside it included), in fewer steps when its text
repeats; drafts never cost a preemption, and drafts that keep missing pause."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams, TokenLogprob
from ember.engine.speculative import MAX_PAUSE, Drafter, NgramIndex, parse_speculative_config, speculates
from tests.engine.test_constraints import AllowList
from tests.engine.test_scheduler import expected_outputs, make, new_scheduler, token

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_the_config_reads_as_vllm_writes_it():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}) \
        == parse_speculative_config({"num_speculative_tokens": 5, "prompt_lookup_min": 4})
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5, 5)
    for model in ("[ngram]", "ngram"):  # vLLM's older spelling, the method named as the model (it was refused)
        assert parse_speculative_config({"model": model, "num_speculative_tokens": 2}) == c
    for bad, word in (({"method": "eagle", "num_speculative_tokens": 2}, "not served"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                        "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model 'x' is not served"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "draft_x": 1}, "unknown key"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
                       "disable_by_batch_size")):
        with pytest.raises(ValueError, match=word):
            parse_speculative_config(bad)


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match():
    seq: list[int] = []

    def propose(tokens: list[int], k: int, index: NgramIndex) -> list[int]:
        seq[:] = tokens
        return index.propose(lambda a, b: seq[a:b], len(seq), k)

    index = NgramIndex(1, 3)
    assert propose([5, 6, 7, 8], 3, index) == []  # no earlier occurrence of 8
    assert propose([5, 6, 7, 8, 5, 6], 3, index) == [7, 8, 5]  # "5 6" before
    assert propose([5, 6, 7, 8, 5, 6, 9, 1, 2, 6], 2, index) == [9, 1]  # the latest "6", as no longer match is there
    assert propose([5, 6, 7, 8, 5, 6, 9, 1, 2, 6, 7], 4, index) == [8, 5, 6, 9]  # "6 7" beats the latest "7"
    assert NgramIndex(2, 2).propose(lambda a, b: [1, 2, 1, 2][a:b], 4, 8) == [1, 2]  # runs into the suffix itself


def test_drafts_that_keep_missing_pause_drafting_until_one_is_kept():
    tokens = list(range(1, 9)) * 4  # always a match: only the pacing stops a draft
    drafter = Drafter(NgramIndex(1, 3), 4)

    def steps_until_next_draft() -> int:
        waited = 0
        while not drafter.draft(lambda a, b: tokens[a:b], len(tokens), 10):
            waited += 1
        return waited

    assert steps_until_next_draft() == 0
    waits = []
    for _ in range(6):
        drafter.verified(0)
        waits.append(steps_until_next_draft())
    assert waits == [1, 3, 7, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]
    drafter.verified(2)  # a hit ends the pause at once, and drafts keep their full length
    assert steps_until_next_draft() == 0 and len(drafter.draft(lambda a, b: tokens[a:b], len(tokens), 10)) == 4
    drafter.verified(0)
    assert steps_until_next_draft() == 1


def test_every_generating_request_speculates_unless_its_constraint_cannot_look_ahead():
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05),
              SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.1),
              SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
              SamplingParams(temperature=0.0, bad_words_ids=[[4]])):
        assert speculates(p, None)
    assert not speculates(SamplingParams(temperature=0.0), AllowList([3]))  # no fill_bitmask_after
    assert not speculates(SamplingParams(temperature=0.0, pooling="last"), None)


@dataclass
class Outcome:
    tokens: list[list[int]]  # per request, in order
    reasons: list[str | None]
    logprobs: list[list[TokenLogprob | None]]  # per request, one per token (None without logprobs)
    engine: Engine


def _run(path, spec, requests, **engine_kw) -> Outcome:
    """Every request to its end in one engine (``num_kv_blocks`` 256 unless given)."""
    eng = Engine.from_pretrained(path, speculative_config=spec, **{"num_kv_blocks": 256, **engine_kw})
    ids = [eng.add_request(p, params) for p, params in requests]
    out: dict[str, list[int]] = {i: [] for i in ids}
    lps: dict[str, list[TokenLogprob | None]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.logprobs or [None] * len(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return Outcome([out[i] for i in ids], [reasons[i] for i in ids], [lps[i] for i in ids], eng)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(5, 1200, (12,), generator=g).tolist()
    return [motif * 4, torch.randint(5, 1200, (30,), generator=g).tolist(), motif[:5] * 6, motif * 2]


def test_speculation_emits_exactly_the_greedy_tokens(demo_model_dir):
    prompts = _prompts()
    free = _run(demo_model_dir, None, [(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                                        for p in prompts]).tokens
    # stop on a token the third greedy run emits mid-way; lengths that end inside a block of drafts; a sampled,
    # seeded request beside them (its draws must not move)
    stop = free[2][17]
    requests = [(prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
                (prompts[1], SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)),
                (prompts[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])),
                (prompts[3], SamplingParams(max_tokens=31, temperature=0.0, ignore_eos=True, min_tokens=9)),
                (prompts[0], SamplingParams(max_tokens=30, temperature=0.9, seed=7, ignore_eos=True)),
                # the stop token is banned until min_tokens: drafted before then, it is never kept
                (prompts[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                                            min_tokens=25))]
    plain, fast = _run(demo_model_dir, None, requests), _run(demo_model_dir, NGRAM, requests)
    want, want_reasons, got, got_reasons, eng = plain.tokens, plain.reasons, fast.tokens, fast.reasons, fast.engine
    assert got == want and got_reasons == want_reasons
    assert want_reasons[2] == "stop" and want[2][-1] == stop
    stats = eng.stats()
    assert stats.spec_draft_tokens > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert eng.num_steps < plain.engine.num_steps
    eng.scheduler.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_requests_with_penalties_bans_logprobs_and_seeds_emit_what_they_emit_without_speculation(demo_model_dir):
    prompts = _prompts()
    kinds = [dict(temperature=0.0, repetition_penalty=1.05), dict(temperature=0.0, frequency_penalty=0.2,
                                                                   presence_penalty=0.1),
             dict(temperature=0.0, logit_bias={prompts[0][3]: 2.0}, bad_words_ids=[[prompts[0][4], prompts[0][5]]]),
             dict(temperature=0.0, logprobs=2), dict(temperature=0.8, seed=11, logprobs=0),
             dict(temperature=0.8, seed=5, repetition_penalty=1.1, frequency_penalty=0.3)]
    requests = [(p, SamplingParams(max_tokens=40, ignore_eos=True, **kw)) for kw in kinds for p in prompts]

    want, got = _run(demo_model_dir, None, requests), _run(demo_model_dir, NGRAM, requests)
    assert got.tokens == want.tokens
    for g, w in zip(got.logprobs, want.logprobs):
        for a, b in zip(g, w):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got.engine.stats().spec_accepted_tokens > 0


def test_no_drafts_while_the_engine_holds_more_requests_than_disable_by_batch_size(demo_model_dir):
    prompts = _prompts()
    requests = [(prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))] + [
        (p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts[1:]]
    eng = Engine.from_pretrained(demo_model_dir, num_kv_blocks=256,
                                 speculative_config={**NGRAM, "disable_by_batch_size": 2})
    ids = [eng.add_request(p, params) for p, params in requests]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_unfinished():
        held = eng.scheduler.num_running + eng.scheduler.num_waiting
        drafted = eng.stats().spec_draft_tokens
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        if held > 2:
            assert eng.stats().spec_draft_tokens == drafted  # no chunk carried drafts, none proposed
    assert eng.stats().spec_accepted_tokens > 0  # the long request drafts once it is alone
    assert [out[i] for i in ids] == _run(demo_model_dir, None, requests).tokens


class _LookaheadAllowList(AllowList):
    def fill_bitmask_after(self, draft, bitmask: torch.Tensor, row: int) -> None:
        self.fill_bitmask(bitmask, row)


def test_a_grammar_refusing_a_kept_draft_is_the_requests_fault(demo_model_dir):
    """A constraint that refuses a token of a step's kept drafts ends the request as its own fault (``rejected``: the
    server answers a 400 / invalid_request error), as it does one token at a time; it was a server error."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = Engine.from_pretrained(demo_model_dir, speculative_config=NGRAM, num_kv_blocks=256)
    eng.add_request(_prompts()[0], params)
    steps = []
    while eng.has_unfinished():
        steps += [len(o.new_token_ids) for o in eng.step()]
    kept_at = sum(steps[:next(i for i, n in enumerate(steps) if n > 1)])  # the first step that kept drafts
    ends = []
    for spec in (None, NGRAM):
        eng = Engine.from_pretrained(demo_model_dir, speculative_config=spec, num_kv_blocks=256)
        refusing = _LookaheadAllowList(list(range(eng.runner.model.config.vocab_size)), reject_after=kept_at + 1)
        eng.add_request(_prompts()[0], params, constraint=refusing)  # refuses that step's second token
        while eng.has_unfinished():
            ends += [(o.finish_reason, o.rejected) for o in eng.step() if o.finished]
    assert ends == [("error", True), ("error", True)]


def test_a_draft_never_preempts_anything():
    """A running sequence whose drafts need a block the cache does not have decodes one token instead."""
    sched = new_scheduler(num_blocks=2, block_size=4, budget=64, max_num_seqs=2)
    a = make("a", 7, max_tokens=1)
    sched.add(a)
    out = sched.schedule()  # the prefill: both blocks, whose 8 positions hold the prompt and the next token
    sched.update(out, {"a": token("a", 7)})
    a.draft = [token("a", 8), token("a", 9)]  # positions 8 and 9 would need a third block
    out = sched.schedule()
    assert not out.preempted and [(c.num_tokens, c.draft) for c in out.chunks] == [(1, ())]


def test_kept_drafts_count_as_computed_and_rejected_ones_do_not():
    sched = new_scheduler(num_blocks=16, block_size=4, budget=64, max_num_seqs=2)
    s = make("s", 6, max_tokens=12)
    sched.add(s)
    out = sched.schedule()
    sched.update(out, {"s": token("s", 6)})
    s.draft = [token("s", 7), token("s", 8), 99_999, token("s", 10)]  # the third is wrong
    out = sched.schedule()
    [chunk] = out.chunks
    assert chunk.draft == tuple(s.draft) and chunk.num_tokens == 5 and chunk.samples
    kept = [token("s", 7), token("s", 8), token("s", 9)]  # two drafts kept, then the model's own token
    sched.update(out, {"s": kept})
    assert s.num_computed_tokens == 7 + 2 and s.num_tokens == 10 and s.draft == []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {c.seq.request_id: token("s", c.seq.num_tokens) for c in out.chunks if c.samples})
        if s.num_output_tokens >= 12:
            sched.finish(s, "length")
        sched.check_integrity()
    assert s.output_token_ids == expected_outputs(s)


def test_sampled_requests_speculate_through_the_rejection_step(demo_model_dir):
    """At a temperature so low that each draw is the argmax, sampled speculation must give the greedy tokens; the
    drafts it keeps went through the sampler's rejection step (greedy requests never reach it)."""
    prompts = _prompts()
    greedy = _run(demo_model_dir, None, [(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
                                         for p in prompts]).tokens
    cold = SamplingParams(max_tokens=30, temperature=1e-3, ignore_eos=True)
    got = _run(demo_model_dir, NGRAM, [(p, cold) for p in prompts])
    assert got.tokens == greedy
    assert got.engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("scenario", range(3))
def test_random_mixes_under_preemption_emit_what_plain_decoding_emits(demo_model_dir, scenario):
    """Random batches (greedy, seeded, penalties, bans, logprobs, stops, min_tokens) in a KV cache too small for
    all of them: speculating, preempted and recomputed, every request emits the plain run's tokens and logprobs."""
    g = torch.Generator().manual_seed(100 + scenario)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    motif = torch.randint(5, 1200, (9,), generator=g).tolist()
    requests = []
    for i in range(6):
        kw: dict = dict(max_tokens=20 + pick(30), ignore_eos=True)
        kw.update([{}, dict(temperature=0.9, seed=pick(1000)), dict(repetition_penalty=1.1, frequency_penalty=0.3),
                   dict(logprobs=2), dict(bad_words_ids=[[motif[2], motif[3]]], logit_bias={motif[5]: 1.5}),
                   dict(min_tokens=15, stop_token_ids=[motif[pick(9)]], ignore_eos=False)][pick(6)])
        kw.setdefault("temperature", 0.0)
        requests.append((motif * (2 + pick(4)) + [pick(1000) + 5], SamplingParams(**kw)))
    requests[0] = (motif * 4, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))  # drafts to keep

    want, got = (_run(demo_model_dir, spec, requests, num_kv_blocks=16, block_size=8) for spec in (None, NGRAM))
    for run in (want, got):
        run.engine.scheduler.check_integrity()
        assert run.engine.kv.num_free_blocks == run.engine.kv.num_blocks
    assert got.tokens == want.tokens and got.reasons == want.reasons
    for g_row, w_row in zip(got.logprobs, want.logprobs):
        assert [lp and lp.logprob for lp in g_row] == pytest.approx([lp and lp.logprob for lp in w_row], abs=1e-4)
    stats = got.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
