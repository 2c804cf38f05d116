"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` (``lora_name``, ``lora_path``) and
`POST /v1/unload_lora_adapter` (``lora_name``), served when ``--runtime-lora-updating`` or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` is given. The engine applies each between two steps; the adapter is then
listed by `/v1/models` and requests may name it (`ember.server.admission.check_model`). Success is vLLM's plain-text
line; a refusal is a 400 naming the field (404 for an adapter that is not loaded)."""
from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse

from . import protocol_openai as po
from .admission import state
from .errors import ApiError, bad_request

ENV_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
log = logging.getLogger("ember.server")


class LoadLoRAAdapterRequest(po._Lenient):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace the weights of an adapter already loaded under this name


class UnloadLoRAAdapterRequest(po._Lenient):
    lora_name: str
    lora_int_id: int | None = None


def enabled(config: Any) -> bool:
    """Whether the routes are served: the flag, or vLLM's environment switch."""
    return bool(config.runtime_lora_updating) or os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true")


def _loaded(request: Request) -> list[str]:
    return [name for name, _ in state(request).runtime.model_info.lora_adapters]


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    st = state(request)
    rt = st.runtime
    if not body.lora_name.strip():
        raise bad_request("lora_name is empty; give the adapter the name requests will send as model",
                          param="lora_name")
    if body.lora_name in (rt.model_name, *rt.model_aliases):
        raise bad_request(f"lora_name must be a new name, not {body.lora_name!r} (a name of the served model)",
                          param="lora_name")
    async with st.lora_updates:  # the check and the update as one, against a concurrent call on the same name
        loaded = body.lora_name in _loaded(request)
        if loaded and not body.load_inplace:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the "
                              f"adapter in place, set 'load_inplace' to True.", param="lora_name")
        try:
            await rt.engine.update_lora(body.lora_name, body.lora_path)
        except ValueError as e:
            raise bad_request(str(e), param="lora_name" if "unfinished request" in str(e) else "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    st = state(request)
    async with st.lora_updates:
        if body.lora_name not in _loaded(request):
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="not_found")
        try:
            await st.runtime.engine.update_lora(body.lora_name, None)
        except ValueError as e:
            raise bad_request(str(e), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_routes(app: Any, dependencies: list[Any]) -> None:
    """Serve the routes on `app`, behind `dependencies` (the app's API-key check), when enabled."""
    config = app.state.ember.config
    if enabled(config) and not config.enable_lora:  # the flag is refused so; the environment switch is deployment-wide
        log.warning("%s is set but LoRA is off: the adapter routes answer 400 until the server starts with "
                    "--enable-lora", ENV_SWITCH)
    if enabled(config):
        app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"], dependencies=dependencies)
        app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"],
                          dependencies=dependencies)
