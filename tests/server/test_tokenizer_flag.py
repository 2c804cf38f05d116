"""vLLM's `--tokenizer`: a checkpoint whose tokenizer lives elsewhere is served with that tokenizer (and its chat
template) in the engine, its structured-output grammar and the front end; naming the model itself changes nothing."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.server.conftest import served


@pytest.fixture(scope="module")
def weights_only(demo_model_dir, tmp_path_factory):
    """The demo checkpoint without its tokenizer files."""
    folder = tmp_path_factory.mktemp("weights-only") / "demo"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(demo_model_dir / name, folder / name)
    return folder


def test_a_checkpoint_without_a_tokenizer_is_served_with_the_one_given(weights_only, demo_model_dir):
    from ember.server.config import ServeConfig

    config = ServeConfig(model_dir=weights_only, served_model_name="demo", max_num_seqs=4, kv_cache_blocks=64,
                         tokenizer=str(demo_model_dir))  # the engine in its own process
    with served(config) as server:
        assert server.runtime.model_info.tokenizer_path == str(demo_model_dir)
        messages = [{"role": "user", "content": "name a colour"}]
        schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"],
                  "additionalProperties": False}
        r = server.openai().chat.completions.create(  # no thought: a random one could outrun max_tokens
            model="demo", messages=messages, max_tokens=64,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        assert json.loads(r.choices[0].message.content)["c"] in ("red", "blue")  # the engine's grammar ran
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        assert "<|im_start|>user" in server.tokenizer.decode(ids)  # the given tokenizer's chat template
    with pytest.raises(Exception, match="no tokenizer files"):
        with served(ServeConfig(model_dir=weights_only, max_num_seqs=4, kv_cache_blocks=64, in_process=True)):
            pass


def test_the_flag_names_a_folder_or_the_model_itself(weights_only, demo_model_dir, tmp_path):
    from ember.server.model_source import ModelSourceError, resolve_tokenizer

    assert resolve_tokenizer("org/name", "org/name", weights_only) == weights_only  # vLLM's --model X --tokenizer X
    assert resolve_tokenizer(str(demo_model_dir), weights_only, weights_only) == demo_model_dir
    with pytest.raises(ModelSourceError, match="no tokenizer files"):
        resolve_tokenizer(str(weights_only), None, demo_model_dir)
