"""AsyncEngine: concurrent generates stream their own tokens; a closed iterator (client disconnect) frees its blocks;
a failing step ends the requests it carried with "error" and the loop keeps serving."""
from __future__ import annotations

import asyncio
import time

import pytest

from ember.engine.async_engine import AsyncEngine
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams



@pytest.fixture()
def aengine(demo_model_dir):
    ae = AsyncEngine.from_pretrained(demo_model_dir, num_kv_blocks=128)
    yield ae
    ae.shutdown()


async def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def test_concurrent_generates_match_the_sync_engine(aengine, demo_model_dir):
    prompts = [[5 + i, 17, 300 + i, 42] * (i + 1) for i in range(6)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True) for i in range(6)]

    async def one(p, sp):
        toks, last = [], None
        async for out in aengine.generate(p, sp):
            toks.extend(out.new_token_ids)
            last = out
        return toks, last.finish_reason

    async def main():
        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    results = asyncio.run(main())
    ref = Engine.from_pretrained(demo_model_dir, num_kv_blocks=128)
    for p, sp, (toks, reason) in zip(prompts, params, results):
        rid = ref.add_request(p, sp)
        expected = []
        while ref.has_unfinished():
            for o in ref.step():
                if o.request_id == rid:
                    expected.extend(o.new_token_ids)
        assert toks == expected and reason == "length"


def test_closing_an_iterator_early_aborts_and_frees_blocks(aengine):
    total = aengine.engine.kv.num_blocks

    async def main():
        it = aengine.generate(list(range(1, 60)), SamplingParams(max_tokens=500, temperature=1.0, ignore_eos=True))
        n = 0
        async for _ in it:
            n += 1
            if n == 3:
                break
        assert aengine.stats().num_free_blocks < total
        await it.aclose()
        await _wait_for(lambda: aengine.stats().num_free_blocks == total and aengine.stats().num_running == 0)

    asyncio.run(main())


def test_cancelled_consumer_aborts(aengine):
    total = aengine.engine.kv.num_blocks

    async def consume():
        async for _ in aengine.generate([1, 2, 3] * 20, SamplingParams(max_tokens=10_000 // 20, ignore_eos=True)):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await _wait_for(lambda: aengine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: aengine.stats().num_free_blocks == total and aengine.stats().num_running == 0)

    asyncio.run(main())


def test_invalid_request_raises_before_first_output(aengine):
    async def main():
        with pytest.raises(ValueError, match="temperature"):
            async for _ in aengine.generate([1, 2], SamplingParams(temperature=-2)):
                pass

    asyncio.run(main())


def test_abort_from_outside_ends_the_stream(aengine):
    async def main():
        reasons = []
        async for out in aengine.generate([4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True),
                                          request_id="outside"):
            if not reasons:
                aengine.abort("outside")
            reasons.append(out.finish_reason)
        return reasons

    reasons = asyncio.run(main())
    assert reasons[-1] == "abort"


def test_failing_step_errors_the_request_and_loop_survives(aengine, monkeypatch):
    runner = aengine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(out, *carried):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(out, *carried)

    monkeypatch.setattr(runner, "execute", flaky)

    async def run(p):
        outs = []
        async for out in aengine.generate(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)):
            outs.append(out)
        return outs

    async def main():
        first = await run([7, 8, 9])
        second = await run([7, 8, 9])
        return first, second

    first, second = asyncio.run(main())
    assert first[-1].finish_reason == "error" and "boom" in first[-1].error
    assert second[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in second) == 5
    assert aengine.stats().num_free_blocks == aengine.engine.kv.num_blocks


def test_idle_loop_sleeps_without_spinning(aengine):
    time.sleep(0.05)
    before = aengine.engine.num_steps
    clock = time.pthread_getcpuclockid(aengine._thread.ident)  # the loop thread's own CPU time, not the process's
    cpu0 = time.clock_gettime(clock)
    time.sleep(0.5)
    assert time.clock_gettime(clock) - cpu0 < 0.1  # the loop thread waits on its condition
    assert aengine.engine.num_steps == before
    assert aengine.is_running


def test_many_clients_with_random_disconnects_leave_a_clean_cache(aengine):
    import random

    rng = random.Random(0)
    total = aengine.engine.kv.num_blocks

    async def client(i):
        stop_after = rng.choice([None, 1, 2, 5])
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), ignore_eos=True)
        n = 0
        async for out in aengine.generate([rng.randrange(1270) for _ in range(rng.randint(1, 40))], params):
            n += len(out.new_token_ids)
            if stop_after is not None and n >= stop_after:
                break
        return n

    async def main():
        counts = await asyncio.gather(*(client(i) for i in range(24)))
        await _wait_for(lambda: aengine.stats().num_running == 0 and aengine.stats().num_waiting == 0)
        return counts

    counts = asyncio.run(main())
    assert all(c >= 1 for c in counts)
    assert aengine.stats().num_free_blocks == total
    aengine.engine.scheduler.check_integrity()


async def refused_duplicate(engine, rid: str) -> tuple[str, str | None, int]:
    """A request runs under ``rid``; a second one under the same ID is refused. The refusal, then how the first
    request ended and its token count."""
    first = engine.generate([10, 11, 12], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                            request_id=rid)
    out = await first.__anext__()
    tokens = len(out.new_token_ids)
    with pytest.raises(ValueError) as refused:
        async for _ in engine.generate([5, 6], SamplingParams(max_tokens=5), request_id=rid):
            pass
    async for out in first:
        tokens += len(out.new_token_ids)
    return str(refused.value), out.finish_reason, tokens


def test_a_refused_duplicate_request_id_leaves_the_running_request_alone(aengine):
    refusal, reason, tokens = asyncio.run(refused_duplicate(aengine, "dup"))
    assert "already in the engine" in refusal
    assert (reason, tokens) == ("length", 60)


def test_a_lagging_consumer_still_learns_its_request_was_refused(aengine):
    """The engine rejects the request at its second step (no token left allowed) while the consumer's loop is busy:
    the merged final output still says the request's own settings caused it (a 400 for the server, not a 500)."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, allowed_token_ids=[5, 6],
                            bad_words_ids=[[5, 5], [5, 6]], logit_bias={5: 100.0})

    async def main():
        it = aengine.generate([8, 9, 10], params)
        first = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # the task submits the request, then waits for the engine to take it
        deadline = time.monotonic() + 30
        while aengine.engine.stats().num_steps < 2 or aengine.engine.has_unfinished():  # a busy loop: both steps'
            assert time.monotonic() < deadline                                           # outputs queue meanwhile
            time.sleep(0.01)
        time.sleep(0.2)
        return [await first] + [out async for out in it]

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].new_token_ids == [5]
    assert (outs[-1].finish_reason, outs[-1].rejected) == ("error", True)


def test_a_stalled_stream_coalesces_every_output_in_order_without_touching_them():
    """A client that stops reading gets, on its next read, every token and logprob in order with the last status;
    the outputs put (which the engine may still hold) are left as they were."""
    from ember.engine.client import OutputStream
    from ember.engine.params import RequestOutput, TokenLogprob

    async def main():
        stream = OutputStream(asyncio.get_running_loop())
        outs = [RequestOutput("r", [i, i + 100], logprobs=[TokenLogprob(i, -0.5), TokenLogprob(i + 100, -1.5)])
                for i in range(50)]
        outs[-1].finished, outs[-1].finish_reason = True, "length"
        held = [(out.new_token_ids, out.logprobs) for out in outs]
        stream.put(RequestOutput("r", []))  # a prompt-logprobs chunk's step: no tokens, so no step of tokens
        for out in outs:
            stream.put(out)
        return held, await stream.get()

    held, merged = asyncio.run(main())
    assert merged.new_token_ids == [t for i in range(50) for t in (i, i + 100)]
    assert merged.steps == 50  # the steps whose tokens it carries: vLLM's inter-token latency counts one each
    assert [lp.token_id for lp in merged.logprobs] == merged.new_token_ids
    assert (merged.finished, merged.finish_reason) == (True, "length")
    assert all(ids == [i, i + 100] and len(lps) == 2 for i, (ids, lps) in enumerate(held))


def test_nothing_follows_a_finished_output():
    """An abort ends a stream at once on the front end's side; where the engine's own end was already delivered and
    not yet read, the reply keeps that end (a completed reply at a shutdown is not turned into a cut one)."""
    from ember.engine.client import OutputStream
    from ember.engine.params import RequestOutput

    async def main():
        stream = OutputStream(asyncio.get_running_loop())
        stream.put(RequestOutput("r", [5, 6], finished=True, finish_reason="stop"))
        stream.put(RequestOutput("r", [], finished=True, finish_reason="abort"))
        return await stream.get()

    out = asyncio.run(main())
    assert (out.new_token_ids, out.finish_reason) == ([5, 6], "stop")
