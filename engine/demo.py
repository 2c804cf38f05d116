"""The built-in demo model: a tiny random-weight Qwen3 checkpoint with a real byte-level BPE tokenizer.

`build(path)` writes the same bytes every time (fixed corpus, deterministic BPE training in plain Python, weights from a
seeded generator written with safetensors), so tests and the server's default model are reproducible. The tokenizer has
the Qwen3 family's delimiters as single added tokens and a Qwen3-style chat template.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

VOCAB_SIZE = 1280
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ADDED_TOKENS = SPECIAL_TOKENS + NON_SPECIAL_TOKENS
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "vocab_size": VOCAB_SIZE,
}

_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The structure of the real Qwen3 template (tools in the system prompt, <tool_call> JSON, <think> handling,
# enable_thinking).
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

_CORPUS_ENGLISH = """\
Once upon a time, there was a little robot who lived in a quiet town by the sea. Every morning the robot walked to the
harbour, counted the boats, and wrote the numbers in a small blue notebook. The people of the town liked the robot
because it was kind, patient and always ready to help. When the weather was bad, it carried bread to the old baker and
read stories to the children at the library. One day a storm came from the north. The wind was strong and the waves
were very high. The robot looked at the sky and said, "We should help the fishermen bring their boats home." Together
they worked through the night, and in the morning every boat was safe. The town made a party for the robot, with music,
cake and lights in the streets. The robot was happy, and it wrote one more number in its notebook: the number of friends.
The weather today is sunny with a light breeze. Tomorrow there will be clouds in the afternoon and rain in the evening.
Please remember to bring an umbrella. What is the capital of France? The capital of France is Paris. How many days are
there in a week? There are seven days in a week. Can you explain how a computer works? A computer reads instructions,
stores data in memory, and uses a processor to compute results. The answer is simple: think step by step, check your
work, and then write the final answer clearly. I think the user wants a short summary of the document. Let me read it
again and find the main points. First, the report describes the problem. Second, it proposes a solution. Third, it
measures the results and compares them with the previous year. In conclusion, the new method is faster and cheaper.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. A journey of a thousand miles begins
with a single step. Knowledge is power, and time is money. The model generates one token at a time and streams the text
back to the client. Each request has a prompt, a maximum number of tokens, a temperature and a list of stop sequences.
"""

_CORPUS_CODE = '''\
import json
import os
from dataclasses import dataclass, field


@dataclass
class Request:
    """A user request with its prompt and sampling settings."""

    request_id: str
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    stop: list[str] = field(default_factory=list)


def load_config(path: str) -> dict:
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def fibonacci(n: int) -> int:
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else []
    for i, arg in enumerate(args):
        print(f"{i}: {arg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

function getWeather(city, unit = "celsius") {
  const url = `https://api.example.com/weather?city=${city}&unit=${unit}`;
  return fetch(url).then((response) => response.json());
}

SELECT name, email FROM users WHERE age > 18 ORDER BY name LIMIT 10;
'''

_CORPUS_JSON = """\
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "latest news", "max_results": 5}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
 "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"},
 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"id": 1, "title": "Hello world", "tags": ["demo", "test"], "published": true, "score": 4.5, "author": null}
{"role": "user", "content": "What is the weather like in Berlin today?"}
{"role": "assistant", "content": "The weather in Berlin is cloudy with a temperature of 12 degrees."}
{"temperature": 22, "humidity": 0.65, "wind_speed": 3.4, "condition": "sunny", "forecast": [1, 2, 3, 4, 5]}
{"answer": 42, "reasoning": "Six times seven is forty-two.", "confidence": 0.99, "sources": []}
[{"key": "a", "value": 1}, {"key": "b", "value": 2}, {"key": "c", "value": 3}]
"""

CORPUS = _CORPUS_ENGLISH + _CORPUS_CODE + _CORPUS_JSON


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _train_bpe(corpus: str, num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Deterministic byte-level BPE: the most frequent pair wins, ties broken by the pair's strings."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: ord(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    word_counts = Counter(w for w, _ in _pre_tokenizer().pre_tokenize_str(corpus))
    words = [list(w) for w in sorted(word_counts)]
    counts = [word_counts["".join(w)] for w in words]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += counts[i]
            where[pair].add(i)
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        live = [(c, p) for p, c in pair_counts.items() if c > 0]
        if not live:
            break
        best_count = max(c for c, _ in live)
        best = min(p for c, p in live if c == best_count)
        merges.append(best)
        merged = best[0] + best[1]
        vocab[merged] = len(vocab)
        for i in sorted(where.pop(best, ())):
            w = words[i]
            for pair in zip(w, w[1:]):
                pair_counts[pair] -= counts[i]
            out: list[str] = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == best[0] and w[j + 1] == best[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for pair in zip(out, out[1:]):
                pair_counts[pair] += counts[i]
                where[pair].add(i)
        pair_counts.pop(best, None)
    return vocab, merges


def build_tokenizer() -> Tokenizer:
    """The demo's byte-level BPE tokenizer, with the added tokens after the learned vocabulary."""
    vocab, merges = _train_bpe(CORPUS, VOCAB_SIZE - 256 - len(ADDED_TOKENS))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_TOKENS])
    return tok


def _tokenizer_config(tok: Tokenizer) -> dict:
    decoder = {}
    for t in ADDED_TOKENS:
        decoder[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    c = MODEL_CONFIG
    g = torch.Generator().manual_seed(seed)
    h, d, hq, hkv, inter = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c[
        "intermediate_size"]

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    w = {"model.embed_tokens.weight": rnd(c["vocab_size"], h, std=0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = rnd(hq * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(hkv * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(hkv * d, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, hq * d)
        w[p + "self_attn.q_norm.weight"] = torch.ones(d)
        w[p + "self_attn.k_norm.weight"] = torch.ones(d)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = rnd(c["vocab_size"], h, std=0.5)
    return w


def build(path: str | os.PathLike) -> Path:
    """Write the demo checkpoint into ``path`` (created if needed) and return it."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    config = dict(MODEL_CONFIG, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, indent=2, sort_keys=True) + "\n")
    save_file(_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def default_path() -> Path:
    """``$EMBER_CACHE_DIR/demo`` or ``~/.cache/ember/demo``."""
    base = os.environ.get("EMBER_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "ember") / "demo"


def ensure(path: str | os.PathLike | None = None) -> Path:
    """The demo checkpoint at ``path`` (default `default_path()`), built on first use and reused afterwards."""
    p = Path(path) if path is not None else default_path()
    if not (p / "model.safetensors").exists() or not (p / "tokenizer.json").exists():
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        build(tmp)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not (p / "model.safetensors").exists():
            if p.exists():
                shutil.rmtree(p)
            os.replace(tmp, p)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return p
