"""Structured output for the server: request fields -> `ember.grammar` plan -> one engine Constraint per choice.

Grammar problems are the request's fault: they become 400s naming the field (`GrammarError`'s message does).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from ember.engine.eos import end_of_turn_ids
from ember.grammar import GrammarBackend, GrammarError, GrammarPlan, answer_field, compile_request, model_vocab_size
from ember.parsers.initial import InitialState

from .errors import ApiError, bad_request

log = logging.getLogger("ember.server")


def _param(message: str) -> str | None:
    head = message.split(":", 1)[0].split(" ", 1)[0]
    for root in ("response_format", "structured_outputs", "guided_", "tools", "tool_choice", "thinking",
                 "max_thinking_tokens", "text.format", "output_config"):
        if head.startswith(root):
            return head.rstrip(".,")
    return None


def grammar_error(e: GrammarError) -> ApiError:
    """The 400 for a request the grammar compiler refused, naming the field its message begins with."""
    return bad_request(e.message, param=_param(e.message))


_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.(name|parameters)")


def flat_tool_fields(err: ApiError, schema_field: str) -> ApiError:
    """``err`` naming the tool fields of an API whose tools are flat (``tools[0].name``, ``tools[0].<schema_field>``:
    Responses, Anthropic Messages) where the grammar compiler named chat's nested ones (``tools[0].function.name``)."""
    def rename(m: re.Match) -> str:
        return f"tools[{m.group(1)}].{'name' if m.group(2) == 'name' else schema_field}"

    return ApiError(err.status, _CHAT_TOOL_FIELD.sub(rename, err.message),
                    param=_CHAT_TOOL_FIELD.sub(rename, err.param) if err.param else None, code=err.code)


class Structured:
    """The grammar backend of one served model: the front end validates a request's grammar with it (a 400 before
    streaming starts) and hands the engine the plain `GrammarPlan`; the engine side `build`s each request's
    Constraint from that plan and fills the batch's bitmasks."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_tokenizer: Any | None = None) -> "Structured":
        """The backend of a checkpoint folder; its EOS set is the engine's (`end_of_turn_ids`)."""
        if hf_tokenizer is None:
            from ember.engine.checkpoint import load_tokenizer

            hf_tokenizer = load_tokenizer(model_dir)
        return cls(GrammarBackend.from_tokenizer(hf_tokenizer, vocab_size=model_vocab_size(model_dir),
                                                 eos_ids=end_of_turn_ids(hf_tokenizer, model_dir)))

    def bitmask_filler(self):
        return self.backend.bitmask_filler()

    def build(self, spec: GrammarPlan) -> Any:
        """The engine's Constraint for one request/choice (the `ConstraintBackend` side)."""
        return self.backend.constraint(spec)

    def constraints(self, n: int, *, profile: Any, delimiter_ids: Mapping[str, int], initial: InitialState,
                    response_format: Mapping | None, tools: Sequence[Mapping] | None, tool_choice: Any,
                    parallel_tool_calls: bool, thinking_budget: int | None, thinking: bool = True) -> list[Any]:
        """`n` validated constraint specs (plain `GrammarPlan`s; Nones when nothing constrains the tokens)."""
        try:
            plan = compile_request(profile, initial, delimiter_ids, response_format=response_format, tools=tools,
                                   tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                   thinking_budget=thinking_budget, thinking=thinking)
            if plan is None:
                return [None] * n
            self.backend.constraint(plan)  # compiles (cached) and checks it: a bad grammar is a 400 here
            return [plan] * n
        except GrammarError as e:
            raise grammar_error(e) from None
        except (ValueError, TypeError, KeyError, RecursionError) as e:  # odd schemas the compiler did not foresee
            raise bad_request(f"structured output could not be set up for this request: {e}",
                              param=answer_field(response_format) if response_format else "tools") from None


def engine_constraints(model_dir: str, tokenizer_dir: str | None = None) -> Structured | None:
    """The engine process's `ConstraintBackend` (a top-level function, so it crosses to the spawned process by
    name), over the tokenizer of ``tokenizer_dir`` (default: the model's); None when llguidance cannot read this
    tokenizer (the front end then refuses structured output)."""
    try:
        from ember.engine.checkpoint import load_tokenizer

        return Structured.from_pretrained(model_dir, load_tokenizer(tokenizer_dir or model_dir))
    except Exception as e:
        log.info("structured output disabled in the engine: %s", e)  # the front end warns where it matters
        return None
