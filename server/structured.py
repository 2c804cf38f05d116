"""Structured output for the server: request fields -> `ember.grammar` plan -> one engine Constraint per choice.

Grammar problems are the request's fault: they become 400s naming the field (`GrammarError`'s message does).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ember.grammar import GrammarBackend, GrammarError, compile_request
from ember.parsers.initial import InitialState

from .errors import bad_request


def _param(message: str) -> str | None:
    head = message.split(":", 1)[0].split(" ", 1)[0]
    for root in ("response_format", "tools", "tool_choice", "thinking", "max_thinking_tokens"):
        if head.startswith(root):
            return head.rstrip(".,")
    return None


class Structured:
    """The grammar backend of one served model."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_tokenizer: Any | None = None) -> "Structured":
        return cls(GrammarBackend.from_pretrained(model_dir, hf_tokenizer=hf_tokenizer))

    def bitmask_filler(self):
        return self.backend.bitmask_filler()

    def constraints(self, n: int, *, profile: Any, delimiter_ids: Mapping[str, int], initial: InitialState,
                    response_format: Mapping | None, tools: Sequence[Mapping] | None, tool_choice: Any,
                    parallel_tool_calls: bool, thinking_budget: int | None, thinking: bool = True) -> list[Any]:
        """`n` fresh constraints (Nones when nothing constrains the tokens)."""
        try:
            plan = compile_request(profile, initial, delimiter_ids, response_format=response_format, tools=tools,
                                   tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                   thinking_budget=thinking_budget, thinking=thinking)
            if plan is None:
                return [None] * n
            return [self.backend.constraint(plan) for _ in range(n)]
        except GrammarError as e:
            raise bad_request(e.message, param=_param(e.message)) from None
        except (ValueError, TypeError, KeyError, RecursionError) as e:  # odd schemas the compiler did not foresee
            raise bad_request(f"structured output could not be set up for this request: {e}",
                              param="response_format" if response_format else "tools") from None
