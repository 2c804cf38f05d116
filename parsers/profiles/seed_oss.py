"""ByteDance Seed-OSS: `<seed:think>`..`</seed:think>` (opened by the model; its budget reflections stay in the
thought), then Qwen3-Coder's XML tool calls, one per `<seed:tool_call>` block and with no newlines around values:
`<seed:tool_call>\\n<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>\\n</seed:tool_call>`. The
`<seed:...>` delimiters are single tokens, the XML tags text. The turn ends with `<seed:eos>`."""
from __future__ import annotations

from .qwen3_coder import TERMINALS as CODER_TERMINALS
from .qwen3_coder import xml_tool_profile

TERMINALS = {
    **{k: v for k, v in CODER_TERMINALS.items() if not k.startswith("eot_")},
    "think_open": "<seed:think>",
    "think_close": "</seed:think>",
    "tool_open": "<seed:tool_call>",
    "tool_close": "</seed:tool_call>",
    "eot_eos": "<seed:eos>",
}

PROFILE = xml_tool_profile("seed_oss", TERMINALS, "<seed:bos>assistant\n")
