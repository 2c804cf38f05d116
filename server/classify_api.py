"""vLLM's `POST /classify` (also `/v1/classify`) for a classification model (`ember.engine.models.classifier`): each
input (or a ``messages`` conversation, as `/v1/embeddings` takes them) is one engine pooling request whose result is
the head's logits, answered as the class probabilities and the most probable label.

Probabilities are a softmax over the classes, or each class's sigmoid when the model has one class or config.json's
``problem_type`` is ``multi_label_classification`` (as transformers trains them); ``use_activation: false`` (vLLM's
field, also spelled ``activation``) gives the raw logits.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import Request

from .admission import check_model, model_label, state
from .embeddings_api import ActivationSwitch, PoolingInputs, pool
from .errors import bad_request
from .generation import ModelRuntime


class ClassifyRequest(PoolingInputs, ActivationSwitch):
    pass


def require_classifier(rt: ModelRuntime) -> tuple[str, ...]:
    """The served model's class labels; a 400 naming ``model`` when it is not a classifier."""
    labels = rt.model_info.labels
    if not labels:
        raise bad_request(f"this model ({rt.model_info.architecture}) is not a classifier: /classify needs a "
                          f"...ForSequenceClassification checkpoint", param="model")
    return labels


def activated(logits: list[float], sigmoid: bool) -> np.ndarray:
    """Probabilities from a classifier's logits: each class's sigmoid, or a softmax over them."""
    x = np.asarray(logits, dtype=np.float64)
    if sigmoid:
        return 1.0 / (1.0 + np.exp(-x))
    e = np.exp(x - x.max())
    return e / e.sum()


async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
    st = state(request)
    rt = st.runtime
    lora = check_model(st, body.model)
    labels = require_classifier(rt)
    inputs, params, add_special = await body.resolved(rt)
    logits, total, rid = await pool(request, inputs, params, truncate=body.truncate_prompt_tokens,
                                    add_special_tokens=add_special, lora=lora)
    use = body.activates
    sigmoid = rt.model_info.label_activation == "sigmoid"
    data = []
    for i, row in enumerate(logits):
        probs = activated(row, sigmoid) if use else np.asarray(row, dtype=np.float64)
        data.append({"index": i, "label": labels[int(np.argmax(row))], "probs": probs.tolist(),
                     "num_classes": len(labels)})
    return {"id": f"classify-{rid}", "object": "list", "created": int(time.time()), "model": model_label(st, lora),
            "data": data, "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0}}


def add_routes(app: Any, dependencies: list[Any]) -> None:
    """Serve the routes on `app`, behind `dependencies` (the app's API-key check)."""
    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, classify, methods=["POST"], dependencies=dependencies)
