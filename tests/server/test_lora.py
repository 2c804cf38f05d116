"""LoRA adapters over HTTP, as vLLM serves them (``--lora-modules NAME=PATH``): a request whose ``model`` names an
adapter runs under it on every route, its response carries the adapter's name, `/v1/models` lists the adapters with
the served model as their parent, and an unknown name is a 404 that lists what is served."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3
from tests.lora_adapters import ALL, merged_copy, save_adapter
from tests.server.conftest import served


@pytest.fixture(scope="module")
def lora_server(demo_model_dir, tmp_path_factory):
    from ember.server.config import ServeConfig

    root = tmp_path_factory.mktemp("lora-server")
    base = save_tiny_qwen3(root / "base", demo_model_dir, seed=31)
    tensors = save_adapter(root / "sql", seed=7, rank=8, alpha=16, modules=ALL)
    merged = merged_copy(base, tensors, 2.0, root / "merged")
    config = ServeConfig(model_dir=base, served_model_name="tiny", served_model_aliases=("gpt-4o",), max_num_seqs=4,
                         kv_cache_blocks=64, in_process=True, enable_lora=True,
                         lora_modules=(json.dumps({"name": "sql", "path": str(root / "sql"),
                                                   "base_model_name": "org/base"}),))
    with served(config) as server:
        yield server, merged, root / "sql"


def _greedy_tokens(path, prompt: list[int], n: int) -> list[int]:
    engine = Engine.from_pretrained(path, max_num_seqs=2, max_model_len=128, num_kv_blocks=32, dtype="float32",
                                    device="cpu")
    engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), request_id="r")
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


def test_a_request_naming_the_adapter_generates_as_the_merged_model(lora_server):
    server, merged, _ = lora_server
    prompt = server.tokenizer.encode("the quick brown fox")
    client = server.openai()
    want = server.tokenizer.decode(_greedy_tokens(merged, prompt, 10))
    got = client.completions.create(model="sql", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.model == "sql" and got.choices[0].text == want
    base = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert base.model == "tiny" and base.choices[0].text != want
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql"
    stream = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True)
    assert {c.model for c in stream} == {"sql"}
    message = server.anthropic().messages.create(model="sql", max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert message.model == "sql"


def test_models_lists_the_adapters_and_an_unknown_name_is_a_404(lora_server):
    server, _, folder = lora_server
    listed = {m.id: m for m in server.openai().models.list().data}
    assert list(listed) == ["tiny", "gpt-4o", "sql"]  # the served names (vLLM's several), then the adapters
    alias = server.openai().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
    assert alias.model == "tiny"  # another name of the served model: the response carries the first
    # vLLM's JSON form of --lora-modules names the adapter's parent (base_model_name); else the served model is
    assert listed["sql"].model_extra["parent"] == "org/base" and listed["sql"].model_extra["root"] == str(folder)
    assert httpx.get(server.url + "/v1/models/sql", timeout=30).json()["parent"] == "org/base"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "'tiny', 'gpt-4o', 'sql'" in r.text


def test_embeddings_under_an_adapter_are_the_merged_models(lora_server):
    server, merged, _ = lora_server
    text = "pooled under the adapter"
    body = httpx.post(server.url + "/v1/embeddings", json={"model": "sql", "input": text}, timeout=30).json()
    base = httpx.post(server.url + "/v1/embeddings", json={"input": text}, timeout=30).json()
    engine = Engine.from_pretrained(merged, max_num_seqs=2, max_model_len=128, num_kv_blocks=32, dtype="float32",
                                    device="cpu")
    engine.add_request(server.tokenizer.encode(text), SamplingParams(pooling="last"), request_id="e")
    want = None
    while engine.has_unfinished():
        for o in engine.step():
            want = o.embedding if o.finished else want
    want = np.asarray(want) / np.linalg.norm(want)
    assert body["model"] == "sql" and np.allclose(body["data"][0]["embedding"], want, atol=1e-5)
    assert not np.allclose(base["data"][0]["embedding"], want, atol=1e-3)


@pytest.fixture(scope="module")
def updating_server(demo_model_dir, tmp_path_factory):
    """Runtime loading through the engine in its own process (the `ember serve` default)."""
    from ember.server.config import ServeConfig

    root = tmp_path_factory.mktemp("lora-updating")
    base = save_tiny_qwen3(root / "base", demo_model_dir, seed=31)
    tensors = save_adapter(root / "sql", seed=7, rank=8, alpha=16, modules=ALL)
    config = ServeConfig(model_dir=base, served_model_name="tiny", served_model_aliases=("gpt-4o",), max_num_seqs=4,
                         kv_cache_blocks=64, enable_lora=True, max_loras=1, runtime_lora_updating=True)
    with served(config) as server:
        yield server, merged_copy(base, tensors, 2.0, root / "merged"), root / "sql"


def test_adapters_load_and_unload_at_runtime(updating_server, lora_server):
    server, merged, folder = updating_server
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    r = httpx.post(load, json={"lora_name": "sql", "lora_path": str(folder)}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    assert [m.id for m in server.openai().models.list().data] == ["tiny", "gpt-4o", "sql"]
    assert httpx.get(server.url + "/v1/models/sql", timeout=30).json()["parent"] == "tiny"
    prompt = server.tokenizer.encode("the quick brown fox")
    got = server.openai().completions.create(model="sql", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert got.choices[0].text == server.tokenizer.decode(_greedy_tokens(merged, prompt, 8))
    again = httpx.post(load, json={"lora_name": "sql", "lora_path": str(folder)}, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.text
    full = httpx.post(load, json={"lora_name": "other", "lora_path": str(folder)}, timeout=60)
    assert full.status_code == 400 and full.json()["error"]["param"] == "lora_path" and "slots" in full.text
    typo = httpx.post(load, json={"lora_name": "other", "lora_path": str(folder / "nope")}, timeout=60)
    assert typo.status_code == 400 and "not a directory" in typo.text, typo.text  # the path, not the full slots
    empty = httpx.post(load, json={"lora_name": "", "lora_path": str(folder)}, timeout=60)
    assert empty.status_code == 400 and "lora_name is empty" in empty.json()["error"]["message"], empty.text
    r = httpx.post(unload, json={"lora_name": "sql"}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    missing = httpx.post(load, json={"lora_name": "gone", "lora_path": str(folder / "nope")}, timeout=60)
    assert missing.status_code == 400 and "not a directory" in missing.text
    assert httpx.post(unload, json={"lora_name": "sql"}, timeout=60).status_code == 404
    r = httpx.post(server.url + "/v1/completions", json={"model": "sql", "prompt": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # without --runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING) the routes are not served
    off, _, _ = lora_server
    assert httpx.post(off.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                      timeout=60).status_code == 404


def test_load_inplace_replaces_an_adapter_and_concurrent_updates_are_serialized(updating_server, tmp_path):
    """vLLM's ``load_inplace``: the name then serves the new weights (a failed replacement keeps the old ones); two
    unloads of one name at once are one 200 and one 404 naming ``lora_name``, as one after the other."""
    import asyncio

    server, _, folder = updating_server
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    tensors = save_adapter(tmp_path / "v2", seed=9, rank=4, alpha=8, modules=ALL)
    merged_v2 = merged_copy(folder.parent / "base", tensors, 2.0, tmp_path / "merged")
    assert httpx.post(load, json={"lora_name": "sql", "lora_path": str(folder)}, timeout=60).status_code == 200
    r = httpx.post(load, json={"lora_name": "sql", "lora_path": str(tmp_path / "v2"), "load_inplace": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    prompt = server.tokenizer.encode("the quick brown fox")
    want = server.tokenizer.decode(_greedy_tokens(merged_v2, prompt, 8))

    def sql_text() -> str:
        return server.openai().completions.create(model="sql", prompt=prompt, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].text

    assert sql_text() == want
    bad = httpx.post(load, json={"lora_name": "sql", "lora_path": str(tmp_path / "nope"), "load_inplace": True},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert sql_text() == want  # still the weights it had
    # the usual load_inplace: the same folder rewritten, here into something Ember refuses. The adapter was dropped
    # (a 404 to requests, still listed, neither unloadable nor loadable again)
    config = json.loads((tmp_path / "v2" / "adapter_config.json").read_text())
    (tmp_path / "v2" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    bad = httpx.post(load, json={"lora_name": "sql", "lora_path": str(tmp_path / "v2"), "load_inplace": True},
                     timeout=60)
    assert bad.status_code == 400 and "DoRA" in bad.json()["error"]["message"], bad.text
    assert sql_text() == want
    assert "sql" in [m.id for m in server.openai().models.list().data]

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(unload, json={"lora_name": "sql"}) for _ in range(2)))

    codes = sorted((r.status_code, r.json()["error"]["param"] if r.status_code != 200 else None)
                   for r in asyncio.run(both()))
    assert codes == [(200, None), (404, "lora_name")]


def test_a_request_whose_adapter_is_unloaded_while_it_is_prepared_is_a_404(updating_server):
    """The front end found ``model`` among the adapters, then the engine no longer had it (unloaded meanwhile): the
    404 of an unknown ``model``, not a 400 naming no field. The front end's stale list stands in for the race."""
    import dataclasses

    server, _, folder = updating_server
    engine = server.runtime.engine
    info = engine.model_info
    engine.model_info = dataclasses.replace(info, lora_adapters=(*info.lora_adapters, ("gone", str(folder))))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": "gone", "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        m = httpx.post(server.url + "/v1/messages", timeout=60, json={
            "model": "gone", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        streamed = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "gone", "prompt": "hi", "max_tokens": 2, "stream": True}).text
    finally:
        engine.model_info = info
    error = r.json()["error"]
    assert r.status_code == 404 and error["param"] == "model" and error["code"] == "model_not_found", r.text
    assert "'gone'" in error["message"]
    assert m.status_code == 404 and m.json()["error"]["type"] == "not_found_error", m.text
    event = json.loads(next(line[6:] for line in streamed.splitlines() if line.startswith('data: {"error"')))["error"]
    assert (event["code"], event["param"]) == ("model_not_found", "model"), streamed  # a stream's error event too


@pytest.mark.parametrize("breakage", ["config is a list", "lora_alpha null", "weights are a Git LFS pointer"])
def test_a_malformed_adapter_is_a_400_and_the_engine_keeps_serving(updating_server, tmp_path, breakage):
    """Adapters broken in ways a user makes (a hand-edited config, an un-pulled LFS file) are refused naming
    lora_path; the engine process survives (it used to die, taking the server with it)."""
    import json
    import shutil

    server, _, folder = updating_server
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    if breakage == "config is a list":
        (bad / "adapter_config.json").write_text("[1, 2]")
    elif breakage == "lora_alpha null":
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": None}))
    else:
        (bad / "adapter_model.safetensors").write_text(
            "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4096\n")
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "'bad'" in r.json()["error"]["message"]
    ok = server.openai().completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_an_adapter_cannot_take_a_served_models_alias(updating_server):
    """A runtime adapter named like a --served-model-name alias would be listed twice and never reached."""
    server, _, folder = updating_server
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "gpt-4o", "lora_path": str(folder)},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert [m.id for m in server.openai().models.list().data] == ["tiny", "gpt-4o"]


def _lora_info(server) -> dict[str, float]:
    """The `vllm:lora_requests_info` samples of one /metrics scrape, by their labels."""
    lines = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
    return {ln.rsplit(" ", 1)[0].removeprefix("vllm:lora_requests_info"): float(ln.rsplit(" ", 1)[1])
            for ln in lines if ln.startswith("vllm:lora_requests_info{")}


def test_metrics_name_the_adapters_of_the_waiting_and_running_requests(lora_server, updating_server, monkeypatch):
    """vLLM's `vllm:lora_requests_info`: one series naming the adapters in use and the adapter slots, valued at the
    scrape's time; from the engine process too. The engine is held before each step while a request under ``sql``
    is in it, and scraped there: first waiting, then running."""
    server, _, _ = lora_server
    engine = server.runtime.engine.engine
    step, paused, resume = engine.step, threading.Event(), threading.Event()

    def held_step():
        if not resume.is_set() and any(s.params.lora == "sql"
                                       for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
            paused.set()
            assert resume.wait(30)
            resume.clear()
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    scrapes = []
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(server.openai().completions.create, model="sql", prompt="hi", max_tokens=3,
                           extra_body={"ignore_eos": True})
        for _ in range(2):
            assert paused.wait(30)
            paused.clear()
            t0 = time.time()
            scrapes.append((t0, _lora_info(server), time.time()))
            resume.set()
        monkeypatch.setattr(engine, "step", step)
        resume.set()
        assert done.result(timeout=30).usage.completion_tokens == 3
    (t0, waiting, t1), (_, running, _) = scrapes
    assert list(waiting) == ['{max_lora="1",running_lora_adapters="",waiting_lora_adapters="sql"}']
    assert t0 <= next(iter(waiting.values())) <= t1
    assert list(running) == ['{max_lora="1",running_lora_adapters="sql",waiting_lora_adapters=""}']
    assert list(_lora_info(server)) == ['{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}']

    process, _, _ = updating_server
    process.openai().completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert list(_lora_info(process)) == ['{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}']


def test_the_environment_switch_without_lora_says_so_at_start(demo_runtime, monkeypatch, caplog):
    """``--runtime-lora-updating`` without ``--enable-lora`` is refused; vLLM's environment switch is set for a whole
    deployment, so it is not, but the start says that the routes it serves will refuse every adapter."""
    from ember.server.app import create_app

    runtime, config = demo_runtime
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    with caplog.at_level("WARNING", logger="ember.server"):
        create_app(runtime, config, shutdown_engine=False)
    assert any("LoRA is off" in r.getMessage() and "--enable-lora" in r.getMessage() for r in caplog.records)
