"""Request bodies whose JSON strings hold a lone UTF-16 surrogate are refused before any handler reads them.

``"\\ud800"`` is a valid JSON escape but not valid Unicode: a tokenizer, a response that echoes the string and the
SSE encoder all fail on it, which used to surface mid-request as a 500 or as a stream cut off after its headers.
`CheckedRoute` answers such a body with a 400 naming the field. Only bodies holding a surrogate escape at all are
parsed here (a byte search first), and the handler reuses the body Starlette cached.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

from .errors import bad_request

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_field(body: bytes) -> str | None:
    """The path (``messages[0].content``) of the first string in the JSON ``body`` that holds a lone surrogate, as a
    value or a key (a key names its object); None when there is none or the body is not JSON (validation says so)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        root = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _valid_unicode(value):
                return path or "body"
        elif isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not _valid_unicode(k):
                    return path or "body"
                items.append((v, f"{path}.{k}" if path else k))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


class CheckedRoute(APIRoute):
    """An API route that refuses a body with a lone surrogate (400 naming the field) before its handler runs."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method in _BODY_METHODS:
                field = lone_surrogate_field(await request.body())
                if field is not None:
                    raise bad_request(f"Invalid value for '{field}': the string holds a lone UTF-16 surrogate (an "
                                      "unpaired \\uD800-\\uDFFF escape), which is not valid Unicode", param=field)
            return await handler(request)

        return checked
