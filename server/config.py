"""Options of `ember serve`, as one plain dataclass shared by the CLI, the app factory and tests."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.engine.args import EngineArgs, SettingValueError, checked_by, parse_json_object


@dataclass
class ServeConfig(EngineArgs):
    """How to load the model and run the HTTP server; the engine's settings are the inherited `EngineArgs` fields.

    `model_dir` None means the built-in demo model (built once into the cache directory). `chat_template` is a
    path to a Jinja file or the template text. `reasoning_parser` / `tool_parser` name a parser profile (or
    "none" to switch that part off); unset, the profile is detected from the chat template and model type.
    Every field with ``help`` metadata is a flag of `ember serve` (`ember.engine.args.add_flags`).
    """

    model_dir: Path | None = field(default=None, metadata={
        "help": "a Hugging Face model id (ORG/NAME[@REVISION]) or a checkpoint directory; default: the demo model",
        "positional": True, "metavar": "MODEL", "type": lambda text: parse_model_arg(text)})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on", "min": 0, "max": 65535})
    api_key: tuple[str, ...] = field(default=(), metadata={
        "help": "require one of these keys (Authorization: Bearer or x-api-key): --api-key K1 K2, or the flag "
                "repeated; default: $VLLM_API_KEY where set (as vLLM), else none (no key needed)",
        "action": "extend", "nargs": "+", "metavar": "KEY", "type": lambda text: parse_api_key(text)})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model name clients send, and more names that also reach the model (vLLM's several names; "
                "responses carry the first); default: the Hugging Face id, or the directory's name",
        "nargs": "+", "metavar": "NAME", "type": lambda text: parse_model_name(text)})
    served_model_aliases: tuple[str, ...] = ()  # the names after the first of --served-model-name (set by the CLI)
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "parser profile for reasoning, or 'none'; default: detected from the chat template and model type",
        "type": lambda text: parse_profile_name(text)})
    tool_parser: str | None = field(default=None, metadata={
        "help": "parser profile for tool calls, or 'none'; default: detected from the chat template and model type",
        "type": lambda text: parse_profile_name(text)})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template file (or its text, when it contains '{', '}' or a newline); default: the "
                "model's own",
        "type": lambda text: parse_chat_template(text)})
    chat_template_content_format: str = field(default="auto", metadata={
        "help": "how the chat template receives message content: 'string' (text parts joined with newlines), "
                "'openai' (every content a list of {type: text, text} parts) or 'auto' (a string, unless the "
                "template loops over message content: then as the client sent it)",
        "choices": ("auto", "string", "openai")})
    response_role: str = field(default="assistant", metadata={
        "help": "the role chat completions give the reply when the request adds a generation prompt (its "
                "default); without one, the reply takes the last message's role, as in vLLM"})
    enable_log_requests: bool = field(default=False, metadata={
        "help": "log one line per request as it reaches the engine (its prompt text and token IDs, and the sampling "
                "settings that differ from their defaults) and one as it ends (reason, token counts, seconds)"})
    max_log_len: int | None = field(default=None, metadata={
        "help": "cut a logged prompt to this many characters and token IDs; default: whole", "metavar": "N",
        "min": 0})
    max_waiting: int = field(default=1024, metadata={"help": "answer 503 while this many requests wait", "min": 1})
    shutdown_timeout: float = field(default=5.0, metadata={
        "help": "on SIGTERM or SIGINT, stop accepting and give the requests in flight this many seconds to finish; "
                "then their connections are closed and the server exits (below Docker's 10 s stop grace)",
        "metavar": "SECONDS", "min": 0})
    max_n: int = 16  # largest `n` a request may ask for
    log_level: str = field(default="info", metadata={"help": "log level",
                                                     "choices": ("debug", "info", "warning", "error")})
    in_process: bool = field(default=False, metadata={
        "help": "run the engine loop in a thread of the server process instead of its own engine process"})
    revision: str | None = field(default=None, metadata={
        "help": "branch, tag or commit of a Hugging Face model id (same as ORG/NAME@REVISION); default: the main "
                "branch"})
    download_dir: Path | None = field(default=None, metadata={
        "help": "download Hugging Face models here; default: the Hugging Face cache ($HF_HOME/hub)",
        "type": lambda text: parse_download_dir(text)})
    allowed_origins: tuple[str, ...] = field(default=(), metadata={
        "help": "allow browser requests (CORS) from this origin, e.g. http://localhost:3000 or *, or from each of "
                "vLLM's JSON list ('[\"http://a\", \"http://b\"]'); repeatable; default: none (CORS off)",
        "action": "extend", "metavar": "ORIGIN", "type": lambda text: parse_origins(text)})
    allow_credentials: bool = field(default=False, metadata={
        "help": "CORS: let browser requests from --allowed-origins carry credentials (cookies, Authorization)"})
    allowed_methods: tuple[str, ...] = field(default=(), metadata={
        "help": "CORS: allow these HTTP methods (one, or vLLM's JSON list '[\"GET\", \"POST\"]'); repeatable; "
                "default: all", "action": "extend", "metavar": "METHOD",
        "type": lambda text: parse_cors_list(text, "method")})
    allowed_headers: tuple[str, ...] = field(default=(), metadata={
        "help": "CORS: allow these request headers (one, or vLLM's JSON list); repeatable; default: all",
        "action": "extend", "metavar": "HEADER", "type": lambda text: parse_cors_list(text, "header")})
    enable_server_load_tracking: bool = field(default=False, metadata={
        "help": "count the generation and pooling requests being served, for GET /load's server_load (0 without "
                "this flag, as in vLLM)"})
    responses_store_size: int = field(default=1024, metadata={
        "help": "keep this many /v1/responses results in memory (store: true) for previous_response_id and "
                "GET /v1/responses/ID, least recently used out first; 0 stores none", "min": 0})
    generation_config: str = field(default="auto", metadata={
        "help": "the defaults of requests that leave them unset, from generation_config.json's temperature, "
                "top_p, top_k, min_p, repetition_penalty and max_new_tokens (the length of a chat or responses "
                "reply that sets no limit): 'auto' reads the model's (as vLLM does), a folder its own, 'vllm' none "
                "(temperature 1, no truncation, no penalty, replies up to the context's end); default: auto",
        "type": lambda text: parse_generation_config(text)})
    sse_keepalive_seconds: float = field(default=15.0, metadata={
        "help": "send an SSE comment (': keep-alive') on a stream that has been silent this long (prefill, "
                "thinking); 0 switches it off", "min": 0})
    pooler_config: str | None = field(default=None, metadata={
        "help": "how /v1/embeddings pools the hidden states, as JSON: {\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", "
                "\"normalize\": true|false}; default: the checkpoint's sentence-transformers modules.json, else "
                "LAST, normalized",
        "type": checked_by(lambda text: _pooler_config(text))})
    override_generation_config: str | None = field(default=None, metadata={
        "help": "JSON object of sampling defaults set over --generation-config's, e.g. '{\"temperature\": 0.5}' "
                "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); a request's own values "
                "still win",
        "type": checked_by(lambda text: parse_override_generation_config(text)), "metavar": "JSON"})
    default_chat_template_kwargs: str | None = field(default=None, metadata={
        "help": "JSON object of chat-template variables every request gets unless its chat_template_kwargs set "
                "them, e.g. '{\"enable_thinking\": false}'",
        "type": checked_by(parse_json_object), "metavar": "JSON"})
    return_tokens_as_token_ids: bool = field(default=False, metadata={
        "help": "name each token in logprobs 'token_id:N' (its bytes unchanged), so a token that is not valid "
                "UTF-8 on its own stays identifiable; a request's return_tokens_as_token_ids overrides it"})
    enable_force_include_usage: bool = field(default=False, metadata={
        "help": "end every streamed chat or text completion with a usage chunk, as if it asked for "
                "stream_options.include_usage"})
    enable_request_id_headers: bool = field(default=False, metadata={
        "help": "give every response an X-Request-Id header: the request's own, else a random one (a chat or text "
                "completion's id carries the request's X-Request-Id either way)"})
    uvicorn_log_level: str | None = field(default=None, metadata={
        "help": "uvicorn's log level (its access log and server messages); default: --log-level",
        "choices": ("critical", "error", "warning", "info", "debug", "trace")})
    disable_uvicorn_access_log: bool = field(default=False, metadata={
        "help": "do not log one line per HTTP request"})
    ssl_keyfile: Path | None = field(default=None, metadata={
        "help": "serve HTTPS with this private key (PEM; its certificate is given too)", "metavar": "PATH",
        "type": lambda text: parse_existing_file(text)})
    ssl_certfile: Path | None = field(default=None, metadata={
        "help": "serve HTTPS with this certificate chain (PEM; its private key is given too)", "metavar": "PATH",
        "type": lambda text: parse_existing_file(text)})
    root_path: str = field(default="", metadata={
        "help": "the path prefix a proxy serves this server under (ASGI root_path, set on the app as vLLM does): "
                "routes answer under it and at their own paths, and the generated docs link under it"})
    hf_token: str | None = field(default=None, repr=False, metadata={
        "help": "the Hugging Face token for downloading gated or private models (default: $HF_TOKEN, or the one "
                "saved by 'hf auth login')", "metavar": "TOKEN"})
    disable_fastapi_docs: bool = field(default=False, metadata={
        "help": "do not serve the generated API docs (/docs, /redoc, /openapi.json)"})
    runtime_lora_updating: bool = field(default=False, metadata={
        "help": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora); vLLM's "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also turns them on", "requires": "enable_lora"})
    classifier_flag: str | None = None  # vLLM's `--convert classify` / `--task classify|score`, as given: the
    # checkpoint must then be a classifier (checked once it is loaded); not a flag of its own


def parse_override_generation_config(text: str) -> dict[str, Any]:
    """`--override-generation-config`: a JSON object of the sampling defaults Ember applies."""
    from .sampling_defaults import SamplingDefaults

    value = parse_json_object(text)
    SamplingDefaults.from_generation_config(value, "the JSON", strict=True)
    return value


def parse_api_key(text: str) -> str:
    """`--api-key`: a key a client can send (an HTTP header drops the whitespace around its value); the message
    never shows the key."""
    if not text.strip():
        raise SettingValueError("an empty key would refuse every request (leave the flag out to need no key)")
    if text != text.strip():
        raise SettingValueError("the key starts or ends with whitespace, which HTTP headers drop: no client could "
                                "send it")
    return text


def parse_origins(text: str) -> list[str]:
    """`--allowed-origins`: one origin, or vLLM's JSON list of them."""
    return parse_cors_list(text, "origin")


def parse_cors_list(text: str, kind: str) -> list[str]:
    """A CORS flag's value: one ``kind`` (origin, method, header), or vLLM's JSON list of them."""
    if not text.lstrip().startswith("["):
        if not text.strip():
            raise SettingValueError(f"{text!r} is empty; give one {kind} or a JSON list of {kind}s")
        return [text]
    try:
        value = json.loads(text)
    except ValueError as e:
        raise SettingValueError(f"{text!r} is neither one {kind} nor a JSON list of {kind}s ({e})") from None
    if not isinstance(value, list) or not all(isinstance(o, str) and o for o in value):
        raise SettingValueError(f"{text!r}: a JSON list of {kind}s holds non-empty strings only")
    return value


def parse_model_name(text: str) -> str:
    """`--served-model-name`: a name a client can send, not empty or only whitespace."""
    if not text.strip():
        raise SettingValueError(f"{text!r} is empty; give the name clients send as 'model'")
    return text


def parse_existing_file(text: str) -> Path:
    p = Path(text).expanduser()
    if not p.is_file():
        raise SettingValueError(f"{text}: no such file")
    return p


def parse_chat_template(text: str) -> str:
    """`--chat-template`: template text when it contains `{`, `}` or a newline (vLLM's rule), else the path of a
    readable UTF-8 file (SettingValueError otherwise). Returns the value unchanged; `chat.load_chat_template` reads
    it."""
    if any(c in text for c in "{}\n"):
        return text
    p = Path(text).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "no such file"
        raise SettingValueError(f"{text}: {what} (a template file, or template text containing '{{' or '}}')")
    try:
        p.read_text(encoding="utf-8")
    except OSError as e:
        raise SettingValueError(f"{text}: cannot read the file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise SettingValueError(f"{text}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return text


def parse_generation_config(text: str) -> str:
    """`--generation-config`: `auto`, `vllm` (or `none`), or a folder holding a generation_config.json."""
    if text in ("auto", "vllm", "none"):
        return text
    p = Path(text).expanduser()
    if not (p / "generation_config.json").is_file():
        raise SettingValueError(f"{text}: not 'auto', 'vllm' or a folder with a generation_config.json")
    return str(p)


def _pooler_config(text: str) -> Any:
    from .pooling_spec import parse_pooler_config

    return parse_pooler_config(text)


def parse_profile_name(text: str) -> str:
    """`--reasoning-parser` / `--tool-parser`: a parser profile name (or a vLLM alias of one) or `none`; the profile
    name."""
    from ember.parsers.profiles import PARSER_NAMES, canonical_name

    if text != "none" and text not in PARSER_NAMES:
        raise SettingValueError(f"{text!r} is unknown; known: {', '.join(dict.fromkeys(('none', *PARSER_NAMES)))}")
    return canonical_name(text)


def parse_model_arg(text: str) -> Path:
    """`ember serve MODEL`: an existing checkpoint directory or something shaped like a Hugging Face model id
    (`ORG/NAME[@REVISION]`); the hub itself is only asked after the port is bound."""
    from .model_source import ModelSourceError, parse_model_ref

    try:
        parse_model_ref(text)
    except ModelSourceError as e:
        raise SettingValueError(str(e)) from None
    return Path(text)


def parse_download_dir(text: str) -> Path:
    """`--download-dir`: a directory (created when missing), not a file."""
    p = Path(text).expanduser()
    if p.exists() and not p.is_dir():
        raise SettingValueError(f"{text} is a file, not a directory")
    return p
