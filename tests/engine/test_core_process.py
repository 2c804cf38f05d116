"""The engine process's command loop: a request aborted while its grammar still compiles ends with "abort" (its
stream would otherwise wait forever, e.g. through a graceful shutdown)."""
from __future__ import annotations

import threading

import torch

from ember.engine import wire
from ember.engine.core_process import _Core
from ember.engine.params import SamplingParams


class _SlowGrammars:
    """A constraint backend whose compile takes until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def build(self, spec):
        self.release.wait(10)
        return None

    def bitmask_filler(self):
        return None


class _Events:
    def __init__(self) -> None:
        self.sent: list[list] = []

    def send(self, data: bytes) -> None:
        self.sent.append(wire.unpack(data))


def test_a_request_aborted_while_its_grammar_compiles_ends_with_abort(demo_model_dir):
    threads, grammars, events = torch.get_num_threads(), _SlowGrammars(), _Events()
    try:
        core = _Core(str(demo_model_dir), {"device": "cpu", "kv_cache_blocks": 32, "max_model_len": 128},
                     lambda model_dir, tokenizer: grammars, events)
    finally:
        torch.set_num_threads(threads)
    try:
        params = wire.encode_params(SamplingParams(max_tokens=4, temperature=0.0))
        core._apply(["add", "r1", [5, 6, 7], params, "a grammar"])
        core._apply(["abort", ["r1"]])
        ends = [wire.decode_output(o) for kind, *rest in events.sent if kind == "step" for o in rest[0]]
        assert [(o.request_id, o.finished, o.finish_reason) for o in ends] == [("r1", True, "abort")]
        grammars.release.set()
        core._adopt_built()
        assert not core.building and not core.engine.has_unfinished()  # the compiled grammar is not adopted
    finally:
        grammars.release.set()
        core.close()
