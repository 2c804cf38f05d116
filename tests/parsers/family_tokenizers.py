"""Small byte-level BPE tokenizers with a model family's special tokens added as single tokens, for families whose real
vocabulary is not under ../shared/data (Llama 3, Mistral). Built in milliseconds, no download."""
from __future__ import annotations

from collections.abc import Sequence

CORPUS = ["Let me check the weather in Zürich for you.", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
          '[{"name": "f", "arguments": {"a": 1, "b": [true, false, null]}}]', 'f(a=1, b="x", c=[1, 2], d={"k": None})',
          "The answer is 42. Done; thanks!"] * 4


def byte_bpe(specials: Sequence[str], vocab_size: int = 600):
    """A `tokenizers.Tokenizer`: byte-level BPE trained on a few tool-call-like lines; ``specials`` are added as
    special tokens right after the 256 byte tokens' merges (each one token, never split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def ids_of(tok, specials: dict[str, int], *parts: str) -> list[int]:
    """Special parts as their token; other text tokenized."""
    out: list[int] = []
    for p in parts:
        out += [specials[p]] if p in specials else tok.encode(p, add_special_tokens=False).ids
    return out


def recorded_replies(folder: str) -> list[list[str]]:
    """The content deltas of the recorded vLLM chat streams in ../shared/data/outputs/dynamo/replays/``folder``
    (plain answers of real models, one list of deltas per stream); skips where ../shared is absent."""
    import json

    from tests.conftest import shared_path

    root = shared_path("outputs", "dynamo", "replays", folder)
    out = []
    for f in sorted(root.glob("chat-completion.streaming.*")):
        deltas = []
        for line in f.read_text().splitlines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if c:
                    deltas.append(c)
        out.append(deltas)
    assert out, root
    return out
