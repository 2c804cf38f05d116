"""`ember serve MODEL` resolution without a network: local directories, hub ids from a hub cache laid out as
huggingface_hub lays it out (HF_HUB_OFFLINE=1), revisions, and one-line errors."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO_ID = "tiny-org/tiny-demo"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, model_dir: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """`root` as HF_HOME holding `repo_id` the way huggingface_hub lays out its cache: blobs, a snapshot of
    symlinks named by commit, and refs/main pointing at it."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(model_dir.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.fixture
def offline_hub(demo_model_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub_cache(tmp_path, demo_model_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_a_hub_id_resolves_to_its_cached_snapshot(offline_hub):
    from ember.server.model_source import resolve_model, served_name

    snap = offline_hub / "hub" / "models--tiny-org--tiny-demo" / "snapshots" / COMMIT
    assert resolve_model(REPO_ID) == snap
    assert resolve_model(f"{REPO_ID}@{COMMIT}") == snap
    assert resolve_model(REPO_ID, revision=COMMIT) == snap
    assert (snap / "model.safetensors").is_file() and served_name(REPO_ID, snap) == REPO_ID
    assert served_name(f"{REPO_ID}@{COMMIT}", snap) == REPO_ID


def test_resolution_errors_are_one_line_with_the_fix(offline_hub, tmp_path):
    from ember.server.model_source import ModelSourceError, resolve_model

    cases = {
        "tiny-org/absent": "tiny-org/absent is not in the Hugging Face cache",
        f"{REPO_ID}@v9": f"run `hf download {REPO_ID} --revision v9`",
        "not a model": "no such directory, and not a Hugging Face model id",
        __file__: "is a file; MODEL must be a checkpoint directory",
        str(tmp_path): "no config.json in",
    }
    for value, message in cases.items():
        with pytest.raises(ModelSourceError) as e:
            resolve_model(value)
        assert message in str(e.value) and "\n" not in str(e.value), value
    with pytest.raises(ModelSourceError, match="names revision 'a' but --revision is 'b'"):
        resolve_model(f"{REPO_ID}@a", revision="b")


def test_a_tokenizer_that_cannot_be_fetched_is_named_as_the_tokenizer(offline_hub, demo_model_dir):
    from ember.server.model_source import ModelSourceError, resolve_tokenizer

    with pytest.raises(ModelSourceError) as e:
        resolve_tokenizer("tiny-org/absent-tok", REPO_ID, demo_model_dir)
    assert str(e.value).startswith("--tokenizer tiny-org/absent-tok is not in the Hugging Face cache"), e.value
    assert str(e.value).endswith("or pass a local tokenizer folder"), e.value


def test_only_the_files_the_engine_reads_are_downloaded():
    from fnmatch import fnmatch

    from ember.server.model_source import ALLOW_PATTERNS

    wanted = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
              "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "model.gguf", "original/consolidated.00.pth", "README.md", "onnx/model.onnx",
                "flax_model.msgpack", "tf_model.h5"]
    assert all(any(fnmatch(f, p) for p in ALLOW_PATTERNS) for f in wanted)
    assert not any(fnmatch(f, p) for f in unwanted for p in ALLOW_PATTERNS)


def test_hf_token_reaches_the_hub_before_the_environment(demo_model_dir, tmp_path, monkeypatch):
    """`--hf-token` is the token a gated download sends; without it, HF_TOKEN (the hub call itself is replaced
    here: there is no network)."""
    import huggingface_hub

    from ember.server.model_source import resolve_model, resolve_tokenizer

    sent = []

    def snapshot_download(repo_id, **kw):
        sent.append(kw["token"])
        return str(demo_model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_TOKEN", "from-env")
    assert resolve_model(REPO_ID, token="hf_flag") == demo_model_dir
    assert resolve_model(REPO_ID) == demo_model_dir
    assert resolve_tokenizer("other/tok", REPO_ID, demo_model_dir, token="hf_flag") == demo_model_dir
    assert sent == ["hf_flag", "from-env", "hf_flag"]


def test_a_local_model_is_served_under_its_directorys_name_however_spelled(tmp_path, monkeypatch):
    """`ember serve .` (or `model/`, `..`) serves the model under the directory's name, never an empty one."""
    from ember.server.model_source import served_name

    model = tmp_path / "my-model"
    (model / "sub").mkdir(parents=True)
    monkeypatch.chdir(model)
    for spelled, name in ((".", "my-model"), ("./", "my-model"), ("../my-model/", "my-model"), ("sub/..", "my-model"),
                          ("sub/", "sub"), ("..", tmp_path.name)):
        assert served_name(spelled, Path(spelled)) == name, spelled
