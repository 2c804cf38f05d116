"""API errors and their two wire shapes: OpenAI error objects and Anthropic error events.

Handlers raise `ApiError`; the app turns it into the shape of the API the request came through (paths under
`/v1/messages` get Anthropic's, everything else OpenAI's). Validation failures become 400 naming the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# HTTP status -> OpenAI error type.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


@dataclass
class ApiError(Exception):
    """An error answered to the client; `param` names the offending request field when there is one."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    anthropic_message: str | None = None  # the message in Anthropic's own wording, where clients key off it
    details: dict[str, Any] | None = None  # Anthropic's machine-readable ``error.details`` (e.g. its error_code)

    def __str__(self) -> str:
        return self.message


THREAD_UNSUPPORTED = "thread_unsupported"
"""The validation error type of an Anthropic request that names a message thread (``thread``), which Ember does not
keep: answered with Anthropic's ``thread_unsupported_request`` details."""


def prompt_too_long(message: str, param: str, tokens: int, maximum: int) -> ApiError:
    """The 400 ``context_length_exceeded`` for a prompt of ``tokens`` (or a lower bound) over ``maximum``, the most
    prompt tokens the context (or the cache or prefill limit that binds) takes: on the Anthropic routes worded as
    Anthropic's (``prompt is too long: N tokens > M maximum``, two integers), which Claude Code reads to compact the
    conversation."""
    return ApiError(400, message, param=param, code="context_length_exceeded",
                    anthropic_message=f"prompt is too long: {tokens} tokens > {maximum} maximum")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def openai_error_body(err: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": _OPENAI_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error"),
            "param": err.param,
            "code": err.code,
        }
    }


ANTHROPIC_REQUEST_ID = "anthropic_request_id"
"""The key of an Anthropic request's ``request-id`` in its ASGI scope's ``state``."""


def anthropic_error_body(err: ApiError, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape, which has no ``param`` (the message names the field itself), with the request's
    ``request_id`` where it has one."""
    etype = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    message = err.anthropic_message or message
    body: dict[str, Any] = {"type": etype, "message": message}
    if err.details:
        body["details"] = err.details
    out: dict[str, Any] = {"type": "error", "error": body}
    if request_id is not None:
        out["request_id"] = request_id
    return out


def anthropic_style(path: str, headers: Mapping[str, str]) -> bool:
    """Whether a request may be answered in Anthropic's shape: a `/v1/messages` route, or any path asked with an
    ``anthropic-version`` header (the Anthropic SDK sends it on every request)."""
    return path.startswith("/v1/messages") or "anthropic-version" in headers


def is_anthropic_request(path: str, headers: Mapping[str, str]) -> bool:
    """Whether an error to this request takes Anthropic's shape: a `/v1/messages` route, or the models routes both
    APIs share asked with an ``anthropic-version`` header (as the Anthropic SDK sends)."""
    return path.startswith("/v1/messages") or (path.startswith("/v1/models") and "anthropic-version" in headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[a-z-]+\[.*\]|function-[a-z]+|tagged-union|"
                       r"[A-Z][A-Za-z]+)$")


def field_path(loc: Sequence[Any]) -> str:
    """`("body", "messages", 0, "role")` -> `messages[0].role` (the request field, without the `body` root or a
    query parameter's `query`, without pydantic's union-member tags such as `str` or `list[...]` or model class
    names, and without the tag value a discriminated list's item carries after its index)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    tagged = False  # the last tag was a discriminated union's: its item's tag value follows the index
    for p in parts:
        if isinstance(p, str) and _TYPE_TAG.match(p):
            tagged = "tagged-union[" in p
            continue
        if isinstance(p, int):
            out += f"[{p}]"
            continue
        if tagged:
            tagged = False
            continue
        out += ("." if out else "") + str(p)
    return out


_LOOKED_AT = 256  # errors `_first_error` reads: a body of a million bad items has a million


def _first_error(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: the first, or the deepest error inside the field it names (a union whose string member
    fails first while its list member names the bad item)."""
    first = errors[0]
    name = field_path(first.get("loc", ()))
    inside = [e for e in errors[1:_LOOKED_AT]
              if name and field_path(e.get("loc", ())).startswith((name + "[", name + "."))]
    return max(inside, key=lambda e: len(field_path(e.get("loc", ())))) if inside else first


def validation_error(errors: Sequence[dict[str, Any]]) -> ApiError:
    """A 400 from pydantic/FastAPI validation errors, naming the first bad field."""
    if not errors:
        return bad_request("Invalid request body")
    first = _first_error(errors)
    loc = first.get("loc", ())
    name = field_path(loc)
    if first.get("type") == "union_tag_invalid" and name:  # the tag itself is the bad field
        name += "." + str((first.get("ctx") or {}).get("discriminator", "type")).strip("'")
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == THREAD_UNSUPPORTED:  # the SDK's tool runner then resends the whole conversation
        return ApiError(400, msg, param="thread",
                        details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]})
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", msg)
        return bad_request(f"Request body is not valid JSON: {detail}", code="json_invalid")
    if not name:
        return bad_request(f"Invalid request body: {msg}")
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return bad_request(f"Invalid value for '{name}': {msg}{more}", param=name)
