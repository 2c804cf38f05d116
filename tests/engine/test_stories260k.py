"""A real trained model no one here wrote: llama2.c's stories260K, converted to a Hugging Face Llama checkpoint,
greedy-decoded from BOS by Ember, equals llama2.c's documented output character for character."""
from __future__ import annotations

import struct
import subprocess

import pytest

from ember.engine import convert_llama2c
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import shared_path
from tests.server.processes import ember_cmd



@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory):
    src = shared_path("models", "stories260K")
    out = tmp_path_factory.mktemp("stories260K-hf")
    assert convert_llama2c.main([str(src / "stories260K.bin"), str(src / "tok512.bin"), str(out)]) == 0
    return out


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                                "prompt_lookup_min": 2}])
def test_greedy_from_bos_matches_llama2c(stories_dir, speculative):
    """... also with n-gram speculative decoding, which must emit exactly the greedy tokens, in fewer steps."""
    expected = shared_path("models", "stories260K", "expected_greedy_t0.txt").read_text(encoding="utf-8")
    engine = Engine.from_pretrained(stories_dir, speculative_config=speculative)
    assert engine.model_config.architecture == "LlamaForCausalLM"
    assert engine.max_model_len == 512
    # llama2.c run.c: 256 steps (one token sampled per step) from the BOS prompt, stopping early on BOS
    engine.add_request([1], SamplingParams(max_tokens=256, temperature=0.0))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == expected.removesuffix("\n")  # SOURCE.md: the extraction added one newline
    if speculative:
        stats = engine.stats()
        assert stats.spec_accepted_tokens > 0 and stats.num_steps < len(tokens)


def test_converted_tokenizer_round_trips_text(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    text = "Once upon a time, there was a little girl named Lily."
    ids = tok.encode(text)
    assert ids[0] == 1  # BOS
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text) // 2  # merged pieces, not bytes


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ember_cmd(), "convert-llama2c", *args], capture_output=True, text=True, timeout=120)


def test_files_that_cannot_be_converted_are_one_line(tmp_path):
    """A missing file, a file that is not llama2.c's, a truncated model.bin and a tokenizer that is not one: each
    `ember convert-llama2c: error: FILE: ...` on one line, exit 1, nothing written."""
    src = shared_path("models", "stories260K")
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes((src / "stories260K.bin").read_bytes()[:4096])
    not_llama2c = tmp_path / "config.json"
    not_llama2c.write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}\n')
    cases = [  # model.bin, tokenizer.bin, the file named, what is said about it
        (tmp_path / "absent.bin", src / "tok512.bin", tmp_path / "absent.bin", "No such file or directory"),
        (not_llama2c, src / "tok512.bin", not_llama2c, "not a llama2.c model.bin"),
        (truncated, src / "tok512.bin", truncated, "file too short for the shapes its header gives"),
        (src / "stories260K.bin", not_llama2c, not_llama2c, "not a llama2.c tokenizer.bin"),
    ]
    for model_bin, tokenizer_bin, culprit, message in cases:
        r = _convert(str(model_bin), str(tokenizer_bin), str(tmp_path / "out"))
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith(f"ember convert-llama2c: error: {culprit}: {message}"), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "out").exists()


def _refused(capsys, model_bin, tokenizer_bin, out, culprit, message: str) -> None:
    """In-process ``convert-llama2c``: exit 1, one line naming ``culprit``, no partial output beside ``out``."""
    assert convert_llama2c.main([str(model_bin), str(tokenizer_bin), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ember convert-llama2c: error: {culprit}: {message}"), err
    assert err.count("\n") == 1, err
    assert not list(out.parent.glob(f".{out.name}.*"))


def test_files_longer_than_their_header_says_are_one_line(tmp_path, capsys):
    """A tokenizer.bin with more tokens than model.bin's vocabulary, and a model.bin with bytes after its tensors."""
    src = shared_path("models", "stories260K")
    tokenizer = tmp_path / "tok1024.bin"
    tokenizer.write_bytes((src / "tok512.bin").read_bytes() + struct.pack("<fi", -1.0, 3) + b"abc")
    _refused(capsys, src / "stories260K.bin", tokenizer, tmp_path / "out", tokenizer,
             "11 bytes after its first 512 tokens")
    model = tmp_path / "trailing.bin"
    model.write_bytes((src / "stories260K.bin").read_bytes() + b"\0" * 6)
    _refused(capsys, model, src / "tok512.bin", tmp_path / "out", model, "6 bytes after the tensors its header gives")
    assert not (tmp_path / "out").exists()


def test_an_existing_checkpoint_is_not_overwritten(tmp_path, capsys):
    """Shards and an index already in OUT_DIR would outlive the new model.safetensors (and be loaded instead)."""
    src = shared_path("models", "stories260K")
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        (out / name).write_text("{}")
        _refused(capsys, src / "stories260K.bin", src / "tok512.bin", out, out, "already holds a checkpoint")
        assert [p.name for p in out.iterdir()] == [name]


def test_a_write_failure_is_one_line_and_leaves_no_output(tmp_path, capsys, monkeypatch):
    """A full disk (safetensors raises its own error, not OSError): one line naming the file; an absent OUT_DIR stays
    absent, an empty one stays empty."""
    from safetensors import SafetensorError

    from ember.engine import checkpoint_writer

    def full(*args, **kwargs):
        raise SafetensorError("No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint_writer, "save_file", full)
    src = shared_path("models", "stories260K")
    out = tmp_path / "out"
    _refused(capsys, src / "stories260K.bin", src / "tok512.bin", out, out / "model.safetensors",
             "cannot be written (No space left on device")
    assert not out.exists()
    out.mkdir()
    _refused(capsys, src / "stories260K.bin", src / "tok512.bin", out, out / "model.safetensors", "cannot be written")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any(out.iterdir())
