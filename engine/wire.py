"""The engine-process wire format: msgpack of plain lists, one message per engine step.

Front end -> engine (commands): ``["add", rid, prompt_ids, params, constraint]``, ``["abort", [rid, ...]]``,
``["shutdown"]``. ``params`` is `SamplingParams`' field values in order; ``constraint`` is None or the server's
plain-data constraint spec (a frozen dataclass, carried as a pickled msgpack extension).

Engine -> front end (events): ``["ready", model_info_fields]``, ``["fatal", message]``,
``["step", [output, ...], stats_fields]`` (every request's new tokens of one step, and the engine counters after
it), ``["reject", rid, message]`` (an add the engine refused: the request's ValueError). An output is
`RequestOutput`'s field values in order, logprobs and prompt logprobs as ``[token_id, logprob, [[id, logprob],
...], rank]``; other fields are carried generically, so a plain field added to `RequestOutput` or `EngineStats` crosses
without changes here.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import msgpack

from ember.engine.params import RequestOutput, SamplingParams, TokenLogprob

_PICKLED = 1
_OUT_FIELDS = [f.name for f in dataclasses.fields(RequestOutput)]
_LP_INDICES = (_OUT_FIELDS.index("logprobs"), _OUT_FIELDS.index("prompt_logprobs"))
_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def _default(obj: Any) -> Any:
    return msgpack.ExtType(_PICKLED, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _PICKLED:
        return pickle.loads(data)
    return msgpack.ExtType(code, data)


def pack(msg: list) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode_params(p: SamplingParams) -> list:
    values = [getattr(p, n) for n in _PARAM_FIELDS]
    i = _PARAM_FIELDS.index("logit_bias")
    if values[i] is not None:
        values[i] = [[int(k), float(v)] for k, v in values[i].items()]
    return values


def decode_params(values: list) -> SamplingParams:
    kw = dict(zip(_PARAM_FIELDS, values))
    if kw.get("logit_bias") is not None:
        kw["logit_bias"] = {int(k): float(v) for k, v in kw["logit_bias"]}
    return SamplingParams(**kw)


def encode_output(out: RequestOutput) -> list:
    values = [getattr(out, n) for n in _OUT_FIELDS]
    for i in _LP_INDICES:
        if values[i] is not None:
            values[i] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top], lp.rank] for lp in values[i]]
    return values


def decode_output(values: list) -> RequestOutput:
    for i in _LP_INDICES:
        if values[i] is not None:
            values[i] = [TokenLogprob(t, lp, [(a, b) for a, b in top], rank) for t, lp, top, rank in values[i]]
    return RequestOutput(*values)


def encode_fields(obj: Any) -> list:
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


def decode_fields(cls: type, values: list) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**dict(zip(names, values)))
