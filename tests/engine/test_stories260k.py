"""A real trained model no one here wrote: llama2.c's stories260K, converted to a Hugging Face Llama checkpoint,
greedy-decoded from BOS by Ember, equals llama2.c's documented output character for character."""
from __future__ import annotations

import pytest

from ember.engine import convert_llama2c
from ember.engine.engine import Engine
from ember.engine.params import SamplingParams
from tests.conftest import shared_path



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
