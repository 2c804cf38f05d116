"""Structured output with llguidance: one grammar per request (reasoning region, then the answer), enforced per token.

- `compile_request(profile, initial, delimiter_ids, response_format=..., tools=..., tool_choice=...,
  parallel_tool_calls=..., thinking_budget=...)` -> `GrammarPlan | None` (pure; `GrammarError` for a bad request)
- `GrammarBackend.from_pretrained(model_dir)` once per model; ``backend.validate(grammar)``,
  ``backend.constraint(plan)`` per request and choice, ``backend.bitmask_filler()`` for the engine.
"""
from .compiler import JSON_OPTIONS, GrammarError, GrammarPlan, ThinkingBudget, build_grammar, compile_request
from .matcher import GrammarBackend, GrammarConstraint, build_ll_tokenizer, model_eos_ids, model_vocab_size

__all__ = ["GrammarError", "GrammarPlan", "ThinkingBudget", "compile_request", "build_grammar", "JSON_OPTIONS",
           "GrammarBackend", "GrammarConstraint", "build_ll_tokenizer", "model_eos_ids", "model_vocab_size"]
