"""Each output reports how long its request waited before a step first scheduled it (vLLM's queue time)."""
from __future__ import annotations

import time

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams


def test_a_request_waiting_for_a_slot_reports_its_queue_time(demo_model_dir):
    engine = Engine.from_pretrained(demo_model_dir, num_kv_blocks=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.add_request([5, 6, 7, 8], params)
    second = engine.add_request([9, 10, 11], params)
    outs: dict[str, list] = {}
    t0 = time.monotonic()
    finished_first = None
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            if o.request_id == first and o.finished:
                finished_first = time.monotonic() - t0
    q1 = {o.queue_seconds for o in outs[first]}
    q2 = {o.queue_seconds for o in outs[second]}
    assert len(q1) == 1 and len(q2) == 1  # one value per request, on every output
    (q1,), (q2,) = q1, q2
    assert q1 is not None and 0 <= q1 < q2  # the second waited for the only slot
    assert q2 >= 0.8 * finished_first  # ... until the first had generated its 6 tokens
