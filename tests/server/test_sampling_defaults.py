"""The model's recommended sampling settings (generation_config.json) fill what a request leaves unset, on every
endpoint, as vLLM's `--generation-config auto` does; a request's own value wins, and `--generation-config vllm`
ignores them. The served model here recommends `top_k: 1`, so an unset `top_k` makes sampling greedy."""
from __future__ import annotations

import json
import shutil

import pytest

from ember.server.sampling_defaults import SamplingDefaults
from tests.server.conftest import LiveServer, _serve, served

HI = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def recommending_server(tmp_path_factory, demo_model_dir):
    from ember.server.config import ServeConfig

    model = tmp_path_factory.mktemp("demo-topk1") / "demo"
    shutil.copytree(demo_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1, "temperature": 0.7,
                                                              "top_p": "high"}))  # a bad value is skipped
    config = ServeConfig(model_dir=model, served_model_name="demo-topk1", max_num_seqs=8, kv_cache_blocks=128,
                         in_process=True)
    with served(config) as server:
        yield server


def _chat(server, **kw) -> str:
    r = server.openai().chat.completions.create(model=server.model, messages=HI, max_tokens=12,
                                               extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)
    return r.choices[0].model_extra["token_ids"]


def test_unset_settings_take_the_models_recommendation(recommending_server):
    server = recommending_server
    assert server.runtime.sampling_defaults == SamplingDefaults(temperature=0.7, top_k=1)
    greedy = _chat(server, temperature=0)
    assert all(_chat(server, seed=s) == greedy for s in range(4))  # top_k 1 from generation_config.json
    assert any(_chat(server, seed=s, extra={"top_k": 0}) != greedy for s in range(4))  # the request's own wins
    completions = server.openai().completions.create(model=server.model, prompt="Once", max_tokens=8, seed=3,
                                                     extra_body={"return_token_ids": True})
    plain = server.openai().completions.create(model=server.model, prompt="Once", max_tokens=8, temperature=0,
                                               extra_body={"return_token_ids": True})
    assert completions.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    r = server.openai().responses.create(model=server.model, input="Hi", max_output_tokens=2)
    assert r.temperature == 0.7  # the setting in effect is echoed


def test_generation_config_vllm_ignores_the_recommendation(recommending_server):
    import dataclasses

    server = recommending_server
    neutral = dataclasses.replace(server.runtime, sampling_defaults=SamplingDefaults.load("vllm", "unused"))
    srv, app = _serve(neutral, dataclasses.replace(server.app.state.ember.config, generation_config="vllm"))
    try:
        plain = LiveServer(srv.url, neutral, server.model, server.tokenizer, app)
        greedy = _chat(plain, temperature=0)
        assert any(_chat(plain, seed=s) != greedy for s in range(4))
    finally:
        srv.stop()


def test_the_flag_takes_auto_vllm_or_a_folder_with_the_file(tmp_path):
    from ember.engine.args import SettingValueError
    from ember.server.config import parse_generation_config

    assert parse_generation_config("auto") == "auto" and parse_generation_config("vllm") == "vllm"
    with pytest.raises(SettingValueError, match="generation_config.json"):
        parse_generation_config(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                 "max_new_tokens": 100}))
    # a folder's max_new_tokens is also a cap (vLLM's rule); the model's own (auto) is only a default
    assert SamplingDefaults.load(parse_generation_config(str(tmp_path)), "elsewhere") == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=100, max_tokens_cap=100)
    assert SamplingDefaults.load("auto", tmp_path).max_tokens_cap is None


def test_server_wide_overrides_of_sampling_and_template_defaults(demo_model_dir, tmp_path):
    """vLLM's `--override-generation-config` sets sampling defaults over the model's (a request's own value still
    wins), and its max_new_tokens caps every reply, as vLLM's override_max_tokens does (a request's larger
    max_tokens got it); `--default-chat-template-kwargs` gives every request template variables it does not set
    itself."""
    import httpx

    from ember.server.config import ServeConfig

    model = tmp_path / "demo"
    shutil.copytree(demo_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1, "top_p": 0.9}))
    config = ServeConfig(model_dir=model, served_model_name="demo", max_num_seqs=8, kv_cache_blocks=128,
                         in_process=True,
                         override_generation_config='{"temperature": 0, "top_k": 50, "max_new_tokens": 7}',
                         default_chat_template_kwargs='{"enable_thinking": false}')
    with served(config) as server:
        assert server.runtime.sampling_defaults == SamplingDefaults(temperature=0.0, top_p=0.9, top_k=50,
                                                                    max_new_tokens=7, max_tokens_cap=7)
        # a request without max_tokens stops at max_new_tokens; one asking more is capped, one asking less gets it
        for asked, got in ((None, 7), (9, 7), (5, 5)):
            r = server.openai().chat.completions.create(model="demo", messages=HI, max_tokens=asked,
                                                        extra_body={"ignore_eos": True})
            assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (got, "length")
        text = server.openai().completions.create(model="demo", prompt="Once", max_tokens=12,
                                                  extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 7
        greedy = _chat(server)
        assert all(_chat(server, seed=s) == greedy for s in range(3))  # temperature 0 by default
        assert any(_chat(server, temperature=1.5, seed=s) != greedy for s in range(4))

        def prompt(**kw) -> str:
            r = httpx.post(server.url + "/tokenize", json={"messages": HI, **kw}, timeout=30).json()
            return server.tokenizer.decode(r["tokens"])

        assert prompt().endswith("<think>\n\n</think>\n\n")
        assert "</think>" not in prompt(chat_template_kwargs={"enable_thinking": True})
        chat = server.openai().chat.completions.create(model="demo", messages=HI, max_tokens=4,
                                                       extra_body={"return_token_ids": True})
        assert server.tokenizer.decode(chat.prompt_token_ids).endswith("</think>\n\n")
    assert SamplingDefaults.load("vllm", model, {"top_p": 0.5}) == SamplingDefaults(top_p=0.5)
    with pytest.raises(ValueError, match="eos_token_id not supported"):
        SamplingDefaults.load("auto", model, {"eos_token_id": 5})
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        SamplingDefaults.load("auto", model, {"max_new_tokens": 0})


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", b"\xff\xfe"])
def test_an_unusable_generation_config_names_the_flag_and_the_file(text, tmp_path):
    """A generation_config.json that does not parse stops the start in one line naming `--generation-config` and
    the file (not the model folder), whether it is the model's own (`auto`) or a folder's."""
    from ember.server.startup import StartupError

    path = tmp_path / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for setting in ("auto", str(tmp_path)):
        with pytest.raises(StartupError) as e:
            SamplingDefaults.load(setting, tmp_path)
        said = str(e.value)
        assert said.startswith(f"--generation-config {setting}: {path} ") and "\n" not in said, said


def test_generation_config_vllm_serves_a_model_whose_file_is_unusable(tmp_path, demo_model_dir):
    """`--generation-config vllm` ignores the file, as the refusal above tells the user to do: the engine read it
    too (for nothing) and stopped the start on a file that is not UTF-8 or not JSON."""
    from ember.server.config import ServeConfig

    model = tmp_path / "demo"
    shutil.copytree(demo_model_dir, model)
    (model / "generation_config.json").write_bytes(b"\xff\xfe{")
    config = ServeConfig(model_dir=model, served_model_name="m", kv_cache_blocks=32, generation_config="vllm")
    with served(config) as server:
        reply = server.openai().completions.create(model="m", prompt="hi", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
