"""vLLM's score and rerank routes for embedding models: `POST /v1/score` (``text_1`` against ``text_2``) and
`POST /v1/rerank` (Jina's and Cohere's shape: a ``query`` against ``documents``, best first), each also under the
paths vLLM serves them (`/score`; `/rerank`, `/v2/rerank`).

With an embedding model (a bi-encoder), a score is the cosine similarity of the two texts' embeddings
(`ember.server.embeddings_api.embed`, the model's pooling). With a one-class classification model (a cross-encoder
such as a ``Qwen3ForSequenceClassification`` conversion of Qwen3-Reranker), the two texts are read together (joined
into one text where the config says ``use_pad_token: false``, as for a converted causal LM; else as the tokenizer
encodes a text pair) and the score is the class logit under the checkpoint's activation, as vLLM scores them
(`ModelInfo.score_activation`: the sentence-transformers activation config.json names, else sigmoid).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Request
from pydantic import field_validator

from . import protocol_openai as po
from .admission import check_model, model_label, state, tokens_to_keep
from .embeddings_api import (MAX_INPUTS, ActivationSwitch, align, check_count, embed, keep_last, pool, prompt_limit,
                             too_few, too_long)
from .errors import bad_request
from .generation import ModelRuntime

MAX_PAIRS = MAX_INPUTS - 1
"""Texts one request may score against its query (``documents``, ``text_2``): with the query, `MAX_INPUTS`."""


class _Scored(ActivationSwitch):
    """What score and rerank requests share: the model, and the switch of a cross-encoder's activation (a
    bi-encoder's cosine has none)."""

    model: str | None = None


class ScoreRequest(_Scored):
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: po.TruncatePromptTokens = None


class RerankRequest(_Scored):
    query: str
    documents: list[str]

    @field_validator("documents", mode="before")
    @classmethod
    def _document_texts(cls, value: Any) -> Any:
        """Cohere's and Jina's document objects (``{"text": ...}``) stand for their text."""
        if isinstance(value, list):
            return [d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else d for d in value]
        return value
    top_n: int = 0  # 0 or less: every document (vLLM's rule; clients send -1 for all)
    return_documents: bool = True
    truncate_prompt_tokens: po.TruncatePromptTokens = None


SCORE_ACTIVATIONS: dict[str, Callable[[float], float]] = {
    "identity": lambda x: x, "sigmoid": lambda x: 0.5 * (1.0 + math.tanh(0.5 * x)), "tanh": math.tanh,
    "relu": lambda x: max(x, 0.0)}
"""A cross-encoder's score of its class logit, by `ModelInfo.score_activation`."""


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def _pairs(body: ScoreRequest) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    """The distinct texts of each side and the pairs to score, by vLLM's rules: one text against each of the others,
    or two lists of the same length pairwise."""
    left = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    right = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not left or not right:
        raise bad_request("text_1 and text_2 must not be empty", param="text_1" if not left else "text_2")
    if len(left) == 1:
        return left, right, [(0, j) for j in range(len(right))]
    if len(left) != len(right):
        raise bad_request(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or lists of the "
                          "same length (scored pairwise)", param="text_2")
    return left, right, [(i, i) for i in range(len(left))]


def _cross_encoder(rt: ModelRuntime) -> bool:
    """Whether the served model scores text pairs itself (a one-class classifier); a 400 for other classifiers."""
    labels = rt.model_info.labels
    if labels and len(labels) != 1:
        raise bad_request(f"this classifier has {len(labels)} classes; scoring needs a one-class model (a "
                          f"cross-encoder) or an embedding model", param="model")
    return bool(labels)


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """How many tokens of two texts of ``n1`` and ``n2`` tokens a fast tokenizer's ``truncation="longest_first"`` keeps
    within ``room`` tokens: the shorter whole where it takes at most half the room and the longer the rest, else half
    each (the odd token to the longer)."""
    if n1 + n2 <= room:
        return n1, n2
    short = min(n1, n2)
    kept = (short, room - short) if 2 * short <= room else (room // 2, room // 2 + room % 2)
    return kept if n1 <= n2 else (kept[1], kept[0])


def _cut_pair(full: list[int], a: list[int], b: list[int], keep: int, side: str) -> list[int] | None:
    """The positions of ``full`` (texts ``a`` and ``b`` encoded as a pair) that the pair keeps in ``keep`` tokens, as
    ``tokenizer(a, b, truncation="longest_first", max_length=keep)`` cuts it: every special token, and the texts
    trimmed at ``side`` (the tokenizer's ``truncation_side``); None where the texts cannot be found in ``full``."""
    at = align(full, [a, b])
    if at is None:
        return None
    specials = len(full) - len(a) - len(b)
    if keep < specials:
        raise too_few(keep, specials)
    n1, n2 = longest_first(len(a), len(b), keep - specials)
    cut = set()
    for start, n, kept in ((at[0], len(a), n1), (at[1], len(b), n2)):
        cut.update(range(start + kept, start + n) if side == "right" else range(start, start + n - kept))
    return [j for j in range(len(full)) if j not in cut]


def _pair_encodings(tok: Any, firsts: list[str],
                    seconds: list[str]) -> tuple[list[list[int]], list[list[int] | None]]:
    """Each pair's token IDs and token types (None: the tokenizer writes none) as the tokenizer encodes that pair on
    its own: a pair whose second text is empty is its first text alone, as ``tokenizer(a, "")`` encodes it (a batched
    call would add an empty second segment)."""
    ids: list[list[int]] = [[] for _ in firsts]
    types: list[list[int] | None] = [None] * len(firsts)
    for alone in (False, True):
        rows = [i for i, b in enumerate(seconds) if (b == "") == alone]
        if not rows:
            continue
        enc = tok([firsts[i] for i in rows], None if alone else [seconds[i] for i in rows],
                  return_token_type_ids=True)
        for k, i in enumerate(rows):
            ids[i] = list(enc["input_ids"][k])
            types[i] = list(enc["token_type_ids"][k]) if enc.get("token_type_ids") else None
    return ids, types


def _pair_ids(rt: ModelRuntime, firsts: list[str], seconds: list[str],
              keep: int | None) -> tuple[list[list[int]], list[int | None]]:
    """Each pair's tokens as vLLM builds them, with where its second text's token type begins (None: the tokenizer
    writes none): the two texts joined into one (a converted LM reranker), cut as one text is (`keep_last`), or the
    tokenizer's encoding of the pair (`_pair_encodings`), cut to ``keep`` tokens as `_cut_pair` says (its plain last
    ``keep`` tokens where the texts cannot be found in it)."""
    tok = rt.tokenizer
    if rt.model_info.joins_pairs:
        joined = [a + b for a, b in zip(firsts, seconds)]
        ids = [list(x) for x in tok(joined)["input_ids"]]
        if keep and (long := [i for i, x in enumerate(ids) if len(x) > keep]):
            for i, content in zip(long, tok([joined[i] for i in long], add_special_tokens=False)["input_ids"]):
                ids[i] = keep_last(ids[i], list(content), keep)
        return ids, [len(x) for x in ids]
    ids, types = _pair_encodings(tok, firsts, seconds)
    if keep and (long := [i for i, x in enumerate(ids) if len(x) > keep]):
        side = getattr(tok, "truncation_side", "right")
        texts_a = tok([firsts[i] for i in long], add_special_tokens=False)["input_ids"]
        texts_b = tok([seconds[i] for i in long], add_special_tokens=False)["input_ids"]
        for i, a, b in zip(long, texts_a, texts_b):
            kept = _cut_pair(ids[i], list(a), list(b), keep, side)
            if kept is None:
                kept = list(range(len(ids[i]) - keep, len(ids[i])))
            ids[i] = [ids[i][j] for j in kept]
            if (t := types[i]) is not None:
                types[i] = [t[j] for j in kept]
    return ids, [None if t is None else next((j for j, v in enumerate(t) if v), len(t)) for t in types]


def _pair_prompts(rt: ModelRuntime, firsts: list[str], seconds: list[str], first_params: list[str],
                  params: list[str], keep: int | None) -> tuple[list[list[int]], list[int | None]]:
    """`_pair_ids`, with a 400 naming ``first_params[i]`` where the first pair over the model's limit is so because
    its first text alone is (a query too long whatever it is paired with); `pool` names the second text of others."""
    if not keep:
        for first, second, first_param, param in zip(firsts, seconds, first_params, params):
            rt.check_text_size(first, first_param)
            rt.check_text_size(first + second, param)
    ids, type_starts = _pair_ids(rt, firsts, seconds, keep)
    limit = prompt_limit(rt)
    over = next((i for i, x in enumerate(ids) if len(x) > limit), None)
    if over is not None and (n := len(rt.tokenizer(firsts[over])["input_ids"])) > limit:
        raise too_long(n, rt, first_params[over])
    return ids, type_starts


async def _pair_scores(request: Request, rt: ModelRuntime, firsts: list[str], seconds: list[str],
                       first_params: list[str], params: list[str], truncate: int | None,
                       lora: str | None, activates: bool = True) -> tuple[list[float], int, str]:
    """A cross-encoder's score of each (first, second) pair (its activated logit, or the raw one unless
    ``activates``), their token count and the request id; errors name ``first_params[i]`` or ``params[i]``, the
    fields the pair's texts came from."""
    keep = tokens_to_keep(truncate, prompt_limit(rt))
    ids, type_starts = await asyncio.to_thread(_pair_prompts, rt, firsts, seconds, first_params, params, keep)
    logits, total, rid = await pool(request, ids, params, truncate=None, lora=lora, type_starts=type_starts)
    act = SCORE_ACTIVATIONS[rt.model_info.score_activation if activates else "identity"]
    return [act(float(row[0])) for row in logits], total, rid


async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    st = state(request)
    lora = check_model(st, body.model)
    left, right, pairs = _pairs(body)
    check_count(len(right), MAX_PAIRS, "texts in text_2", "text_2")
    p1 = [f"text_1[{i}]" for i in range(len(left))] if isinstance(body.text_1, list) else ["text_1"]
    p2 = [f"text_2[{j}]" for j in range(len(right))] if isinstance(body.text_2, list) else ["text_2"]
    if _cross_encoder(st.runtime):
        scores, total, rid = await _pair_scores(request, st.runtime, [left[i] for i, _ in pairs],
                                                [right[j] for _, j in pairs], [p1[i] for i, _ in pairs],
                                                [p2[j] for _, j in pairs], body.truncate_prompt_tokens, lora,
                                                body.activates)
    else:
        vectors, total, rid = await embed(request, left + right, p1 + p2, truncate=body.truncate_prompt_tokens,
                                          lora=lora)
        scores = [_cosine(vectors[i], vectors[len(left) + j]) for i, j in pairs]
    data = [{"index": k, "object": "score", "score": v} for k, v in enumerate(scores)]
    return {"id": f"score-{rid}", "object": "list", "created": int(time.time()),
            "model": model_label(st, lora), "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0}}


async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    st = state(request)
    lora = check_model(st, body.model)
    if not body.documents:
        raise bad_request("documents must not be empty", param="documents")
    check_count(len(body.documents), MAX_PAIRS, "documents", "documents")
    params = [f"documents[{i}]" for i in range(len(body.documents))]
    if _cross_encoder(st.runtime):
        scores, total, rid = await _pair_scores(request, st.runtime, [body.query] * len(body.documents),
                                                body.documents, ["query"] * len(body.documents), params,
                                                body.truncate_prompt_tokens, lora, body.activates)
    else:
        vectors, total, rid = await embed(request, [body.query, *body.documents], ["query", *params],
                                          truncate=body.truncate_prompt_tokens, lora=lora)
        scores = [_cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n > 0:
        order = order[:body.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        results.append(item)
    return {"id": f"rerank-{rid}", "model": model_label(st, lora), "results": results,
            "usage": {"prompt_tokens": total, "total_tokens": total}}


def add_routes(app: Any, dependencies: list[Any]) -> None:
    """Serve the routes on `app`, behind `dependencies` (the app's API-key check)."""
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"], dependencies=dependencies)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], dependencies=dependencies)
