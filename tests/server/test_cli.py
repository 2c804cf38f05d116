"""The `ember` console script: option parsing, the demo-model default, and a real `ember serve` process."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from ember.server.cli import main, serve_config
from tests.conftest import shared_path
from tests.server.processes import serving


def test_serve_options_map_to_the_config(capsys):
    import argparse

    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "org/x", "--port", "9001", "--api-key", "k", "--served-model-name", "m",
                              "--max-model-len", "2048", "--max-num-seqs", "8", "--kv-cache-memory", "1.5G",
                              "--reasoning-parser", "qwen3", "--tool-parser", "none", "--chat-template", "{{ x }}",
                              "--tensor-parallel-size", "2", "--enforce-eager"])
    c = serve_config(args)
    assert (str(c.model_dir), c.port, c.api_key, c.served_model_name, c.max_model_len, c.max_num_seqs) == (
        "org/x", 9001, ("k",), "m", 2048, 8)
    assert c.kv_cache_memory == int(1.5 * 2**30) and c.kv_cache_blocks is None
    assert (c.reasoning_parser, c.tool_parser, c.chat_template) == ("qwen3", "none", "{{ x }}")
    assert (c.tensor_parallel_size, c.enforce_eager, c.gpu_memory_utilization) == (2, True, 0.9)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-blocks", "10", "--kv-cache-memory", "1G"])
    vllm = serve_config(parser.parse_args(["serve", "--model", "org/y", "--enable-auto-tool-choice",
                                           "--tool-call-parser", "qwen3_xml", "--trust-remote-code"]))
    assert (str(vllm.model_dir), vllm.tool_parser) == ("org/y", "qwen3_coder")  # a vLLM command line carries over
    for flags in (["--runner", "pooling"], ["--task", "embed"], ["--convert", "embed"]):  # served by any server
        c = serve_config(parser.parse_args(["serve", "--model", "org/e", *flags]))
        assert c.model_dir == Path("org/e") and c.classifier_flag is None
    for flags in (["--task", "score"], ["--convert", "classify"]):  # the checkpoint must be a classifier
        assert serve_config(parser.parse_args(["serve", *flags])).classifier_flag == " ".join(flags)
    yarn = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
    assert serve_config(parser.parse_args(["serve", "--hf-overrides", yarn])).engine_options()["hf_overrides"] == {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    lora = serve_config(parser.parse_args(["serve", "--enable-lora", "--lora-modules", "sql=/a", "chat=/b",
                                           "--lora-modules", '{"name": "x", "path": "/c"}', "--max-lora-rank", "64",
                                           "--max-cpu-loras", "4"])).engine_options()
    assert (lora["lora_modules"], lora["max_lora_rank"]) == ((("sql", "/a"), ("chat", "/b"), ("x", "/c")), 64)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--lora-modules", "no-path"])
    assert e.value.code == 2 and "is not NAME=PATH" in capsys.readouterr().err
    docker = serve_config(parser.parse_args([  # a vLLM deployment's command line carries over as is
        "serve", "--model", "org/z", "--seed", "0", "--disable-log-requests", "--disable-log-stats", "--max-log-len",
        "100", "--swap-space", "4", "--disable-custom-all-reduce", "--max-seq-len-to-capture", "8192",
        "--enable-prompt-tokens-details", "--load-format", "safetensors", "--tokenizer-mode", "auto",
        "--distributed-executor-backend", "mp", "--disable-frontend-multiprocessing", "--uvicorn-log-level",
        "warning", "--disable-uvicorn-access-log", "--override-generation-config", '{"temperature": 0.5}',
        "--default-chat-template-kwargs", '{"enable_thinking": false}', "--dtype", "auto", "--kv-cache-dtype",
        "fp8_e4m3", "--quantization", "modelopt_fp4", "--limit-mm-per-prompt", '{"image": 0}', "--async-scheduling",
        "--enable-expert-parallel", "--compilation-config", '{"level": 3}', "-O3", "--max-parallel-loading-workers",
        "2", "--long-prefill-token-threshold", "512", "--max-num-partial-prefills", "1", "--guided-decoding-backend",
        "xgrammar", "--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--cpu-offload-gb", "0",
        "--hf-token", "hf_x", "--disable-fastapi-docs"]))
    assert (docker.seed, docker.in_process, docker.uvicorn_log_level, docker.disable_uvicorn_access_log) == (
        0, True, "warning", True)
    assert docker.engine_options()["dtype"] is None and docker.kv_cache_dtype == "fp8_e4m3"
    assert docker.engine_options()["async_scheduling"] is True
    named = serve_config(parser.parse_args(["serve", "--served-model-name", "qwen", "gpt-4o", "qwen", "o1"]))
    assert (named.served_model_name, named.served_model_aliases) == ("qwen", ("gpt-4o", "o1"))
    assert docker.hf_token == "hf_x" and "hf_x" not in repr(docker) and docker.disable_fastapi_docs
    for flags, said in ((["--load-format", "gguf"], "Ember serves only auto or safetensors"),
                        (["--pipeline-parallel-size", "2"], "Ember serves only 1"),
                        (["--cpu-offload-gb", "8"], "Ember serves only 0"),
                        (["--distributed-executor-backend", "ray"], "Ember serves only mp or uni"),
                        (["--override-generation-config", '{"temprature": 1}'], "temprature not supported"),
                        (["--override-generation-config", '{"top_p": 2}'], "top_p = 2 is not a usable value"),
                        (["--default-chat-template-kwargs", "[1]"], "expected a JSON object")):
        with pytest.raises(SystemExit) as e:
            main(["serve", *flags])
        assert e.value.code == 2 and said in (err := capsys.readouterr().err) and err.count(flags[0]) == 1, err
    for bad, said in (("{rope", "not valid JSON"), ("[1]", "expected a JSON object")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--hf-overrides", bad])
        assert e.value.code == 2 and "--hf-overrides" in (err := capsys.readouterr().err) and said in err
    for flag, kind in (("--convert", "reward"), ("--runner", "draft")):  # said once, with what is served
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, kind])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: {kind}: Ember serves auto, " in err and err.count(flag) == 1
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--reasoning-parser" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tool-parser", "nonsense"])
    assert e.value.code == 2 and "'nonsense' is unknown" in capsys.readouterr().err
    for sub, word in (("convert-llama2c", "tokenizer_bin"), ("quantize-nvfp4", "NVFP4")):
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0 and word in capsys.readouterr().out


def test_no_model_dir_builds_the_demo_model_once(tmp_path, monkeypatch):
    """Also: a prompt the (here tiny) KV cache can never hold is a 400, streaming or not."""
    from ember.server.app import BackgroundServer, create_app, load_runtime
    from ember.server.config import ServeConfig

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    config = ServeConfig(kv_cache_blocks=8, max_num_seqs=2)
    rt = load_runtime(config)
    srv = BackgroundServer(create_app(rt, config)).start()
    try:
        assert (tmp_path / "demo" / "model.safetensors").exists()
        assert rt.model_name == "demo" and rt.parser.profile.name == "qwen3"
        assert rt.max_model_len > 8 * 16
        body = {"messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "KV cache holds 128 tokens" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages"
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        srv.stop()  # the app owns the engine: stopping it shuts the engine down
    assert not rt.engine.is_running


def test_ember_serve_a_converted_llama2c_model(tmp_path):
    """`ember convert-llama2c` then `ember serve DIR` in a real process: greedy text equals llama2.c's. The model is
    served as the directory's name, and also as DIR as given (vLLM's default name), which clients of vLLM send."""
    src = shared_path("models", "stories260K")
    expected = (src / "expected_greedy_t0.txt").read_text(encoding="utf-8").removesuffix("\n")
    out = tmp_path / "stories"
    assert main(["convert-llama2c", str(src / "stories260K.bin"), str(src / "tok512.bin"), str(out)]) == 0
    with serving([str(out), "--max-num-seqs", "2", "--kv-cache-blocks", "64", "--log-level", "warning"],
                 tmp_path / "serve.log") as served:
        assert httpx.get(served.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "stories"
        r = httpx.post(served.url + "/v1/completions", timeout=120, json={
            "model": str(out), "prompt": [1], "max_tokens": 256, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "stories", r.text
        assert r.json()["choices"][0]["text"] == expected  # llama2.c prints no space first, as decode gives it


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_ember_serve_over_https_under_a_root_path(tmp_path, demo_model_dir, capsys):
    """`--ssl-keyfile/--ssl-certfile` serve HTTPS (the client checks the certificate); under `--root-path` every
    route answers with and without the prefix (as vLLM's) and the generated docs link under it; a key without its
    certificate stops the start before the model loads."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    args = [str(demo_model_dir), "--served-model-name", "demo", "--max-num-seqs", "2", "--kv-cache-blocks", "32",
            "--log-level", "warning", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/ember"]
    with serving(args, tmp_path / "serve.log", verify=str(cert)) as served:
        assert served.url.startswith("https://")
        r = httpx.post(served.url + "/v1/completions", verify=str(cert), timeout=60,
                       json={"model": "demo", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        for path in ("/ember/v1/models", "/v1/models"):  # a proxy that forwards the prefix, one that strips it
            r = httpx.get(served.url + path, verify=str(cert), timeout=30)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "demo", (path, r.text)
        assert "/ember/openapi.json" in httpx.get(served.url + "/docs", verify=str(cert), timeout=30).text
        with pytest.raises(httpx.HTTPError):  # not plain HTTP
            httpx.get(served.url.replace("https://", "http://") + "/health", timeout=5)
    assert main(["serve", str(demo_model_dir), "--ssl-keyfile", str(key)]) != 0
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err


def test_parser_flags_pick_the_profile(demo_model_dir):
    """`--reasoning-parser none` leaves thoughts in content; a reasoning parser can lend its thought syntax to a
    different tool parser; with no flags the family comes from the chat template."""
    from transformers import AutoTokenizer

    from ember.parsers.initial import InitialState
    from ember.parsers.pipeline import ParserSetup, parse_all
    from ember.server.generation import choose_profile

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tok.encode("<think>hmm</think>Hi", add_special_tokens=False)

    def parse(profile):
        setup = ParserSetup.from_tokenizer(tok, profile)
        return parse_all(setup.pipeline(initial=InitialState.CONTENT), ids)

    detected = choose_profile(tok.chat_template, None, None, None)
    assert detected.name == "qwen3"
    assert (parse(detected).reasoning, parse(detected).content) == ("hmm", "Hi")
    off = choose_profile(tok.chat_template, None, "none", None)
    assert off.reasoning is None and parse(off).content == "<think>hmm</think>Hi"
    merged = choose_profile(None, None, "deepseek_r1", "hermes")
    assert (merged.tool_format, merged.reasoning.start_mode) == ("hermes", "always")
    assert (parse(merged).reasoning, parse(merged).content) == ("hmm", "Hi")
    assert choose_profile(None, None, None, "none").tool_format is None
    kept = choose_profile(None, "minimax_m2", "minimax_m2_append_think", None)  # MiniMax's vLLM command line
    assert kept.tool_format == "qwen3_coder" and kept.reasoning.in_content
    assert (parse(kept).reasoning, parse(kept).content) == ("", "<think>hmm</think>Hi")


def _stub_serve(monkeypatch) -> list:
    """`ember serve`'s parse only: the config it would serve with is collected, no server starts."""
    from ember.server import cli

    seen: list = []
    monkeypatch.setattr(cli, "serve", lambda config: seen.append(config) or 0)
    return seen


@pytest.mark.parametrize("flags", [
    ["--port", "70000"], ["--port", "-1"], ["--api-key", ""], ["--api-key", " key"], ["--served-model-name", ""],
    ["--served-model-name", "qwen", "  "], ["--max-waiting", "0"], ["--max-waiting", "-1"],
    ["--shutdown-timeout", "-1"], ["--shutdown-timeout", "nan"], ["--responses-store-size", "-1"],
    ["--sse-keepalive-seconds", "-1"], ["--sse-keepalive-seconds", "nan"], ["--sse-keepalive-seconds", "inf"],
    ["--max-log-len", "-1"], ["--max-num-seqs", "0"], ["--max-num-batched-tokens", "0"], ["--kv-cache-blocks", "0"],
    ["--block-size", "0"], ["--tensor-parallel-size", "0"], ["--cpu-threads", "-2"], ["--max-lora-rank", "-4"],
    ["--max-loras", "0"], ["--max-logprobs", "-5"], ["--max-model-len", "0"], ["--device", "tpu"],
    ["--device", "cuda:abc"], ["--tokenizer", "/nonexistent"], ["--runtime-lora-updating"],
    ["--model", "org/a", "org/b"], ["--max-model-len", "1.5K"], ["--max-model-len", "-2"], ["--max-model-len", "1k5"],
    ["--seed", "99999999999999999999"]])
def test_a_bad_flag_value_stops_at_parse_in_one_line_naming_the_flag(flags, monkeypatch, capsys):
    seen = _stub_serve(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not seen
    assert len(err.splitlines()) == 1 and err.startswith(f"ember serve: error: argument {flags[0]}: "), err


def test_the_edge_values_of_the_checked_flags_still_parse(monkeypatch):
    seen = _stub_serve(monkeypatch)
    assert main(["serve", "--port", "0", "--max-logprobs", "-1", "--sse-keepalive-seconds", "0", "--shutdown-timeout",
                 "0", "--responses-store-size", "0", "--max-waiting", "1", "--max-log-len", "0", "--api-key", "k",
                 "--served-model-name", "my model", "--runtime-lora-updating", "--enable-lora"]) == 0
    c = seen[-1]
    assert (c.port, c.max_logprobs, c.sse_keepalive_seconds, c.shutdown_timeout, c.responses_store_size) == (
        0, -1, 0.0, 0.0, 0)
    assert (c.max_waiting, c.api_key, c.served_model_name, c.runtime_lora_updating) == (1, ("k",), "my model", True)
    assert main(["serve", "--port", "65535"]) == 0 and seen[-1].port == 65535


def test_the_help_says_what_the_flags_accept(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    out = out[out.index("options:"):]
    override = out[out.index("--override-generation-config JSON"):out.index("--default-chat-template-kwargs JSON")]
    assert "repetition_penalty, max_new_tokens" in override
    assert "default: none" not in out[out.index("--dtype {"):out.index("--device")]


def test_vllm_short_flags_and_an_unknown_flag_before_model(monkeypatch, capsys):
    """`vllm serve -tp 2 -q fp8 MODEL` carries over; an unknown flag is reported as one, not as a bad MODEL."""
    seen = _stub_serve(monkeypatch)
    assert main(["serve", "-tp", "2", "-q", "fp8", "-pp", "1", "-dp", "1", "-ep", "org/x"]) == 0
    c = seen[-1]
    assert (str(c.model_dir), c.tensor_parallel_size, c.quantization) == ("org/x", 2, "fp8")
    with pytest.raises(SystemExit) as e:
        main(["serve", "-tp", "0", "org/x"])
    assert e.value.code == 2 and "argument -tp: 0 is out of range" in capsys.readouterr().err  # the spelling given
    for argv, said in ((["--no-such-flag", "2", "org/x"], "unknown flag --no-such-flag "),
                       (["-zz", "org/x", "--bogus=1"], "unknown flags -zz, --bogus ")):
        with pytest.raises(SystemExit) as e:
            main(["serve", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "MODEL" not in err, err
    with pytest.raises(SystemExit) as e:
        main(["serve", "not a model"])
    assert e.value.code == 2 and "argument MODEL: not a model: no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, name", [
    (["--served-model-name", "qwen", "gpt-4o", "--lora-modules", "gpt-4o=/a"], "gpt-4o"),
    (["--served-model-name", "qwen", "--lora-modules", "sql=/a", '{"name": "qwen", "path": "/b"}'], "qwen"),
    (["org/x@v1", "--lora-modules", "org/x=/a"], "org/x"),
    (["--lora-modules", "demo=/a"], "demo"),
    ([".", "--lora-modules", ".=/a"], ".")])
def test_a_lora_adapter_may_not_take_a_name_of_the_served_model(argv, name, monkeypatch, capsys):
    seen = _stub_serve(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and not seen
    assert err.startswith(f"ember serve: error: argument --lora-modules: {name!r} is a name of the served model"), err


def test_vllm_cors_and_load_tracking_flags_are_taken(monkeypatch, capsys):
    """vLLM's CORS flags (JSON lists or repeated) and --enable-server-load-tracking start the server; a CORS flag
    without --allowed-origins, which would change nothing with CORS off, is refused naming it."""
    seen = _stub_serve(monkeypatch)
    assert main(["serve", "--allowed-origins", "*", "--allow-credentials", "--allowed-methods", '["GET", "POST"]',
                 "--allowed-headers", "content-type", "--allowed-headers", "authorization",
                 "--enable-server-load-tracking"]) == 0
    config = seen[-1]
    assert config.allow_credentials and config.enable_server_load_tracking
    assert config.allowed_methods == ("GET", "POST") and config.allowed_headers == ("content-type", "authorization")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--allow-credentials"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --allow-credentials: CORS is off without --allowed-origins" in err, err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--allowed-origins", "*", "--allowed-methods", "[1]"])
    assert e.value.code == 2 and "--allowed-methods" in capsys.readouterr().err


def test_vllm_api_key_env_and_json_allowed_origins_carry_over(monkeypatch):
    """A vLLM deployment's key in $VLLM_API_KEY still guards the server (the flag wins); vLLM's JSON list of
    origins is a list of origins, not one origin spelled like a list."""
    seen = _stub_serve(monkeypatch)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert main(["serve", "--allowed-origins", '["http://a.example", "http://b.example"]',
                 "--allowed-origins", "http://c.example"]) == 0
    assert seen[-1].api_key == ("from-env",)
    assert seen[-1].allowed_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert main(["serve", "--api-key", "flag"]) == 0 and seen[-1].api_key == ("flag",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert main(["serve"]) == 0 and seen[-1].api_key == ()


def test_vllm_underscores_lengths_and_switch_values_carry_over(monkeypatch):
    """`vllm serve --max_model_len 32k --gpu_memory_utilization=0.8 --enable_chunked_prefill False` parses as vLLM's
    does: underscores in flag names only, human-readable lengths, auto/-1 (fit to the KV cache), old boolean values."""
    seen = _stub_serve(monkeypatch)
    assert main(["serve", "--max_model_len", "2048", "--gpu_memory_utilization=0.8", "--trust_remote_code",
                 "--enable_auto_tool_choice", "--tool_call_parser", "hermes", "--served_model_name", "my_model",
                 "--enable_chunked_prefill", "False", "--enforce-eager=True", "org/x"]) == 0
    c = seen[-1]
    assert (c.max_model_len, c.gpu_memory_utilization, c.tool_parser, c.served_model_name) == (
        2048, 0.8, "hermes", "my_model")
    assert (c.enable_chunked_prefill, c.enforce_eager, str(c.model_dir)) == (False, True, "org/x")
    for text, tokens in (("32k", 32000), ("1M", 2**20), ("25.6k", 25600), ("1K", 1024), ("auto", -1), ("-1", -1)):
        assert main(["serve", "--max-model-len", text]) == 0 and seen[-1].max_model_len == tokens, text
    for text, tokens in (("8k", 8000), ("16K", 16384), ("4096", 4096)):
        assert main(["serve", "--max_num_batched_tokens", text]) == 0, text
        assert seen[-1].max_num_batched_tokens == tokens, text
    for text, size in (("8g", 8 * 10**9), ("8G", 8 * 2**30), ("1.5GiB", int(1.5 * 2**30))):  # vLLM's spelling
        assert main(["serve", "--kv-cache-memory-bytes", text]) == 0 and seen[-1].kv_cache_memory == size, text


def test_vllm_config_file_and_dotted_json_flags(tmp_path, monkeypatch, capsys):
    """vLLM's `--config FILE.yaml` (the command line wins) and `--x.key value` folded into `--x`'s JSON object."""
    seen = _stub_serve(monkeypatch)
    path = tmp_path / "serve.yaml"
    path.write_text("model: org/file\nmax_model_len: 16k\n--port: 9001\nenforce-eager: true\n"
                    "enable_chunked_prefill: false\nlora-modules: [a=/x]\nserved-model-name: [qwen, gpt]\n"
                    "speculative-config: {method: ngram, num_speculative_tokens: 4}\n")
    assert main(["serve", "--config", str(path)]) == 0
    c = seen[-1]
    assert (str(c.model_dir), c.max_model_len, c.port, c.enforce_eager, c.enable_chunked_prefill) == (
        "org/file", 16000, 9001, True, False)
    assert (c.lora_modules, c.served_model_name, c.served_model_aliases) == (("a=/x",), "qwen", ("gpt",))
    assert json.loads(c.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    assert main(["serve", "org/cli", "--config", str(path), "--max-model-len", "1K", "--port", "9002"]) == 0
    assert (str(seen[-1].model_dir), seen[-1].max_model_len, seen[-1].port) == ("org/cli", 1024, 9002)
    (tmp_path / "keys.yaml").write_text("api-key: [old1, old2]\nlora-modules: [a=/x]\n")
    assert main(["serve", "--config", str(tmp_path / "keys.yaml")]) == 0
    assert (seen[-1].api_key, seen[-1].lora_modules) == (("old1", "old2"), ("a=/x",))
    # a key rotated on the command line retires the file's (it stayed valid beside the new one), as in vLLM
    assert main(["serve", "--config", str(tmp_path / "keys.yaml"), "--api-key", "new", "--lora-modules", "b=/y"]) == 0
    assert (seen[-1].api_key, seen[-1].lora_modules) == (("new",), ("b=/y",))
    assert main(["serve", "--api-key", "k1", "k2", "--api-key", "k3"]) == 0  # vLLM's several-keys form, and repeats
    assert seen[-1].api_key == ("k1", "k2", "k3")
    (tmp_path / "on.yaml").write_text("enforce-eager: true\nreturn-tokens-as-token-ids: true\nenable-log-requests: "
                                      "true\nenable-chunked-prefill: false\nno-prefix-caching: true\n")
    for off in (["--enforce-eager", "false", "--return_tokens_as_token_ids=False", "--no-enable-log-requests",
                 "--enable-chunked-prefill", "--no-prefix-caching", "false"],
                ["--no-enforce-eager", "--no-return-tokens-as-token-ids", "--enable-log-requests=false",
                 "--enable-chunked-prefill=true", "--enable-prefix-caching"]):  # a command-line false wins the file
        assert main(["serve", "--config", str(tmp_path / "on.yaml"), *off]) == 0
        c = seen[-1]
        assert not (c.enforce_eager or c.return_tokens_as_token_ids or c.enable_log_requests), off
        assert c.enable_chunked_prefill and c.enable_prefix_caching, off
    assert main(["serve", "--no-enforce-eager=false", "--no-trust-remote-code"]) == 0 and seen[-1].enforce_eager
    (tmp_path / "blocks.yaml").write_text("kv-cache-blocks: 64\n")  # the command line's exclusive flag wins
    assert main(["serve", "--config", str(tmp_path / "blocks.yaml"), "--kv-cache-memory", "1G"]) == 0
    assert (seen[-1].kv_cache_blocks, seen[-1].kv_cache_memory) == (None, 2**30)
    assert main(["serve", "--config", str(tmp_path / "blocks.yaml")]) == 0
    assert (seen[-1].kv_cache_blocks, seen[-1].kv_cache_memory) == (64, None)
    assert main(["serve", "--speculative-config", '{"method": "ngram"}', "--speculative_config.num_speculative_tokens",
                 "4", "--speculative-config.prompt_lookup_max=3", "--compilation-config.cudagraph_mode",
                 "FULL_DECODE_ONLY"]) == 0
    assert json.loads(seen[-1].speculative_config) == {"method": "ngram", "num_speculative_tokens": 4,
                                                       "prompt_lookup_max": 3}
    (tmp_path / "dotted.yaml").write_text("speculative-config.method: ngram\n"
                                          "speculative_config.num_speculative_tokens: 2\n"
                                          "speculative-config.prompt_lookup_max: 5\nhf-overrides.rope.ids: [1, 2]\n")
    assert main(["serve", "--config", str(tmp_path / "dotted.yaml"), "--speculative-config.prompt_lookup_max", "3",
                 "--hf-overrides.rope.factor", "2"]) == 0  # the file's dotted keys merged with the command line's
    assert json.loads(seen[-1].speculative_config) == {"method": "ngram", "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 3}
    assert json.loads(seen[-1].hf_overrides) == {"rope": {"ids": [1, 2], "factor": 2}}
    (tmp_path / "bad.yaml").write_text("max-model-len: lots\n")
    (tmp_path / "nested.yaml").write_text("config: other.yaml\nseed: 3\n")  # was read as nothing, silently
    for argv, said in ((["--config", str(tmp_path / "none.yaml")], "argument --config: cannot read"),
                       (["--config", str(tmp_path / "nested.yaml")], "names another config file (other.yaml)"),
                       (["--config", str(tmp_path / "bad.yaml")], "argument --max-model-len: 'lots' is not a whole "
                                                                  "number"),
                       (["--foo.bar", "1"], "unknown flag --foo.bar "),
                       (["--enforce-eager=maybe"], "argument --enforce-eager: 'maybe' is not true or false"),
                       (["--speculative-config.method"], "argument --speculative-config.method: expected one")):
        with pytest.raises(SystemExit) as e:
            main(["serve", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and said in err, err
