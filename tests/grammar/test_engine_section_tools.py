"""Forced tool calls (`tool_choice` required / named) in DeepSeek's, GLM-4.5's and Kimi K2's native syntax, sampled
by the engine from tiny random-weight models through the grammar's bitmask and parsed back by the parsers.

DeepSeek uses its real tokenizer (../shared/data); GLM and Kimi have no vocabulary there, so they share the real
Qwen3 vocabulary with their added tokens (GLM's from its real tokenizer_config.json) as single special tokens."""
from __future__ import annotations

import gzip
import json

import jsonschema
import pytest

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from ember.grammar import GrammarBackend, compile_request
from ember.parsers.pipeline import ParserSetup, parse_all
from tests.conftest import shared_path
from tests.grammar.test_engine import SCHEMAS, TOOLS, run

CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}},
           {"type": "function", "function": {"name": "set_alarm"}}]


def _tokenizer(folder: str, added: tuple[str, ...] = ()):
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(gzip.decompress(shared_path("tokenizers", folder, "tokenizer.json.gz")
                                             .read_bytes()).decode())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    return tok


@pytest.fixture(scope="module")
def deepseek():
    """The real DeepSeek-V3 tokenizer, its EOS and its grammar backend (built once: 128k tokens)."""
    tok = _tokenizer("deepseek-v3")
    eos = [tok.token_to_id("<｜end▁of▁sentence｜>")]
    return tok, eos, GrammarBackend.from_tokenizer(tok, eos_ids=eos)


def _engine(tmp, tok, eos: list[int], backend=None):
    """A 1-layer, 32-wide random Qwen3 over ``tok``'s vocabulary, its grammar backend and engine."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    size = tok.get_vocab_size(with_added_tokens=True)
    cfg = Qwen3Config(vocab_size=size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=2048, eos_token_id=eos[0], bos_token_id=eos[0])
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tok.id_to_token(eos[0])).save_pretrained(tmp)
    backend = backend or GrammarBackend.from_tokenizer(tok, eos_ids=eos)
    engine = Engine.from_pretrained(tmp, bitmask_filler=backend.bitmask_filler(), max_num_seqs=16,
                                    max_num_batched_tokens=2048, device="cpu", dtype="float32")
    return backend, engine


def _forced(tok, backend, engine, eos, cases):
    """cases: (profile, prompt text) -> per request (setup, choice, token ids, finish reason, error)."""
    reqs, meta = [], []
    for profile, prompt in cases:
        setup = ParserSetup.from_tokenizer(tok, profile, drop_ids=eos)       # as the server: EOS never surfaces
        p = tok.encode(prompt, add_special_tokens=False).ids
        initial = setup.initial_state(p)
        for choice in CHOICES:
            plan = compile_request(setup.profile, initial, setup.delimiter_ids, tools=TOOLS, tool_choice=choice,
                                   parallel_tool_calls=False, thinking=False)
            reqs.append((p, SamplingParams(max_tokens=160, temperature=0.0), backend.constraint(plan)))
            meta.append((setup, initial, choice))
    return [(*m, *r) for m, r in zip(meta, run(engine, reqs))]


def _check(tok, results, marker: str):
    for setup, initial, choice, ids, reason, error in results:
        text = tok.decode(ids, skip_special_tokens=False)
        assert reason == "stop" and error is None, (error, text)
        assert marker in text, text
        parsed = parse_all(setup.pipeline(initial=initial, tools=TOOLS), ids)
        assert len(parsed.tool_calls) == 1 and not parsed.malformed, text
        assert parsed.content.strip() == "" and parsed.reasoning == ""
        call = parsed.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == choice["function"]["name"]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if setup.profile.name == "kimi_k2":
            assert call.id.startswith(f"functions.{call.name}:")


def test_deepseek_forced_calls_parse_back(tmp_path, deepseek):
    tok, eos, backend = deepseek
    backend, engine = _engine(tmp_path, tok, eos, backend)
    ask = "<｜User｜>Set an alarm or check the weather.<｜Assistant｜>"
    results = _forced(tok, backend, engine, eos, [("deepseek_v3", ask + "</think>"),
                                                  ("deepseek_r1", ask + "<think>\n\n</think>\n\n")])  # R1: same calls
    assert {r[0].profile.name for r in results} == {"deepseek_v3", "deepseek_r1"}
    _check(tok, results, "<｜tool▁sep｜>")


def test_glm_and_kimi_forced_calls_parse_back(tmp_path):
    from tests.parsers.test_tools_glm45 import glm_tokenizer
    from tests.parsers.test_tools_kimi_k2 import SPECIALS

    tok = glm_tokenizer()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    eos = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>", "<|im_end|>")]
    backend, engine = _engine(tmp_path, tok, eos)
    results = _forced(tok, backend, engine, eos, [
        ("glm45", "<|user|>Set an alarm or check the weather.<|assistant|>\n<think></think>"),
        ("kimi_k2", "<|im_user|>user<|im_middle|>Set an alarm or check the weather.<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")])
    _check(tok, [r for r in results if r[0].profile.name == "glm45"], "<arg_key>")
    _check(tok, [r for r in results if r[0].profile.name == "kimi_k2"], "<|tool_call_argument_begin|>")


def test_deepseek_grammar_takes_both_spellings_and_refuses_other_tools_and_bad_arguments(deepseek):
    tok, eos, backend = deepseek
    setup = ParserSetup.from_tokenizer(tok, "deepseek_v3")
    plan = compile_request(setup.profile, setup.initial_state([]), setup.delimiter_ids, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})

    def accepted(text: str) -> bool:
        c = backend.constraint(plan)
        ids = tok.encode(text, add_special_tokens=False).ids + eos
        return all(c.accept_token(t) for t in ids)

    begin = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    end = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert accepted(begin + 'get_weather<｜tool▁sep｜>{"city": "Oslo", "unit": "celsius"}' + end)
    assert accepted(begin + 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo", "unit": "celsius"}\n```'
                    + end)
    assert not accepted(begin + 'set_alarm<｜tool▁sep｜>{"hour": 1, "label": "x"}' + end)
    assert not accepted(begin + 'get_weather<｜tool▁sep｜>{"city": "Oslo", "unit": "kelvin"}' + end)


def test_glm_grammar_with_text_tags_ends_values_at_the_spelled_closer():
    """A vocabulary without GLM's argument tags (Qwen3's: only `<tool_call>` is a token): the tags are text, a string
    value ends lazily at `</arg_value>`, and the parser reads the same call back."""
    tok = _tokenizer("qwen3")
    eos = [tok.token_to_id("<|endoftext|>")]
    backend = GrammarBackend.from_tokenizer(tok, eos_ids=eos)
    setup = ParserSetup.from_tokenizer(tok, "glm45")
    assert "<arg_value>" not in setup.delimiter_ids and "<tool_call>" in setup.delimiter_ids
    plan = compile_request(setup.profile, setup.initial_state([]), setup.delimiter_ids, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    reply = ("<tool_call>set_alarm\n<arg_key>hour</arg_key>\n<arg_value>7</arg_value>\n<arg_key>label</arg_key>\n"
             "<arg_value>wake up</arg_value>\n</tool_call>")
    ids = tok.encode(reply, add_special_tokens=False).ids
    c = backend.constraint(plan)
    assert all(c.accept_token(t) for t in ids + eos), c.error_message()
    calls = parse_all(setup.pipeline(initial=setup.initial_state([]), tools=TOOLS), ids).tool_calls
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("set_alarm", {"hour": 7, "label": "wake up"})]
    c = backend.constraint(plan)
    bad = tok.encode(reply.replace("7", "seven"), add_special_tokens=False).ids
    assert not all(c.accept_token(t) for t in bad)
