"""Engine settings: one dataclass of defaults, CLI flags generated from it with every default in the help."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from ember.engine.args import EngineArgs, add_flags, from_namespace
from ember.engine.config import EngineConfig


def _parser(cls: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add_flags(p, cls)
    return p


def test_every_engine_setting_is_a_flag_with_its_default_in_the_help():
    text = " ".join(_parser(EngineArgs).format_help().split())
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
    for piece in ("--max-num-batched-tokens TOKENS", "(default: 2048)", "--block-size",
                  "--enable-chunked-prefill, --no-enable-chunked-prefill",
                  "--enable-prefix-caching, --no-enable-prefix-caching", "--kv-cache-dtype {auto,fp8,fp8_e4m3}",
                  "(default: auto)", "(default: 0.9)"):
        assert piece in text, piece
    assert text.count("default:") >= len(dataclasses.fields(EngineArgs))  # each flag says its default


def test_flags_parse_back_into_the_dataclass():
    args = from_namespace(EngineArgs, _parser(EngineArgs).parse_args([
        "--max-num-batched-tokens", "512", "--block-size", "32", "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "1.5G",
        "--attention-backend", "reference"]))
    assert (args.max_num_batched_tokens, args.block_size, args.enable_chunked_prefill,
            args.enable_prefix_caching, args.kv_cache_dtype) == (512, 32, False, False, "fp8")
    assert args.kv_cache_memory == int(1.5 * 2**30) and args.attention_backend == "reference"
    assert from_namespace(EngineArgs, _parser(EngineArgs).parse_args([])) == EngineArgs()
    with pytest.raises(SystemExit):
        _parser(EngineArgs).parse_args(["--kv-cache-blocks", "8", "--kv-cache-memory", "1G"])
    with pytest.raises(SystemExit):
        _parser(EngineArgs).parse_args(["--kv-cache-dtype", "int4"])


def test_the_engine_config_defaults_are_the_engine_args_defaults():
    cfg, args = EngineConfig(), EngineArgs()
    opts = args.engine_options()
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "enable_prefix_caching",
                 "enable_chunked_prefill", "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager",
                 "state_snapshots"):
        assert getattr(cfg, name) == opts[name], name
    assert cfg.num_kv_blocks == opts["num_kv_blocks"] and cfg.kv_cache_memory == opts["kv_cache_memory"]


def test_serve_help_shows_the_engine_flags_and_the_old_alias_still_works(capsys):
    from ember.server import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-num-batched-tokens" in out and "--in-process" in out and "(default: 64)" in out
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    assert cli.serve_config(parser.parse_args(["serve", "--no-prefix-caching"])).enable_prefix_caching is False
    assert cli.serve_config(parser.parse_args(["serve"])).in_process is False


@pytest.mark.parametrize("flag, value", [
    ("--max-num-seqs", "0"), ("--max-num-seqs", "-3"), ("--max-num-seqs", "many"), ("--max-num-batched-tokens", "0"),
    ("--kv-cache-blocks", "0"), ("--kv-cache-blocks", "-1"), ("--block-size", "0"), ("--tensor-parallel-size", "0"),
    ("--tensor-parallel-size", "-1"), ("--cpu-threads", "-2"), ("--cpu-threads", "0"), ("--max-lora-rank", "-4"),
    ("--max-lora-rank", "0"), ("--max-loras", "0"), ("--max-logprobs", "-5"), ("--max-model-len", "0"),
    ("--state-snapshots", "-1"), ("--device", "tpu"), ("--device", "cuda:abc"), ("--device", "cuda:-1"),
    ("--device", "cpu:1"), ("--tokenizer", "/nonexistent"), ("--tokenizer", "no-such-folder")])
def test_a_bad_value_is_refused_naming_its_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        _parser(EngineArgs).parse_args([flag, value])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"x: error: argument {flag}: ")


def test_the_edge_values_still_parse():
    args = from_namespace(EngineArgs, _parser(EngineArgs).parse_args([
        "--max-logprobs", "-1", "--state-snapshots", "0", "--max-num-seqs", "1", "--block-size", "1",
        "--max-model-len", "1", "--kv-cache-blocks", "1", "--cpu-threads", "1", "--device", "cpu",
        "--tokenizer", "Qwen/Qwen3-8B@main"]))
    assert (args.max_logprobs, args.state_snapshots, args.max_num_seqs, args.device) == (-1, 0, 1, "cpu")
    assert args.tokenizer == "Qwen/Qwen3-8B@main"


def test_a_cuda_device_must_exist(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("cuda", "cuda:1"):
        assert _parser(EngineArgs).parse_args(["--device", device]).device == device
    for count, device, said in ((2, "cuda:2", "sees 2 CUDA devices"), (0, "cuda", "no CUDA device")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        with pytest.raises(SystemExit) as e:
            _parser(EngineArgs).parse_args(["--device", device])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --device:" in err and said in err


def test_the_dtype_help_names_one_default():
    text = " ".join(_parser(EngineArgs).format_help().split())
    text = text[text.index("options:"):]
    dtype = text[text.index("--dtype"):text.index("--device")]
    assert "default: auto, bfloat16 on CUDA and float32 on CPU" in dtype and "default: none" not in dtype


def test_the_default_cpu_threads_are_shared_out_among_tensor_parallel_ranks(monkeypatch):
    """Every core but one, divided among the ranks (each worker takes the driver's count), at least one each: two
    ranks on 9 cores run 4 threads each, not 8 (oversubscribed, 4x slower); --cpu-threads is per rank."""
    import torch

    monkeypatch.setattr("ember.engine.args.os.cpu_count", lambda: 9)
    saved = torch.get_num_threads()
    try:
        for tp, cpu_threads, per_rank in ((1, None, 8), (2, None, 4), (3, None, 2), (16, None, 1), (2, 3, 3)):
            EngineArgs(tensor_parallel_size=tp, cpu_threads=cpu_threads).apply_threads()
            assert torch.get_num_threads() == per_rank, (tp, cpu_threads)
    finally:
        torch.set_num_threads(saved)
    text = " ".join(_parser(EngineArgs).format_help().split())
    assert "worker (per rank, as in vLLM); default: every core but one" in text
