"""A ``*ForSequenceClassification`` checkpoint is served as its causal LM's decoder with the ``score`` head on the
pooled last token: its pooling requests end in the logits transformers computes, and it generates nothing."""
from __future__ import annotations

import pytest
import torch

from ember.engine.engine import Engine
from ember.engine.launch import model_info_of
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3

LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-seq-cls"), demo_model_dir, seed=3,
                           head="ForSequenceClassification", num_labels=3, id2label=LABELS,
                           label2id={v: int(k) for k, v in LABELS.items()}, pad_token_id=0)


def _hf_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts]


def test_pooling_requests_end_in_the_classifiers_logits(classifier_dir):
    eng = Engine.from_pretrained(classifier_dir, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
                                 num_kv_blocks=32, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1270, (n,), generator=g).tolist() for n in (19, 3, 11)]  # 19: chunked over 3 steps
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(pooling="last"), request_id=str(i))
    got: dict[str, list[float]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                assert o.error is None and o.finish_reason == "stop" and not o.new_token_ids
                got[o.request_id] = o.embedding
    for i, want in enumerate(_hf_logits(classifier_dir, prompts)):
        g_ = torch.tensor(got[str(i)])
        assert g_.shape == (3,) and float((g_ - want).norm() / want.norm()) < 1e-5
    with pytest.raises(ValueError, match="classifier.*does not generate"):
        eng.add_request([5, 6], SamplingParams(max_tokens=2))
    assert model_info_of(eng).labels == ("negative", "neutral", "positive")
