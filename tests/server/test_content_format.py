"""--chat-template-content-format: how a message's text parts reach the chat template, on every chat route."""
from __future__ import annotations

import httpx
import pytest

from ember.server import content_format as cf
from tests.conftest import shared_path

# Prints a string content as is and a list content part by part, so the prompt shows which form arrived.
LOOPING = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
           "{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}")
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
PARTS = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]


@pytest.mark.parametrize(("template", "expected"), [
    (LOOPING, "openai"),
    (PLAIN, "string"),
    ("{% for message in messages %}{% for p in message['content'] | selectattr('type', 'eq', 'text') %}"
     "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{% for c in message.content %}"
     "{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    # a loop over a variable merely set from some content is not a loop over message content (vLLM's mistral)
    ("{% for message in messages %}{% set calls = message.content %}{% for c in calls %}{{ c }}{% endfor %}"
     "{% endfor %}", "string"),
    ("{% for message in messages %}{% for line in message.content.split('\\n') %}{{ line }}{% endfor %}"
     "{% endfor %}", "string"),
    ("{% for t in tools %}{% for p in t.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{% unknown_tag %}{% endfor %}", "string"),
])
def test_detect_reads_loops_over_message_content(template, expected):
    assert cf.detect(template) == expected


def test_resolve_keeps_an_explicit_choice_and_reads_auto_from_the_template():
    assert cf.resolve("string", LOOPING) == "string"
    assert cf.resolve("openai", PLAIN) == "openai"
    assert cf.resolve("auto", LOOPING) == "as_sent"
    assert cf.resolve("auto", PLAIN) == "string"
    assert cf.resolve("auto", {"default": LOOPING, "tool_use": PLAIN}) == "as_sent"
    assert cf.resolve("auto", None) == "string"


def _real_templates():
    root = shared_path("templates")
    return sorted(root.glob("*/*.jinja"))


def test_every_real_template_gets_both_text_parts_and_no_python_repr():
    """For each of the real chat templates, auto renders a two-part user message with both texts and without a
    list's repr (what a template printing `message.content` whole would show if it got parts)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    looping = []
    for path in _real_templates():
        src = path.read_text()
        fmt = cf.resolve("auto", src)
        template = _compile_jinja_template(src)

        def render(messages):
            return template.render(messages=cf.apply(messages, fmt), add_generation_prompt=True, bos_token="<s>",
                                   eos_token="</s>")
        try:
            out = render([{"role": "user", "content": ["ALPHA", "BETA"]}])
        except Exception as e:  # a template needing variables this generic render does not pass
            assert "undefined" in str(e), (path.name, e)
            continue
        assert "ALPHA" in out and "BETA" in out and "'type'" not in out, path.name
        if fmt == "as_sent":
            looping.append(path.name)
            out = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": ["ALPHA", "BETA"]}])
            assert "Be brief." in out and "[{" not in out, path.name  # the system string stays a string
        # system and assistant parts: every text, no repr (Gemma 4 prints a system content whole; Mistral Small 3.2,
        # Devstral, Llama 3.x JSON and others read only a system or assistant content's first part)
        try:
            out = render([{"role": "system", "content": ["SYS1", "SYS2"]}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": ["AS1", "AS2"]}, {"role": "user", "content": "again"}])
        except Exception as e:  # a template refusing a system role (or this order of roles)
            assert fmt == "string", (path.name, e)
            continue
        assert all(t in out for t in ("SYS1", "SYS2", "AS1", "AS2")) and "'type'" not in out, (path.name, out)
    assert "google-gemma-4-31B-it.jinja" in looping and "tool_chat_template_llama4_json.jinja" in looping
    assert "Qwen-Qwen3-0.6B.jinja" not in looping and "tool_chat_template_mistral.jinja" not in looping


def test_apply_forms():
    msgs = [{"role": "user", "content": ["a", "b"]}, {"role": "assistant", "content": []},
            {"role": "tool", "content": ["x", "y"], "tool_call_id": "c"}, {"role": "user", "content": "s"},
            {"role": "system", "content": ["p", "q"]}, {"role": "assistant", "content": ["r", "t"]}]
    assert [m["content"] for m in cf.apply(msgs, "string")] == ["a\nb", "", "x\ny", "s", "p\nq", "r\nt"]
    assert [m["content"] for m in cf.apply(msgs, "openai")] == [
        [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], [], "x\ny", [{"type": "text", "text": "s"}],
        [{"type": "text", "text": "p"}, {"type": "text", "text": "q"}],
        [{"type": "text", "text": "r"}, {"type": "text", "text": "t"}]]
    # as sent: a user's parts stay parts; other roles' content is one string
    assert [m["content"] for m in cf.apply(msgs, "as_sent")] == [
        [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "", "x\ny", "s", "p\nq", "r\nt"]
    assert msgs[0]["content"] == ["a", "b"]  # the input is left as it was


@pytest.fixture
def server_with(rebuilt_server):
    """A live demo server serving ``template`` with ``--chat-template-content-format option``."""
    return lambda template, option: rebuilt_server(template, chat_template_content_format=option)


def _chat_prompt(srv, tok, messages) -> str:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return tok.decode(r.json()["prompt_token_ids"])


def test_text_parts_are_joined_with_newlines_for_a_string_template(server_with, demo_runtime):
    tok = demo_runtime[0].tokenizer
    srv = server_with(PLAIN, "auto")
    assert _chat_prompt(srv, tok, [{"role": "user", "content": PARTS}]) == "<user>one\ntwo"
    r = httpx.post(srv.url + "/tokenize", timeout=60, json={"messages": [{"role": "user", "content": PARTS}]})
    assert tok.decode(r.json()["tokens"]) == "<user>one\ntwo"


def test_a_looping_template_gets_parts_as_parts_and_strings_as_strings(server_with, demo_runtime):
    tok = demo_runtime[0].tokenizer
    srv = server_with(LOOPING, "auto")
    prompt = _chat_prompt(srv, tok, [{"role": "system", "content": "sys"}, {"role": "user", "content": PARTS}])
    assert prompt == "<system>sys<user>[one][two]"
    # a system prompt's parts reach it as one string (templates print a system turn whole, as Gemma 4 does)
    prompt = _chat_prompt(srv, tok, [{"role": "system", "content": PARTS}, {"role": "user", "content": PARTS}])
    assert prompt == "<system>one\ntwo<user>[one][two]"
    # Anthropic blocks and Responses parts take the same path
    r = httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60, json={
        "model": "ember-demo", "system": "sys",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] == len(tok.encode("<system>sys<user>[one][two]", add_special_tokens=False))
    r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
        "model": "ember-demo", "max_output_tokens": 1, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(tok.encode("<user>[one][two]", add_special_tokens=False))


def test_explicit_formats_override_detection(server_with, demo_runtime):
    tok = demo_runtime[0].tokenizer
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": PARTS}]
    assert _chat_prompt(server_with(LOOPING, "string"), tok, messages) == "<system>sys<user>one\ntwo"
    assert _chat_prompt(server_with(LOOPING, "openai"), tok, messages) == "<system>[sys]<user>[one][two]"


def test_the_flag_parses_as_vllm_spells_it():
    from ember.server.cli import _Parser, _serve_parser, serve_config

    parser = _Parser(prog="ember")
    _serve_parser(parser.add_subparsers(dest="command"))
    config = serve_config(parser.parse_args(["serve", "--chat-template-content-format", "openai"]))
    assert config.chat_template_content_format == "openai"
    assert serve_config(parser.parse_args(["serve"])).chat_template_content_format == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--chat-template-content-format", "xml"])
