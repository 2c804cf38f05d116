"""The scheduler, driven through a simulated engine loop with fake sampled tokens.

The fake model samples ``token(request_id, length)``, a pure function of the request and the sequence length, so a
request's outputs are fully known in advance: any lost, duplicated or reordered token (e.g. across a preemption)
shows up as a wrong output list.
"""
import zlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ember.engine.kv_cache import KVCacheManager
from ember.engine.params import SamplingParams
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.engine.sequence import Sequence, SequenceStatus


def token(request_id: str, length: int) -> int:
    return zlib.crc32(f"{request_id}:{length}".encode()) % 50_000


def expected_outputs(s: Sequence) -> list[int]:
    return [token(s.request_id, s.num_prompt_tokens + k) for k in range(s.params.max_tokens)]


def make(rid: str, prompt_len: int, max_tokens: int = 8, base: int | None = None, priority: int = 0) -> Sequence:
    start = zlib.crc32(rid.encode()) % 10_000 if base is None else base
    return Sequence(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens,
                                                                              priority=priority))


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every step promises the model runner."""
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.chunks) <= sched.max_num_seqs
    seqs = [c.seq for c in out.chunks]
    assert len(set(map(id, seqs))) == len(seqs)
    for c in out.chunks:
        assert c.seq.status is SequenceStatus.RUNNING
        assert c.start == c.seq.num_computed_tokens and c.num_tokens >= 1
        assert c.samples == (c.start + c.num_tokens - len(c.draft) == c.seq.num_tokens)
        assert not c.draft or c.start == c.seq.num_tokens - 1  # drafts only follow a decoding sequence's last token
        assert len(c.seq.block_ids) * sched.kv.block_size >= c.start + c.num_tokens
    assert all(c.samples for c in out.chunks[:-1]), "only the last chunk may be a partial prefill"
    for p in out.preempted:
        assert p.status is SequenceStatus.WAITING and p.block_ids == [] and p.num_computed_tokens == 0
    sched.check_integrity()


def verified(chunk) -> list[int]:
    """What the fake model keeps of a speculative chunk: its right drafts up to the first wrong one, then its own
    token, cut at max_tokens."""
    seq, kept = chunk.seq, []
    for d in chunk.draft:
        if d != token(seq.request_id, seq.num_tokens + len(kept)):
            break
        kept.append(d)
    kept.append(token(seq.request_id, seq.num_tokens + len(kept)))
    return kept[:seq.params.max_tokens - seq.num_output_tokens]


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run', feed back tokens, finish requests at max_tokens."""
    running_before = set(map(id, sched.running))
    out = sched.schedule()
    check_output(sched, out)
    if out.preempted:  # a step that preempts admits nothing (it would only thrash)
        victims = set(map(id, out.preempted))
        assert all(id(c.seq) in running_before and id(c.seq) not in victims for c in out.chunks)
    sampled = {c.seq.request_id: verified(c) if c.draft else token(c.seq.request_id, c.seq.num_tokens)
               for c in out.chunks if c.samples}
    sched.update(out, sampled)
    for c in out.chunks:
        if c.seq.status is SequenceStatus.RUNNING and c.seq.num_output_tokens >= c.seq.params.max_tokens:
            sched.finish(c.seq, "length")
    sched.check_integrity()
    return out


def run_all(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps, "the scheduler stopped making progress"
    return outs


def new_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=512, chunked=True,
                  prefix=True, policy="fcfs") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked, policy=policy)


def test_every_request_completes_with_its_exact_outputs():
    sched = new_scheduler()
    seqs = [make(f"r{i}", 3 + 5 * i, max_tokens=4 + i) for i in range(10)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "length"
        assert s.output_token_ids == expected_outputs(s)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_small_cache_forces_preemption_and_every_request_still_completes():
    sched = new_scheduler(num_blocks=12, block_size=4, budget=32)
    seqs = [make(f"r{i}", 6 + i, max_tokens=20) for i in range(6)]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched)
    assert sched.num_preemptions > 0
    for s in seqs:
        assert s.output_token_ids == expected_outputs(s)
    # the victim is always the newest running request, and it goes back to the front of the queue
    victims = [p for o in outs for p in o.preempted]
    assert victims and all(v.num_preemptions >= 1 for v in victims)
    assert seqs[0].num_preemptions == 0  # the oldest is never preempted for a newer one


def test_a_preempted_request_is_no_new_prefix_cache_query():
    """Its recompute finds its own freed blocks again: vLLM counts only a request's first lookup, so the hit rate
    of distinct prompts stays 0 however often the cache runs out."""
    sched = new_scheduler(num_blocks=12, block_size=4, budget=32)
    seqs = [make(f"r{i}", 6 + i, max_tokens=20, base=1000 * i) for i in range(6)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    assert sched.num_preemptions > 0
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (sum(s.num_prompt_tokens for s in seqs), 0)


def test_a_request_that_may_not_read_the_prefix_cache_is_no_query():
    """Prompt logprobs (echo with logprobs) compute the whole prompt without a lookup; vLLM counts no query for it,
    so it does not drag the hit rate down as a miss."""
    sched = new_scheduler(num_blocks=32, block_size=4, budget=64)
    first, scored = make("a", 12, max_tokens=2), make("b", 12, max_tokens=2)
    scored.params.prompt_logprobs = 0
    for s in (first, scored):
        sched.add(s)
        run_all(sched)
    assert scored.computes_whole_prompt
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (first.num_prompt_tokens, 0)


@pytest.mark.parametrize("prefix", [False, True])
def test_a_prompt_is_admitted_only_when_all_of_it_fits_so_its_prefill_is_not_thrown_away(prefix):
    # Admitting r2 as soon as its first chunk fits would let r0's growth preempt it mid-prefill, again and again.
    sched = new_scheduler(num_blocks=9, block_size=4, budget=7, prefix=prefix)
    seqs = [make("r0", 15, 17), make("r1", 9, 2), make("r2", 18, 1)]
    for s in seqs:
        sched.add(s)
    while seqs[2].status is SequenceStatus.WAITING:
        free = sched.kv.num_free_blocks
        out = step(sched)
    assert out.chunks[-1].seq is seqs[2] and free >= 5  # its 18 tokens need 5 blocks
    run_all(sched)
    assert sched.num_preemptions == 0
    for s in seqs:
        assert s.output_token_ids == expected_outputs(s)


def test_preemption_picks_the_newest_and_its_recompute_samples_only_at_the_end():
    sched = new_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=4)
    old, new, late = make("old", 8, max_tokens=14), make("new", 8, max_tokens=14), make("late", 12, max_tokens=2)
    sched.add(old)
    sched.add(new)
    step(sched)
    sched.add(late)  # 3 blocks + the watermark do not fit next to the two running ones: it waits
    while not any(o.preempted for o in [step(sched)]):
        assert late.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [new, late]  # the victim goes back to the front of the queue
    assert old.status is SequenceStatus.RUNNING
    produced = new.num_output_tokens
    assert produced >= 1
    while new.status is SequenceStatus.WAITING:
        out = step(sched)
    recompute = next(c for c in out.chunks if c.seq is new)
    assert recompute.start == 0 and recompute.num_tokens == 8 + produced and recompute.samples
    run_all(sched)
    for s in (old, new, late):
        assert s.output_token_ids == expected_outputs(s)


def test_chunked_prefill_splits_a_long_prompt_under_the_budget_and_mixes_with_decodes():
    sched = new_scheduler(num_blocks=64, block_size=4, budget=32)
    short, long = make("short", 4, max_tokens=30), make("long", 100, max_tokens=2)
    sched.add(short)
    sched.add(long)
    first = step(sched)
    assert [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in first.chunks] == [
        ("short", 0, 4, True), ("long", 0, 28, False)]
    second = step(sched)
    assert [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in second.chunks] == [
        ("short", 4, 1, True), ("long", 28, 31, False)]
    assert second.num_batched_tokens == 32
    rest = run_all(sched)
    long_chunks = [(c.start, c.num_tokens) for o in [first, second] + rest for c in o.chunks if c.seq is long]
    assert long_chunks[:4] == [(0, 28), (28, 31), (59, 31), (90, 10)]
    assert long.output_token_ids == expected_outputs(long)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    sched = new_scheduler(budget=32, chunked=False)
    a, b = make("a", 20, max_tokens=3), make("b", 20, max_tokens=3)
    sched.add(a)
    sched.add(b)
    first = step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in first.chunks] == [("a", 20)]
    second = step(sched)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in second.chunks] == [("a", 20, 1), ("b", 0, 20)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(make("huge", 33))
    run_all(sched)


def test_second_request_sharing_a_64_token_prefix_hits_64_tokens_on_shared_blocks():
    sched = new_scheduler(num_blocks=32, block_size=16, budget=256)
    prefix = list(range(500, 564))
    a = Sequence("a", prefix + [1, 2, 3], SamplingParams(max_tokens=4))
    b = Sequence("b", prefix + [9, 8], SamplingParams(max_tokens=4))
    sched.add(a)
    step(sched)  # a's prompt is computed and its 4 full blocks registered
    sched.add(b)
    out = step(sched)
    chunk = next(c for c in out.chunks if c.seq is b)
    assert (chunk.start, chunk.num_tokens) == (64, 2)
    assert b.num_cached_tokens == 64 and sched.kv.prefix_hits == 64
    assert b.block_ids[:4] == a.block_ids[:4]
    assert all(sched.kv.ref_count(blk) == 2 for blk in b.block_ids[:4])
    run_all(sched)
    assert b.output_token_ids == expected_outputs(b)


def test_an_identical_prompt_recomputes_its_last_token():
    sched = new_scheduler(num_blocks=32, block_size=16, budget=256)
    prompt = list(range(64))
    a, b = Sequence("a", prompt, SamplingParams(max_tokens=2)), Sequence("b", prompt, SamplingParams(max_tokens=2))
    sched.add(a)
    step(sched)
    sched.add(b)
    out = step(sched)
    chunk = next(c for c in out.chunks if c.seq is b)
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (48, 16, True)
    assert b.num_cached_tokens == 48


def test_admission_is_fifo_so_a_big_request_is_not_starved_by_a_stream_of_small_ones():
    sched = new_scheduler(num_blocks=24, block_size=4, budget=16, max_num_seqs=4)
    admitted: list[str] = []
    big = make("big", 60, max_tokens=4)
    sched.add(make("s0", 4, max_tokens=6))
    sched.add(big)
    n = 1
    for _ in range(200):
        if n < 40:
            sched.add(make(f"s{n}", 4, max_tokens=6))
            n += 1
        out = step(sched)
        admitted += [c.seq.request_id for c in out.chunks if c.start == 0 and c.seq.num_preemptions == 0]
        if not sched.has_unfinished():
            break
    assert big.status is SequenceStatus.FINISHED and big.output_token_ids == expected_outputs(big)
    arrival = {s: i for i, s in enumerate(["s0", "big"] + [f"s{i}" for i in range(1, 40)])}
    assert admitted == sorted(admitted, key=arrival.get)


def test_abort_frees_every_block_wherever_the_request_is():
    sched = new_scheduler(num_blocks=16, block_size=4, budget=16, max_num_seqs=2)
    start = sched.kv.num_free_blocks
    running, prefilling, waiting = make("run", 5, 20), make("pre", 30, 20), make("wait", 5, 20)
    for s in (running, prefilling, waiting):
        sched.add(s)
    step(sched)
    step(sched)
    assert running.status is SequenceStatus.RUNNING and prefilling.num_computed_tokens < 30
    assert waiting.status is SequenceStatus.WAITING
    for s in (prefilling, running, waiting):
        assert sched.abort(s.request_id) is s
        assert s.finish_reason == "abort" and s.block_ids == []
        sched.check_integrity()
    assert sched.abort("run") is None and sched.get("run") is None
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == start and sched.kv.usage() == 0.0


def test_finish_frees_blocks_and_a_request_aborted_mid_step_is_skipped_by_update():
    sched = new_scheduler(num_blocks=16, block_size=4)
    a, b = make("a", 9), make("b", 9)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("b")
    sched.update(out, {"a": 1})  # b's sample is missing: it was aborted, so nothing is expected of it
    assert a.output_token_ids == [1] and b.output_token_ids == []
    sched.finish(a, "stop")
    assert a.finish_reason == "stop" and sched.num_running == 0
    assert sched.kv.num_free_blocks == 16
    sched.check_integrity()


def test_at_most_max_num_seqs_run_at_once():
    sched = new_scheduler(max_num_seqs=3, budget=200)
    for i in range(7):
        sched.add(make(f"r{i}", 5))
    out = step(sched)
    assert len(out.chunks) == 3 and sched.num_running == 3 and sched.num_waiting == 4
    assert max(len(o.chunks) for o in run_all(sched)) <= 3


def test_requests_that_could_never_run_are_refused_at_add():
    sched = new_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="maximum model length"):
        sched.add(make("long", 65))
    with pytest.raises(ValueError, match="whole cache"):
        sched.add(make("big", 20, max_tokens=13))  # 33 tokens need 9 blocks of 4
    with pytest.raises(ValueError, match="empty"):
        sched.add(Sequence("e", [], SamplingParams()))
    sched.add(make("ok", 20, max_tokens=12))  # exactly the whole cache
    with pytest.raises(ValueError, match="already"):
        sched.add(make("ok", 3))
    run_all(sched)


@pytest.mark.parametrize("chunked,prompt,max_tokens", [(True, 20, 12), (False, 31, 1)])
def test_a_request_as_large_as_the_cache_runs_once_alone(chunked, prompt, max_tokens):
    sched = new_scheduler(num_blocks=8, block_size=4, budget=32 if not chunked else 8, chunked=chunked)
    big, small = make("big", prompt, max_tokens), make("small", 6, max_tokens=12)
    sched.add(small)
    sched.add(big)
    run_all(sched)
    assert big.output_token_ids == expected_outputs(big) and small.output_token_ids == expected_outputs(small)


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / finish sequences keep the KV bookkeeping exact and the step promises."""

    def __init__(self):
        super().__init__()
        self.sched: Scheduler | None = None
        self.n = 0
        self.live: list[Sequence] = []

    @initialize(chunked=st.booleans(), prefix=st.booleans(), budget=st.integers(8, 48),
                policy=st.sampled_from(["fcfs", "priority"]))
    def configure(self, chunked, prefix, budget, policy):
        self.sched = new_scheduler(num_blocks=20, block_size=4, max_num_seqs=4, budget=budget, max_model_len=80,
                                   chunked=chunked, prefix=prefix, policy=policy)

    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 24), shared=st.booleans(),
          priority=st.integers(0, 3))
    def add(self, prompt_len, max_tokens, shared, priority):
        s = make(f"q{self.n}", prompt_len, max_tokens, base=0 if shared else None,
                 priority=priority if self.sched.by_priority else 0)
        self.n += 1
        too_long = not self.sched.enable_chunked_prefill and prompt_len > self.sched.max_num_batched_tokens
        if -(-(prompt_len + max_tokens) // 4) > 20 or too_long:
            with pytest.raises(ValueError):
                self.sched.add(s)
            return
        self.sched.add(s)
        self.live.append(s)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def step(self):
        step(self.sched)
        for s in self.live:
            if s.status is SequenceStatus.FINISHED:
                assert s.output_token_ids == expected_outputs(s)
        self.live = [s for s in self.live if s.status is not SequenceStatus.FINISHED]

    @precondition(lambda self: any(s.status is SequenceStatus.RUNNING for s in self.live))
    @rule(i=st.integers(0, 100), k=st.integers(1, 5), right=st.integers(0, 5))
    def draft(self, i, k, right):
        """Speculative drafts on a running sequence: the first ``right`` are what the fake model samples."""
        running = [s for s in self.live if s.status is SequenceStatus.RUNNING]
        s = running[i % len(running)]
        s.draft = [token(s.request_id, s.num_tokens + j) if j < right else 77_777 for j in range(k)]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        s = self.live.pop(i % len(self.live))
        assert self.sched.abort(s.request_id) is s

    @precondition(lambda self: any(s.status is SequenceStatus.RUNNING for s in self.live))
    @rule(i=st.integers(0, 100))
    def finish_early(self, i):
        running = [s for s in self.live if s.status is SequenceStatus.RUNNING]
        s = running[i % len(running)]
        self.sched.finish(s, "stop")
        self.live.remove(s)
        assert s.output_token_ids == expected_outputs(s)[:s.num_output_tokens]

    @invariant()
    def integrity(self):
        self.sched.check_integrity()
        assert self.sched.num_running + self.sched.num_waiting == len(self.live)

    def teardown(self):
        if self.sched is None:
            return
        run_all(self.sched)
        for s in self.live:
            assert s.output_token_ids == expected_outputs(s)
        assert self.sched.kv.num_free_blocks == self.sched.kv.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_the_priority_policy_admits_lower_values_first():
    sched = new_scheduler(max_num_seqs=1, policy="priority")
    seqs = {p: make(f"p{p}", 5, max_tokens=3, priority=p) for p in (2, 0, 1)}  # added in this order
    for s in seqs.values():
        sched.add(s)
    order = []
    while sched.has_unfinished():
        out = step(sched)
        order += [c.seq.params.priority for c in out.chunks if c.seq.params.priority not in order]
    assert order == [0, 1, 2]
    for s in seqs.values():
        assert s.output_token_ids == expected_outputs(s)


def test_the_priority_policy_preempts_the_lowest_priority_even_when_it_is_older():
    sched = new_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=4, policy="priority")
    low, high = make("low", 8, max_tokens=14, priority=5), make("high", 8, max_tokens=14, priority=0)
    sched.add(low)
    step(sched)
    sched.add(high)
    outs = run_all(sched)
    victims = [p for o in outs for p in o.preempted]
    assert victims and all(v is low for v in victims) and high.num_preemptions == 0
    for s in (low, high):
        assert s.output_token_ids == expected_outputs(s)


def test_first_come_first_served_refuses_a_priority():
    with pytest.raises(ValueError, match="priority scheduling policy"):
        new_scheduler().add(make("p", 4, priority=1))
    with pytest.raises(ValueError, match="fcfs or priority"):
        new_scheduler(policy="lifo")
