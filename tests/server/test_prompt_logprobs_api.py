"""`/v1/completions` with `echo` and `logprobs`: the prompt's tokens come back scored (what lm-evaluation-harness
reads for log-likelihood tasks), equal to the model's own log-softmax, streamed or not."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32).eval()


def test_echo_with_logprobs_scores_the_prompt(demo_server, demo_hf):
    client = demo_server.openai()
    text = "The capital of France is Paris"
    ids = demo_server.tokenizer.encode(text)
    r = client.completions.create(model=demo_server.model, prompt=text, max_tokens=1, temperature=0, logprobs=2,
                                  echo=True)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(text) and len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(demo_hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]), want, atol=1e-4)
    tb = demo_server.runtime.token_bytes.token_bytes
    for k in range(1, len(ids)):
        best = logp[k - 1].topk(2).indices.tolist()
        assert set(lp.top_logprobs[k]) == {tb(t).decode("utf-8", errors="replace") for t in best}
    assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)]) and lp.text_offset[len(ids)] == len(text)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    streamed = list(client.completions.create(model=demo_server.model, prompt=text, max_tokens=1, temperature=0,
                                              logprobs=2, echo=True, stream=True))
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    scores = [s for ch in streamed for c in ch.choices if c.logprobs for s in c.logprobs.token_logprobs]
    assert tokens == lp.tokens and scores == lp.token_logprobs
    assert "".join(c.text for ch in streamed for c in ch.choices) == c.text
