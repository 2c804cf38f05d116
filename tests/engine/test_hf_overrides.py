"""vLLM's ``--hf-overrides``: config.json fields changed before the model loads. A YaRN ``rope_scaling`` extends the
context and computes what transformers computes with that config; ``classifier_from_token`` serves a causal LM as a
classifier whose logits are the LM's own (the original Qwen3-Reranker's ``["no", "yes"]``)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ember.engine.checkpoint import apply_hf_overrides
from ember.engine.config import ConfigError
from ember.engine.engine import Engine
from ember.engine.launch import model_info_of
from ember.engine.params import SamplingParams
from tests.conftest import save_tiny_qwen3

OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=48, dtype="float32", device="cpu")
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory, demo_model_dir):
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-lm"), demo_model_dir, seed=11, max_position_embeddings=64,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _tokens(path, ids: list[int]) -> list[str]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(ids)


def _hf_last_logits(path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def _pooled(engine: Engine, prompt: list[int]) -> torch.Tensor:
    engine.add_request(prompt, SamplingParams(pooling="last"), request_id="p")
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                assert o.error is None
                return torch.tensor(o.embedding)
    raise AssertionError("no output")


def test_overrides_replace_fields_and_update_sub_configs():
    base = {"architectures": ["X"], "text_config": {"model_type": "t", "hidden_size": 8, "rope_theta": 5.0},
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "id2label": {"0": "a"},
            "rope_parameters": {"rope_type": "default", "rope_theta": 7.0, "partial_rotary_factor": 0.5}}
    out = apply_hf_overrides(base, {"text_config": {"hidden_size": 16}, "id2label": {"0": "b", "1": "c"},
                                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert out["text_config"] == {"model_type": "t", "hidden_size": 16, "rope_theta": 5.0}  # sub-config: updated
    assert out["id2label"] == {"0": "b", "1": "c"}  # a plain dict value: replaced
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 7.0, "partial_rotary_factor": 0.5}
    assert out["rope_scaling"] == out["rope_parameters"] == yarn  # one setting under either spelling
    assert base["text_config"]["hidden_size"] == 8 and base["rope_scaling"]["rope_type"] == "linear"


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_yarn_override_extends_the_context_as_transformers_computes_it(lm_dir, tmp_path, key):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match="exceeds the model's context of 64"):
        Engine.from_pretrained(lm_dir, max_model_len=256, **OPTIONS)
    engine = Engine.from_pretrained(lm_dir, hf_overrides={key: yarn}, **OPTIONS)
    assert engine.max_model_len == 256  # vLLM's derived length: 64 x 4
    reference = tmp_path / "yarn"  # the same weights with the YaRN config written into config.json
    shutil.copytree(lm_dir, reference)
    cfg = json.loads((reference / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **yarn}
    (reference / "config.json").write_text(json.dumps(cfg))
    prompt = torch.randint(1, 1270, (150,), generator=torch.Generator().manual_seed(1)).tolist()  # past 64
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), request_id="y")
    scored = []
    while engine.has_unfinished():
        for o in engine.step():
            scored += o.prompt_logprobs or []
    got = torch.tensor([t.logprob for t in scored])
    want = torch.log_softmax(_hf_last_logits(reference, prompt)[:-1], -1)[torch.arange(149), prompt[1:]]
    plain = torch.log_softmax(_hf_last_logits(lm_dir, prompt)[:-1], -1)[torch.arange(149), prompt[1:]]
    assert got.shape == (149,) and float((got - want).abs().max()) < 1e-4
    assert float((plain - want)[64:].abs().max()) > 1e-2  # past the pretrained length YaRN changed the scores


def test_the_original_qwen3_reranker_scores_the_lms_yes_over_no(lm_dir):
    yes_no = _tokens(lm_dir, [412, 97])  # [false, true]
    engine = Engine.from_pretrained(lm_dir, max_model_len=64,
                                    hf_overrides={**RERANKER, "classifier_from_token": yes_no}, **OPTIONS)
    info = model_info_of(engine)
    assert (info.labels, info.label_activation, info.joins_pairs) == (("LABEL_0",), "sigmoid", True)
    prompt = torch.randint(1, 1270, (21,), generator=torch.Generator().manual_seed(2)).tolist()  # 3 chunks
    got = _pooled(engine, prompt)
    lm = _hf_last_logits(lm_dir, prompt)[-1]
    assert got.shape == (1,) and abs(float(got[0]) - float(lm[97] - lm[412])) < 1e-4
    p_yes = torch.softmax(lm[[412, 97]], 0)[1]  # the reranker's documented score
    assert abs(float(torch.sigmoid(got[0])) - float(p_yes)) < 1e-5
    with pytest.raises(ValueError, match="does not generate"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2))


def test_no_post_processing_gives_each_tokens_logit_also_with_tied_embeddings(demo_model_dir, tmp_path):
    path = save_tiny_qwen3(tmp_path / "tied", demo_model_dir, seed=12, tie_word_embeddings=True)
    ids = [7, 300, 1001]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": _tokens(path, ids),
                 "method": "no_post_processing", "id2label": {"0": "a", "1": "b", "2": "c"}}
    engine = Engine.from_pretrained(path, max_model_len=64, hf_overrides=overrides, **OPTIONS)
    assert model_info_of(engine).labels == ("a", "b", "c") and model_info_of(engine).label_activation == "softmax"
    prompt = list(range(40, 52))
    want = _hf_last_logits(path, prompt)[-1][ids]
    got = _pooled(engine, prompt)
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("overrides, message", [
    ({"classifier_from_token": ["a", "b"], "method": "from_2_way_softmax"}, "also set \"architectures\""),
    ({**RERANKER, "classifier_from_token": ["a", "b", "c"]}, "needs two classifier_from_token"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a"], "method": "mean"},
     "method must be one of"),
    ({**RERANKER, "classifier_from_token": "yes"}, "non-empty list"),
    ({**RERANKER, "classifier_from_token": ["a", "not-one-token"]}, "'not-one-token' is not one token"),
])
def test_a_conversion_that_cannot_be_built_fails_naming_the_field(lm_dir, overrides, message):
    with pytest.raises(ConfigError, match=message):
        Engine.from_pretrained(lm_dir, max_model_len=64, hf_overrides=overrides, **OPTIONS)
