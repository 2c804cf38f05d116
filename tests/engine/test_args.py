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
    for piece in ("--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS", "(default: 2048)", "--block-size",
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
