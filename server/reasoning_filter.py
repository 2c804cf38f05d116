"""vLLM's ``include_reasoning: false`` on a chat completion: the thought is still parsed (it never becomes content)
but left out of the reply, the same way in a stream and in its fold; its tokens stay in ``token_ids`` and in usage's
``reasoning_tokens``, without logprob entries."""
from __future__ import annotations

import dataclasses

from ember.parsers.events import ReasoningDelta

from .choice import ChoiceStep


def without_reasoning(step: ChoiceStep) -> ChoiceStep:
    """``step`` without its reasoning text; its reasoning tokens are kept as never surfaced (``dropped``)."""
    if not any(t.channel == "reasoning" for t in step.tokens) and not any(
            isinstance(e, ReasoningDelta) for e in step.events):
        return step
    tokens = [dataclasses.replace(t, channel="dropped") if t.channel == "reasoning" else t for t in step.tokens]
    kept = [(i, e) for i, e in enumerate(step.events) if not isinstance(e, ReasoningDelta)]
    finish_at = step.finish_at
    if finish_at is not None:
        finish_at = sum(1 for i, _ in kept if i < finish_at)
    return dataclasses.replace(step, tokens=tokens, events=[e for _, e in kept], finish_at=finish_at)
