"""Start-up of `ember serve`: fail fast and in one line, then say what is being served and where.

Order: flags are checked at parse time; the port is bound before anything heavy (a port in use is reported at once,
not after the weights load); the model is resolved (local directory or Hugging Face id) and loaded; the chat template
is rendered once (and once with a tool when tool calls are parsed) so a broken template stops the start, not every
request. Each failure is a `StartupError`: one line naming the flag or file, no traceback unless
`--log-level debug`; exit code 2 for a bad argument, 1 for a model that cannot be loaded.

Once serving: SIGTERM or SIGINT drains the server and exits 0; the engine process dying stops it with exit code 1.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from .config import ServeConfig

log = logging.getLogger("ember.server")

BAD_ARGUMENT = 2
LOAD_FAILED = 1
INTERRUPTED = 130  # Ctrl-C before the server started, as a shell reports a process that SIGINT ended
TERMINATED = 143  # SIGTERM (docker stop) before the server started, as a shell reports a process that SIGTERM ended


class _Terminated(BaseException):
    """SIGTERM while the server starts: unwinds the start as Ctrl-C does, so the engine process it spawned is
    stopped (the default action would end this process at once and leave that one running)."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises `_Terminated` in the main thread while this is entered (elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class StartupError(Exception):
    """`ember serve` cannot start; the message is the one line the user sees."""

    def __init__(self, message: str, exit_code: int = BAD_ARGUMENT):
        super().__init__(message)
        self.exit_code = exit_code


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (IPv6 when `host` is an IPv6 address), made before the model loads;
    connections made meanwhile wait in the backlog until the server answers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"--port {port}: {host}:{port} is already in use (another server is running there; "
                               f"stop it or pass another --port)") from None
        if e.errno == errno.EACCES:
            raise StartupError(f"--port {port}: permission denied binding {host}:{port} (ports below 1024 need "
                               f"root)") from None
        if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise StartupError(f"--host {host}: cannot listen on this address ({e.strerror or e})") from None
        raise StartupError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def check_head(runtime: Any, config: ServeConfig) -> None:
    """StartupError when vLLM's flags asked for a classifier (``config.classifier_flag``) and the checkpoint is not
    one: serving it as a generator would be a different model than the command line asked for."""
    info = runtime.engine.model_info
    if config.classifier_flag and not info.labels:
        raise StartupError(f"{config.classifier_flag}: {info.architecture} is not a classifier; Ember serves "
                           f"classification and scores from ...ForSequenceClassification checkpoints, or from a "
                           f"causal LM with --hf-overrides naming that architecture and classifier_from_token")


def check_vocab(runtime: Any, config: ServeConfig) -> None:
    """StartupError when the tokenizer's own vocabulary (added tokens aside) is larger than the model's: it is
    another model's tokenizer (a wrong --tokenizer), and every prompt would be refused for token IDs the model lacks.
    Added tokens past the model's logits (a pad token appended without resizing) are served: they are never drawn."""
    tokens = getattr(runtime.tokenizer, "vocab_size", None)
    vocab = runtime.engine.model_info.vocab_size
    if isinstance(tokens, int) and tokens > vocab:
        source = f"--tokenizer {config.tokenizer}" if config.tokenizer is not None else "the model's tokenizer"
        raise StartupError(f"{source}: its vocabulary has {tokens} tokens, more than the model's {vocab} "
                           f"(config.json vocab_size): it is not this model's tokenizer",
                           BAD_ARGUMENT if config.tokenizer is not None else LOAD_FAILED)


def check_template(runtime: Any, config: ServeConfig) -> None:
    """Render the chat template over a one-message conversation (and with a tool when the profile parses tool
    calls); StartupError naming where the template came from when it fails. No template at all is only a warning:
    /v1/completions still works."""
    from .errors import ApiError

    source = (f"--chat-template {config.chat_template}" if config.chat_template is not None and
              not any(c in config.chat_template for c in "{}\n") else
              "--chat-template" if config.chat_template is not None else
              "the model's chat template (tokenizer_config.json / chat_template.jinja / chat_template.json)")
    if runtime.chat_template is None and getattr(runtime.tokenizer, "chat_template", None) is None:
        log.warning("the model has no chat template: chat endpoints answer 400; pass --chat-template FILE")
        return
    probes: list[tuple[str, list | None]] = [("a one-message conversation", None)]
    if runtime.tools_enabled:
        probes.append(("a conversation with a tool", [_PROBE_TOOL]))
    for what, tools in probes:
        try:
            runtime.render([{"role": "user", "content": "Hello!"}], tools=tools, add_generation_prompt=True)
        except ApiError as e:
            reason = e.message.removeprefix("the chat template could not render these messages: ")
            raise StartupError(f"{source} fails to render {what}: {reason}") from None


def check_tls(config: ServeConfig) -> None:
    """StartupError, before the model loads, unless --ssl-keyfile and --ssl-certfile are both absent or both given
    and load as a key and its certificate."""
    key, cert = config.ssl_keyfile, config.ssl_certfile
    if key is None and cert is None:
        return
    if key is None or cert is None:
        raise StartupError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as e:
        raise StartupError(f"--ssl-certfile {cert} / --ssl-keyfile {key}: cannot load them ({e})") from None


def url_of(host: str, port: int, tls: bool = False) -> str:
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def summary_lines(runtime: Any, config: ServeConfig, model_dir: Path, load_seconds: float) -> list[str]:
    """The start-up report: model, architecture, dtype, device, load time, KV cache, concurrency, parser, URL."""
    info = runtime.engine.model_info
    secs = info.load_seconds or load_seconds
    tokens = info.num_kv_blocks * info.block_size
    full = min(tokens // info.max_model_len, info.max_num_seqs)
    setup = runtime.parser
    delimiters = ", ".join(f"{k}={v}" for k, v in sorted(setup.delimiter_ids.items())) or "none"
    url = url_of(config.host, config.port, tls=config.ssl_certfile is not None)
    fits = (f"{full} sequences of full length fit at once" if full else
            "not one sequence of full length fits (lower --max-model-len or give the KV cache more memory)")
    return [
        f"model {runtime.model_name!r} from {model_dir}: {info.architecture}, {info.dtype} on {info.device}, "
        f"loaded in {secs:.1f} s",
        f"KV cache: {info.num_kv_blocks} blocks of {info.block_size} tokens = {tokens} tokens; max_model_len "
        f"{info.max_model_len}; {fits} (max_num_seqs {info.max_num_seqs})",
        f"parser profile {setup.profile.name} (tools {'on' if runtime.tools_enabled else 'off'}); delimiter token "
        f"IDs: {delimiters}",
        f"ready: OpenAI API at {url}/v1, Anthropic API at {url}, metrics at {url}/metrics",
    ]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _load(config: ServeConfig) -> tuple[Any, ServeConfig, float]:
    """Resolve and load the model; the config comes back with the checkpoint directory and served name filled in."""
    from ember.engine.client import SettingError

    from .app import load_runtime
    from .model_source import ModelSourceError, resolve_model, resolve_tokenizer, served_name

    try:
        model_dir = resolve_model(config.model_dir, revision=config.revision, download_dir=config.download_dir,
                                  token=config.hf_token)
        if model_dir is None:
            model_dir = _demo_model()
        if config.tokenizer is not None:
            config = dataclasses.replace(config, tokenizer=str(resolve_tokenizer(
                config.tokenizer, config.model_dir, model_dir, download_dir=config.download_dir,
                token=config.hf_token)))
    except ModelSourceError as e:
        raise StartupError(str(e)) from None
    if config.model_dir is not None and config.served_model_name is None:
        config = dataclasses.replace(config, served_model_name=served_name(config.model_dir, model_dir))
    config = dataclasses.replace(config, model_dir=model_dir)
    log.info("loading %s", model_dir)
    t0 = time.monotonic()
    try:
        runtime = load_runtime(config)
    except (StartupError, KeyboardInterrupt):
        raise
    except SettingError as e:  # the model or machine cannot take a flag's value: a bad argument, not a bad model
        raise StartupError(f"{e.flag}: {e}", BAD_ARGUMENT) from None
    except Exception as e:
        if config.log_level == "debug":
            log.exception("loading %s failed", model_dir)
        raise StartupError(f"cannot load {model_dir}: {_one_line(e)}", LOAD_FAILED) from None
    return runtime, config, time.monotonic() - t0


def _demo_model() -> Path:
    """The demo checkpoint, built into the cache directory on first use; StartupError naming EMBER_CACHE_DIR
    when that directory cannot hold it."""
    from ember.engine import demo

    path = demo.default_path()
    try:
        return demo.ensure(path)
    except OSError as e:
        cause = f"{e.strerror or e}: {e.filename}" if e.filename else (e.strerror or str(e))
        setting = os.environ.get("EMBER_CACHE_DIR")
        where = f"EMBER_CACHE_DIR={setting}: cannot" if setting else "cannot"
        raise StartupError(f"{where} build the demo model in {path} ({cause}); set EMBER_CACHE_DIR to a writable "
                           f"directory, or name a model to serve") from None


def _freeze_heap() -> None:
    """Move everything start-up allocated (modules, the tokenizer, the app) out of the cyclic garbage collector's
    reach: the per-token garbage of the streams then triggers collections that scan only young objects, not the
    whole heap of the imports (`gc.freeze`). `serve` unfreezes it once the server has stopped: frozen objects are
    never freed, not even at exit, and native extensions report those they own as leaks (triton's nanobind
    bindings print some 30 lines of them)."""
    gc.collect()
    gc.freeze()


def serve(config: ServeConfig) -> int:
    """Run `ember serve` to the end; start-up failures print one line on stderr and return their exit code."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = None
    try:
        with _sigterm_unwinds():
            check_tls(config)
            sock = bind_socket(config.host, config.port)
            config = dataclasses.replace(config, port=sock.getsockname()[1])  # --port 0: the port it got
            try:
                runtime, config, seconds = _load(config)
                check_head(runtime, config)
                check_vocab(runtime, config)
                check_template(runtime, config)
            except BaseException:
                sock.close()
                if runtime is not None:
                    runtime.engine.shutdown()
                raise
    except StartupError as e:
        print(f"ember serve: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("ember serve: interrupted while starting", file=sys.stderr, flush=True)
        return INTERRUPTED
    except _Terminated:
        print("ember serve: terminated while starting", file=sys.stderr, flush=True)
        return TERMINATED
    from .app import create_app

    deferred = _defer_signals()  # from the ready line until uvicorn takes them: a SIGTERM there killed the process
    for line in summary_lines(runtime, config, config.model_dir, seconds):
        log.info("%s", line)
    app = create_app(runtime, config, exit_on_engine_death=True)
    server = _uvicorn_server(app, config, deferred)
    _freeze_heap()
    try:
        server.run(sockets=[sock])
    finally:
        gc.unfreeze()
        runtime.engine.shutdown()  # a second Ctrl-C skips the app's shutdown, which stops it otherwise
    return 1 if app.state.ember.engine_dead else 0


STOP_LEAD = 1.0
"""Seconds before the end of ``--shutdown-timeout`` at which the choices still running are ended (at most half
the timeout): time for their error events to reach the clients."""


def _defer_signals() -> list[int]:
    """SIGINT and SIGTERM from now on are recorded (in the list returned) instead of acting, in the main thread: the
    server's own handlers take them over and act on those recorded (`_uvicorn_server`)."""
    deferred: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: deferred.append(signum))
    return deferred


def _uvicorn_server(app: Any, config: ServeConfig, deferred: Sequence[int] = ()) -> Any:
    """A `uvicorn.Server` for ``app`` whose SIGINT and SIGTERM start the graceful shutdown as usual but are not
    raised again once it is done (uvicorn's own `capture_signals` does: the process would die of the signal, status
    143, or 130 with a KeyboardInterrupt traceback), so `serve` returns its own exit status. The ``deferred``
    signals (received before it ran) act as soon as it has taken the signals."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            """uvicorn's graceful shutdown, with the running choices ended by an error `STOP_LEAD` seconds before
            its deadline, so clients still reading get the error event before their connections are closed."""
            timeout = self.config.timeout_graceful_shutdown
            runtime = app.state.ember.runtime
            timer = asyncio.get_running_loop().call_later(
                max(0.0, timeout - min(STOP_LEAD, timeout / 2)), runtime.stop_generating,
                f"the server is shutting down (--shutdown-timeout {timeout:g} s ran out)")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            for sig in dict.fromkeys(deferred):
                self.handle_exit(sig, None)
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(uvicorn.Config(
        app, log_level=config.uvicorn_log_level or config.log_level, lifespan="on",
        access_log=not config.disable_uvicorn_access_log,
        timeout_graceful_shutdown=config.shutdown_timeout,
        ssl_keyfile=str(config.ssl_keyfile) if config.ssl_keyfile else None,
        ssl_certfile=str(config.ssl_certfile) if config.ssl_certfile else None))
