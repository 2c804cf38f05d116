"""ByteDance Seed-OSS: `<seed:think>`..`</seed:think>` (opened by the model; its budget reflections stay in the
thought), then Qwen3-Coder's XML tool calls, one per `<seed:tool_call>` block and with no newlines around values:
`<seed:tool_call>\\n<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>\\n</seed:tool_call>`. The
`<seed:...>` delimiters are single tokens, the XML tags text. The turn ends with `<seed:eos>`."""
from __future__ import annotations

from .base import Profile, ReasoningSpec, end_of_turn_rules, reasoning_rules
from .qwen3_coder import TERMINALS as CODER_TERMINALS
from .qwen3_coder import XML_TOOL_RULES

TERMINALS = {
    **{k: v for k, v in CODER_TERMINALS.items() if not k.startswith("eot_")},
    "think_open": "<seed:think>",
    "think_close": "</seed:think>",
    "tool_open": "<seed:tool_call>",
    "tool_close": "</seed:tool_call>",
    "eot_eos": "<seed:eos>",
}
EOT = ("eot_eos",)

PROFILE = Profile(
    name="seed_oss",
    reasoning=ReasoningSpec(open="<seed:think>", close="</seed:think>", start_mode="prompt_tail"),
    tool_format="qwen3_coder",
    terminals=TERMINALS,
    token_id_terminals=frozenset({"think_open", "think_close", "tool_open", "tool_close", *EOT}),
    generation_headers=("<seed:bos>assistant\n",),
    end_of_turn=("<seed:eos>",),
    transitions={**reasoning_rules(tool_open_ends_reasoning=True), **XML_TOOL_RULES, **end_of_turn_rules(EOT)},
)
