"""DeepSeek-R1 (R1-0528 and the Distill models; V3.1 in thinking mode): the reply starts inside the thought (the
template opens it, or the model writes `<think>` first), `</think>` ends it; tool calls in DeepSeek's own syntax.

Every R1 template in use renders earlier calls as `<｜tool▁calls▁begin｜>...` (the tool-calling ones, vLLM's and
llama.cpp's, also list the tools), so R1 replies are parsed with DeepSeek-V3's tool syntax (`deepseek_v3`), the same
as vLLM's R1-0528 command line (`--reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3`). In the DeepSeek-V3
vocabulary `<think>` / `</think>` are not single tokens, so they are matched as text there; the tool markers are
single tokens there."""
from __future__ import annotations

import dataclasses

from . import deepseek_v3
from .base import ReasoningSpec

PROFILE = dataclasses.replace(
    deepseek_v3.PROFILE,
    name="deepseek_r1",
    reasoning=ReasoningSpec(open="<think>", close="</think>", start_mode="always"),
)
