"""Structured output with llguidance: one grammar per request (reasoning region, then the answer), enforced per token.

- `compile_request(profile, initial, delimiter_ids, response_format=..., tools=..., tool_choice=...,
  parallel_tool_calls=..., thinking_budget=...)` -> `GrammarPlan | None` (pure; `GrammarError` for a bad request)
- `GrammarBackend.from_pretrained(model_dir, eos_ids=...)` once per model; ``backend.validate(grammar)``,
  ``backend.constraint(plan)`` per request and choice, ``backend.bitmask_filler()`` for the engine.

The compiler is pure Python; the matcher (llguidance's tokenizer and torch bitmasks) is imported on first use of one
of its names, so importing the compiler never loads torch.
"""
from __future__ import annotations

from typing import Any

from .compiler import (JSON_OPTIONS, GrammarError, GrammarPlan, ThinkingBudget, answer_field, build_grammar,
                       check_tools, compile_request)

__all__ = ["GrammarError", "GrammarPlan", "ThinkingBudget", "compile_request", "check_tools", "build_grammar",
           "JSON_OPTIONS", "answer_field",
           "GrammarBackend", "GrammarConstraint", "build_ll_tokenizer", "model_vocab_size"]

_MATCHER_NAMES = frozenset({"GrammarBackend", "GrammarConstraint", "build_ll_tokenizer", "model_vocab_size"})


def __getattr__(name: str) -> Any:
    if name in _MATCHER_NAMES:
        from . import matcher

        return getattr(matcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
