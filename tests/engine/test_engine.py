"""Engine behaviour a user notices: prefix caching, seeded sampling, abort, continuous batching, stop rules."""
from __future__ import annotations

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams



def _engine(path, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    return Engine.from_pretrained(path, **kw)


def _drain(engine: Engine) -> dict[str, list]:
    """request_id -> list of outputs, stepping until nothing is left."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1270, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_cache_reuses_blocks_and_keeps_tokens(demo_model_dir):
    prefix = _ids(64, 0)
    a, b = prefix + _ids(5, 1), prefix + _ids(7, 2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = _engine(demo_model_dir, enable_prefix_caching=False)
    rb = cold.add_request(b, greedy)
    expected = _tokens(_drain(cold)[rb])

    eng = _engine(demo_model_dir)
    eng.add_request(a, greedy)
    _drain(eng)
    hits_before = eng.kv.prefix_hits
    rb = eng.add_request(b, greedy)
    outs = _drain(eng)[rb]
    assert eng.kv.prefix_hits - hits_before == 64  # four 16-token blocks
    assert outs[-1].num_cached_tokens == 64
    assert eng.stats().prefix_cache_hits == eng.kv.prefix_hits
    assert _tokens(outs) == expected


def test_seeded_sampling_same_alone_and_in_a_batch(demo_model_dir):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=100, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = _ids(20, 3)
    alone = _engine(demo_model_dir)
    r = alone.add_request(prompt, seeded)
    expected = _tokens(_drain(alone)[r])

    busy = _engine(demo_model_dir)
    for i in range(4):
        busy.add_request(_ids(10 + 3 * i, 10 + i), SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    busy.step()  # the others are already decoding when the seeded one arrives
    r = busy.add_request(prompt, seeded)
    for i in range(4):
        busy.add_request(_ids(8 + i, 20 + i), SamplingParams(max_tokens=12, temperature=0.7, seed=i, ignore_eos=True))
    got, batch_sizes = [], []
    while busy.has_unfinished():
        for o in busy.step():
            if o.request_id == r:
                got.extend(o.new_token_ids)
                batch_sizes.append(busy.last_batch_size)
    assert min(batch_sizes) > 1  # every one of its tokens was sampled next to other requests
    assert got == expected
    assert len(expected) == 16


def test_different_seeds_give_different_samples(demo_model_dir):
    eng = _engine(demo_model_dir)
    ids = [eng.add_request(_ids(12, 4), SamplingParams(max_tokens=16, temperature=1.5, seed=s, ignore_eos=True))
           for s in range(3)]
    outs = _drain(eng)
    assert len({tuple(_tokens(outs[r])) for r in ids}) == 3


def test_the_engine_seed_repeats_unseeded_sampling_from_run_to_run(demo_model_dir):
    def sample(seed: int) -> list[int]:
        eng = Engine.from_pretrained(demo_model_dir, max_num_seqs=4, max_model_len=256, num_kv_blocks=32, seed=seed)
        rid = eng.add_request(_ids(12, 4), SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True))
        return _tokens(_drain(eng)[rid])

    first = sample(7)
    torch.rand(5)  # what happened to torch's generator before start does not matter
    assert sample(7) == first and sample(8) != first


def test_abort_frees_all_blocks(demo_model_dir):
    eng = _engine(demo_model_dir)
    start = eng.kv.num_free_blocks
    keep = eng.add_request(_ids(40, 5), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    gone = eng.add_request(_ids(50, 6), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.kv.num_free_blocks < start
    held_by_keep = len(eng.scheduler.get(keep).block_ids)
    assert eng.abort(gone)
    assert eng.kv.num_free_blocks == start - held_by_keep
    final = [o for o in eng.step() if o.request_id == gone]
    assert final and final[0].finished and final[0].finish_reason == "abort"
    assert eng.abort(keep)
    assert eng.kv.num_free_blocks == start
    eng.scheduler.check_integrity()
    assert not eng.abort("no-such-request")


def test_eight_in_flight_run_in_one_forward_and_newcomers_start_at_once(demo_model_dir):
    eng = _engine(demo_model_dir)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(_ids(6 + i, 30 + i), params) for i in range(8)]
    first = eng.step()  # all eight prefills fit one step's budget
    assert {o.request_id for o in first} == set(rids)
    outs = eng.step()
    assert eng.last_batch_size == 8
    assert sorted(o.request_id for o in outs) == sorted(rids)
    assert all(len(o.new_token_ids) == 1 for o in outs)

    late = eng.add_request(_ids(9, 50), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = eng.step()
    assert eng.last_batch_size == 9  # the newcomer's prefill rides with the eight decodes
    got = {o.request_id: o for o in outs}
    assert len(got[late].new_token_ids) == 1
    done = _drain(eng)
    assert done[late][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in done[late]) == 2


def test_logit_bias_and_stop_token(demo_model_dir):
    eng = _engine(demo_model_dir)
    r = eng.add_request(_ids(10, 7), SamplingParams(max_tokens=5, temperature=0.0, logit_bias={321: 100.0}))
    assert _tokens(_drain(eng)[r]) == [321] * 5
    r = eng.add_request(_ids(10, 7), SamplingParams(max_tokens=5, temperature=0.0, logit_bias={321: 100.0},
                                                     stop_token_ids=[321]))
    outs = _drain(eng)[r]
    assert _tokens(outs) == [321]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == 321


def test_eos_stops_but_not_before_min_tokens(demo_model_dir):
    eng = _engine(demo_model_dir)
    eos = eng.tokenizer.eos_token_id
    assert eos in eng.eos_token_ids
    params = SamplingParams(max_tokens=20, min_tokens=4, temperature=0.0, logit_bias={eos: 100.0})
    r = eng.add_request(_ids(10, 8), params)
    outs = _drain(eng)[r]
    toks = _tokens(outs)
    assert len(toks) == 5 and eos not in toks[:4] and toks[-1] == eos
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == eos
    r = eng.add_request(_ids(10, 8), SamplingParams(max_tokens=6, temperature=0.0, logit_bias={eos: 100.0},
                                                     ignore_eos=True))
    outs = _drain(eng)[r]
    assert _tokens(outs) == [eos] * 6 and outs[-1].finish_reason == "length"


def test_max_model_len_ends_with_length(demo_model_dir):
    eng = _engine(demo_model_dir, max_model_len=32)
    r = eng.add_request(_ids(30, 9), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    outs = _drain(eng)[r]
    assert len(_tokens(outs)) == 2 and outs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="maximum model length"):
        eng.add_request(_ids(32, 9), SamplingParams())


def test_max_model_len_auto_is_cut_to_what_the_kv_cache_holds(demo_model_dir, caplog):
    """vLLM's ``--max-model-len auto`` (-1): the model's length cut to the KV cache's tokens (logged), so the longest
    sequence the cache holds is served; without it the model's full length stays, as before."""
    from ember.engine.launch import model_info_of

    caplog.set_level("INFO", logger="ember")
    full = _engine(demo_model_dir, num_kv_blocks=8).max_model_len
    assert full > 8 * 16
    eng = _engine(demo_model_dir, max_model_len=-1, num_kv_blocks=None,
                  kv_cache_memory=8 * _engine_block_bytes(demo_model_dir))
    assert eng.max_model_len == model_info_of(eng).max_model_len == 8 * 16
    assert f"max_model_len auto: reduced from {full} to 128" in caplog.text
    r = eng.add_request(_ids(120, 3), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    outs = _drain(eng)[r]
    assert len(_tokens(outs)) == 8 and outs[-1].finish_reason == "length"
    assert _engine(demo_model_dir, max_model_len=-1, num_kv_blocks=full).max_model_len == full


def _engine_block_bytes(path) -> int:
    from ember.engine.model_runner import kv_bytes_per_block

    eng = _engine(path, num_kv_blocks=1)
    return kv_bytes_per_block(eng.runner.cfg, eng.config.block_size, eng.kv_cache_dtype)


def test_logprobs_are_normalised_and_sorted(demo_model_dir):
    eng = _engine(demo_model_dir)
    r = eng.add_request(_ids(10, 10), SamplingParams(max_tokens=4, temperature=0.0, logprobs=5))
    outs = _drain(eng)[r]
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == len(_tokens(outs))
    for tok, lp in zip(_tokens(outs), lps):
        assert lp.token_id == tok and len(lp.top) == 5
        assert lp.top[0] == (tok, pytest.approx(lp.logprob))  # greedy picks the most likely
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and all(v <= 0 for v in vals)
        assert sum(torch.tensor(vals).exp().tolist()) <= 1.0 + 1e-5


def test_top_k_one_is_greedy_and_repetition_penalty_avoids_repeats(demo_model_dir):
    eng = _engine(demo_model_dir)
    prompt = _ids(12, 11)
    g = eng.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    k = eng.add_request(prompt, SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True))
    rp = eng.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1e6,
                                                ignore_eos=True))
    outs = _drain(eng)
    assert _tokens(outs[g]) == _tokens(outs[k])
    penalised = _tokens(outs[rp])
    assert len(set(penalised)) == len(penalised) and not set(penalised) & set(prompt)


def test_invalid_requests_name_the_field(demo_model_dir):
    eng = _engine(demo_model_dir)
    for params, field in [(SamplingParams(temperature=-1), "temperature"), (SamplingParams(top_p=0), "top_p"),
                          (SamplingParams(max_tokens=0), "max_tokens"), (SamplingParams(logprobs=50), "logprobs"),
                          (SamplingParams(logit_bias={5: float("inf")}), "logit_bias"),
                          (SamplingParams(logit_bias={5: float("nan")}), "logit_bias")]:
        with pytest.raises(ValueError, match=field):
            eng.add_request([1, 2, 3], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 99999], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    rid = eng.add_request([1, 2], SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError, match="already"):
        eng.add_request([1, 2], SamplingParams(), request_id=rid)


def test_stats_report_cache_state(demo_model_dir):
    eng = _engine(demo_model_dir, num_kv_blocks=64)
    s = eng.stats()
    assert (s.num_total_blocks, s.num_free_blocks, s.kv_usage, s.num_running) == (64, 64, 0.0, 0)
    eng.add_request(_ids(40, 12), SamplingParams(max_tokens=5, temperature=0.0))
    eng.add_request(_ids(40, 13), SamplingParams(max_tokens=5, temperature=0.0))
    eng.step()
    s = eng.stats()
    assert s.num_running == 2 and s.num_free_blocks == 64 - 6 and s.kv_usage == pytest.approx(6 / 64)
    assert s.last_batch_size == 2


def test_allowed_token_ids_confine_every_sampled_token(demo_model_dir):
    eng = _engine(demo_model_dir)
    allowed = [17, 400, 901]
    greedy = eng.add_request(_ids(12, 30), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                          allowed_token_ids=allowed))
    sampled = eng.add_request(_ids(12, 31), SamplingParams(max_tokens=8, temperature=1.5, seed=1, ignore_eos=True,
                                                           allowed_token_ids=allowed))
    free = eng.add_request(_ids(12, 30), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    done = _drain(eng)
    assert set(_tokens(done[greedy])) <= set(allowed) and set(_tokens(done[sampled])) <= set(allowed)
    assert not set(_tokens(done[free])) <= set(allowed)  # the row beside them is untouched
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request(_ids(4, 1), SamplingParams(allowed_token_ids=[10**7]))
    with pytest.raises(ValueError, match="must not be empty"):
        eng.add_request(_ids(4, 1), SamplingParams(allowed_token_ids=[]))


def test_bad_words_ban_the_token_that_would_complete_them(demo_model_dir):
    eng = _engine(demo_model_dir)
    prompt = _ids(12, 32)
    r = eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    free = _tokens(_drain(eng)[r])
    # ban a one-token word the free run produced, and the pair (free[2], free[3]) as a two-token word
    pair = [free[2], free[3]]
    r = eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                               bad_words_ids=[[free[0]]]))
    assert free[0] not in _tokens(_drain(eng)[r])
    r = eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                               bad_words_ids=[pair]))
    got = _tokens(_drain(eng)[r])
    assert got[:3] == free[:3] and got[3] != free[3]  # the first token of the word alone stays allowed
    assert all(got[i:i + 2] != pair for i in range(len(got) - 1))


@pytest.mark.parametrize("settings,sampled", [
    (dict(bad_words_ids=[[5], [6, 6]]), [6]),  # 5 always banned, 6 after a 6
    (dict(bad_words_ids=[[5], [6, 6]], temperature=1.0, seed=3), [6]),
    (dict(allowed_token_ids=[5], min_tokens=2, stop_token_ids=[5]), []),  # the one token is a stop before min_tokens
], ids=["bad-words-greedy", "bad-words-seeded", "min-tokens"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-order", "async"])
def test_a_request_whose_settings_leave_no_token_ends_with_a_client_error(demo_model_dir, settings, sampled,
                                                                           async_scheduling):
    """Where allowed_token_ids, bad words and min_tokens together ban every token, the request ends with "error",
    marked as its own settings' fault (the server answers 400), after the tokens it could sample: it never emits a
    token it banned. The request beside it is untouched."""
    eng = _engine(demo_model_dir, async_scheduling=async_scheduling)
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True, allowed_token_ids=[5, 6])
    stuck = eng.add_request(_ids(9, 40), SamplingParams(**{**kw, **settings}))
    free = eng.add_request(_ids(12, 41), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    done = _drain(eng)
    end = done[stuck][-1]
    assert _tokens(done[stuck]) == sampled
    assert end.finish_reason == "error" and end.rejected and "allowed_token_ids, bad_words and min_tokens" in end.error
    alone = eng.add_request(_ids(12, 41), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert _tokens(done[free]) == _tokens(_drain(eng)[alone]) and not done[free][-1].rejected


def test_cache_salt_shares_prefix_blocks_only_within_a_salt(demo_model_dir):
    eng = _engine(demo_model_dir)
    prompt = _ids(64, 33)
    greedy = dict(max_tokens=2, temperature=0.0, ignore_eos=True)

    def cached(**kw) -> int:
        r = eng.add_request(prompt, SamplingParams(**greedy, **kw))
        return _drain(eng)[r][-1].num_cached_tokens

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") == 48  # the last prompt block is recomputed to produce logits
    assert cached(cache_salt="bob") == 0
    assert cached() == 0  # the unsalted root differs from every salt
    assert cached() == 48
