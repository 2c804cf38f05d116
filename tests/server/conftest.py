"""Live servers for the server tests: the real app on uvicorn on a free loopback port, in a thread.

`demo_server`: the built-in demo model, served with its own Qwen3-style template extended so that
`enable_thinking: true` opens a thought (as Qwen3 Thinking-2507 does), to exercise reasoning on a tiny model.
`qwen3_server`: a tiny random Qwen3 carrying the real Qwen3 tokenizer and chat template from ../shared/data.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import shared_path, write_shared_tokenizer

THINK_SWITCH = """{%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""
THINK_SWITCH_ON = """{%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- elif enable_thinking is defined and enable_thinking %}
        {{- '<think>\\n' }}
    {%- endif %}"""


@dataclass
class LiveServer:
    url: str
    runtime: object
    model: str
    tokenizer: object
    app: object  # the FastAPI app (its state holds the serve config)

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                             timeout=60, **kw)

    def anthropic(self, **kw):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=kw.pop("api_key", "unused"), max_retries=0,
                                   timeout=60, **kw)

    def stats(self):
        return self.runtime.engine.stats()


@contextlib.contextmanager
def served(config):
    """The model of ``config`` loaded and served on a loopback port as a `LiveServer` named
    ``config.served_model_name``; the server stopped and its engine shut down afterwards."""
    from ember.server.app import load_runtime

    runtime = load_runtime(config)
    srv, app = _serve(runtime, config)
    try:
        yield LiveServer(srv.url, runtime, config.served_model_name, runtime.tokenizer, app)
    finally:
        srv.stop()
        runtime.engine.shutdown()


def _serve(runtime, config):
    from ember.server.app import BackgroundServer, create_app

    app = create_app(runtime, config, shutdown_engine=False)
    return BackgroundServer(app).start(), app


@pytest.fixture(scope="session")
def demo_runtime(demo_model_dir):
    from ember.engine import demo
    from ember.server.app import load_runtime
    from ember.server.config import ServeConfig

    template = demo.CHAT_TEMPLATE
    assert THINK_SWITCH in template
    config = ServeConfig(model_dir=demo_model_dir, served_model_name="ember-demo", max_num_seqs=32,
                         kv_cache_blocks=512, chat_template=template.replace(THINK_SWITCH, THINK_SWITCH_ON))
    runtime = load_runtime(config)
    yield runtime, config
    runtime.engine.shutdown()


@pytest.fixture(scope="session")
def demo_server(demo_runtime):
    runtime, config = demo_runtime
    srv, app = _serve(runtime, config)
    yield LiveServer(srv.url, runtime, "ember-demo", runtime.tokenizer, app)
    srv.stop()


@pytest.fixture
def rebuilt_server(demo_runtime):
    """``start(template=None, tokenizer=None, **settings)``: a live server whose front end is built as `ember serve`
    builds it, with ``settings`` changed (and the chat ``template`` and front-end ``tokenizer``, when given), over the
    demo runtime's engine; stopped after."""
    from ember.server.generation import ModelRuntime

    runtime, config = demo_runtime
    started = []

    def start(template: str | None = None, tokenizer=None, **settings):
        cfg = dataclasses.replace(config, **settings)
        rt = ModelRuntime.build(runtime.engine, cfg, config.model_dir, template or runtime.chat_template,
                                runtime.grammar, tokenizer or runtime.tokenizer)
        srv, _ = _serve(rt, cfg)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def keyed_server(demo_runtime):
    """The demo runtime behind a second app that requires an API key."""
    runtime, config = demo_runtime
    srv, app = _serve(runtime, dataclasses.replace(config, api_key="sekrit"))
    yield LiveServer(srv.url, runtime, "ember-demo", runtime.tokenizer, app)
    srv.stop()


def build_tiny_qwen3(out: Path) -> Path:
    """A random 1-layer Qwen3 with the real Qwen3 tokenizer files (tokenizer.json gunzipped beside its config)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    write_shared_tokenizer("qwen3", out, extra=("vocab.json", "merges.txt"))
    cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643],
                                                            "bos_token_id": 151643, "pad_token_id": 151643}))
    return out


@pytest.fixture(scope="session")
def qwen3_runtime(tmp_path_factory):
    from ember.server.app import load_runtime
    from ember.server.config import ServeConfig

    model_dir = build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    config = ServeConfig(model_dir=model_dir, served_model_name="tiny-qwen3", max_num_seqs=8, kv_cache_blocks=256)
    runtime = load_runtime(config)
    yield runtime, config
    runtime.engine.shutdown()


@pytest.fixture(scope="session")
def qwen3_server(qwen3_runtime):
    runtime, config = qwen3_runtime
    srv, app = _serve(runtime, config)
    yield LiveServer(srv.url, runtime, "tiny-qwen3", runtime.tokenizer, app)
    srv.stop()


@pytest.fixture(scope="session")
def qwen3_thinking_server(qwen3_runtime):
    """The same tiny Qwen3 behind the real Qwen3 Thinking-2507 chat template (its generation prompt opens
    `<think>`), as `ember serve --chat-template` would serve it."""
    runtime, config = qwen3_runtime
    template = json.loads(shared_path("tokenizers", "qwen3-thinking-2507", "tokenizer_config.json")
                          .read_text())["chat_template"]
    thinking = dataclasses.replace(runtime, chat_template=template)
    srv, app = _serve(thinking, config)
    yield LiveServer(srv.url, thinking, "tiny-qwen3", runtime.tokenizer, app)
    srv.stop()


@pytest.fixture(params=["demo", "qwen3"])
def any_server(request):
    """Each test using it runs on the demo model and on the tiny Qwen3 (skipped where ../shared is absent)."""
    return request.getfixturevalue(f"{request.param}_server")
