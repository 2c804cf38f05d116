"""MiniMax-M2 / M2.1 / M2.5: the reply starts inside a thought (the generation prompt ends with `<think>\\n`) that
`</think>` closes, then XML tool calls, several sharing one block: `<minimax:tool_call>\\n<invoke name="NAME">\\n`,
`<parameter name="KEY">VALUE</parameter>\\n` per parameter, `</invoke>\\n` per call, `</minimax:tool_call>`. Values
are typed by the tool's JSON schema as Qwen3-Coder's, whitespace around them stripped: Qwen3-Coder's syntax reads
them with these terminals. `<minimax:tool_call>`/`</minimax:tool_call>` are single tokens, the XML tags text. The
turn ends with `[e~[`.

``minimax_m2_append_think`` (vLLM's reasoning parser of that name, which MiniMax's deployment guide uses) reads the
same output but keeps the thought in the content: `<think>` (the one the prompt opened), the thought and `</think>`,
then the answer, so a client that sends the content back gives the template the thought it expects in history."""
from __future__ import annotations

import dataclasses

from .qwen3_coder import xml_tool_profile

TERMINALS = {
    "think_open": "<think>",
    "think_close": "</think>",
    "tool_open": "<minimax:tool_call>",
    "tool_close": "</minimax:tool_call>",
    "function_open": '<invoke name="',
    "function_close": "</invoke>",
    "parameter_open": '<parameter name="',
    "parameter_close": "</parameter>",
    "tag_end": '">',
    "eot_end": "[e~[",
}

PROFILE = xml_tool_profile("minimax_m2", TERMINALS, "]~b]ai\n", calls_share_block=True, strip_values=True)

APPEND_THINK = dataclasses.replace(PROFILE, name="minimax_m2_append_think",
                                   reasoning=dataclasses.replace(PROFILE.reasoning, in_content=True))
