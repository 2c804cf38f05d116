"""A sharded checkpoint reports its loading progress, one log line per weight file."""
from __future__ import annotations

import logging
import shutil

from ember.engine.engine import Engine


def test_a_sharded_checkpoint_logs_each_file(demo_model_dir, tmp_path, caplog):
    import torch
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="200KB")
    for f in demo_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, sharded / f.name)
    n = len(list(sharded.glob("*.safetensors")))
    assert n >= 2
    with caplog.at_level(logging.INFO, logger="ember.engine.loader"):
        Engine.from_pretrained(sharded, num_kv_blocks=8, max_num_seqs=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "ember.engine.loader"]
    assert [line.split(" (")[0] for line in lines] == [f"loading weights: {i}/{n} files" for i in range(1, n + 1)]
