"""What every API route checks before its handler reads the body: the API key (a route that depends on
`require_api_key` answers 401 before reading anything), the body's Content-Encoding (none is decoded), a client that
hangs up while sending it (499), JSON strings holding a lone UTF-16 surrogate, and numbers JSON has not (NaN,
Infinity, 1e309).

``"\\ud800"`` is a valid JSON escape but not valid Unicode: a tokenizer, a response that echoes the string and the
SSE encoder all fail on it, which used to surface mid-request as a 500 or as a stream cut off after its headers.
Python's JSON reader also takes ``NaN`` and overflows ``1e309`` to infinity, which a response echoing a tool schema
cannot write. `CheckedRoute` answers such a body with a 400 naming the field. Only bodies holding such a spelling
at all are parsed here (a byte search first), and the handler reuses the body Starlette cached.
"""
from __future__ import annotations

import email.message
import json
import logging
import math
import re
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import get_route_path

from .admission import require_api_key
from .errors import ApiError, bad_request

log = logging.getLogger("ember.server")

_SURROGATE_SPELLING = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # escaped, or as raw bytes
_NON_FINITE = re.compile(rb"NaN|Infinity|[eE][+]?[0-9]{3}|[0-9]{309}")  # a long enough decimal overflows too
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def invalid_field(body: bytes) -> tuple[str, str] | None:
    """The path (``messages[0].content``) of the first value in the JSON ``body`` that no handler can use, and why: a
    string holding a lone surrogate (as a value, or a key: a key names its object), or a number that is NaN,
    Infinity or beyond a double's range (JSON has no such numbers; Python's reader lets them through, and a
    response that echoes them is no JSON). None when there is none or the body is not JSON (validation says so).
    Only bodies holding such a spelling at all are parsed (a byte search first)."""
    if not (_SURROGATE_SPELLING.search(body) or _NON_FINITE.search(body)):
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
                return path or "body", _SURROGATE
        elif isinstance(value, float):
            if not math.isfinite(value):
                return path or "body", _NON_FINITE_WHY.format(value)
        elif isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not _valid_unicode(k):
                    return path or "body", _SURROGATE
                items.append((v, f"{path}.{k}" if path else k))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


_SURROGATE = ("the string holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape or its bytes), which is "
              "not valid Unicode")
_NON_FINITE_WHY = "{} is not a finite JSON number (JSON has no NaN or Infinity; a number past a double's range is one)"


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json`` or ``application/*+json``), as FastAPI reads it."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def content_type_error(content_type: str | None) -> ApiError:
    got = f"got '{content_type}'" if content_type else "the request has none"
    return bad_request(f"Content-Type must be application/json ({got})")


def _needs_key(dependant: Dependant) -> bool:
    return any(d.call is require_api_key or _needs_key(d) for d in dependant.dependencies)


class CheckedRoute(APIRoute):
    """An API route that checks the API key (when it depends on `require_api_key`), then refuses an encoded body
    (400 ``json_invalid``) and a body with a lone surrogate (400 naming the field), before its handler runs; an
    unexpected exception in the handler is logged once and answered as a 500 `ApiError` (one that reached
    Starlette's last-resort handler was logged twice and closed the keep-alive connection)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        needs_key = _needs_key(self.dependant)

        async def checked(request: Request) -> Response:
            if needs_key:
                await require_api_key(request)
            if request.method in _BODY_METHODS:
                encoding = request.headers.get("content-encoding", "").strip()
                if encoding.lower() not in ("", "identity"):
                    raise bad_request(f"Content-Encoding {encoding} is not supported: send the body uncompressed",
                                      code="json_invalid")
                try:
                    body = await request.body()
                except ClientDisconnect:
                    raise ApiError(499, "the client closed the connection") from None
                charset = json.detect_encoding(body) if body else "utf-8"
                if charset not in ("utf-8", "utf-8-sig"):
                    raise bad_request(f"Request body is not valid JSON: it is not UTF-8 (it reads as {charset})",
                                      code="json_invalid")
                found = invalid_field(body)
                if found is not None:
                    field, why = found
                    raise bad_request(f"Invalid value for '{field}': {why}", param=field)
            try:
                return await handler(request)
            except (ApiError, HTTPException, RequestValidationError):
                raise
            except Exception as e:  # a bug: answered here, as a 500 whose connection stays usable
                log.exception("unhandled error on %s", get_route_path(request.scope))
                raise ApiError(500, f"internal error: {type(e).__name__}") from None

        return checked
