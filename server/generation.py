"""Request -> engine -> output pipeline -> `ChoiceStep`s, per choice.

`ModelRuntime` holds what is built once per served model (engine, tokenizer facts, parser profile, delimiter IDs,
grammar backend). `run_choices` drives the `n` independent choices of one request and yields their steps as they
come; closing it (a client that went away) closes every engine iterator, which aborts those requests and frees
their KV blocks. Every generated token ID is reported in exactly one step, in order: the step of the events it
completed, or, while the parser withholds its text (`PENDING`), the step that surfaces or drops that text, with the
channel it resolved to.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from ember.engine.client import EngineClient, EngineDeadError, ModelInfo
from ember.engine.args import parse_json_object
from ember.engine.checkpoint import load_tokenizer
from ember.engine.params import RequestOutput, SamplingParams
from ember.parsers.initial import InitialState
from ember.parsers.pipeline import DELIMITER, PENDING, OutputPipeline, ParserSetup, PipelineStep
from ember.parsers.profiles import Profile, detect_profile, get_profile
from ember.parsers.stop import StopStrings
from ember.parsers.tokens import PromptContext, TokenBytes

from . import chat
from . import content_format as cf
from .choice import ChoiceEnd, ChoiceStep, TokenInfo
from .config import ServeConfig
from .errors import bad_request, prompt_too_long
from .metrics import Metrics
from .pooling_spec import PoolingSpec, load_pooling_spec, parse_pooler_config
from .quoted_text import TextQuoter, encode_quoted
from .request_log import RequestLog
from .sampling_defaults import SamplingDefaults

log = logging.getLogger("ember.server")
_QUOTED_OPTIONS = ("tools", "kwargs", "documents")
"""`chat.render` options that carry the request's text into the template (a `TextQuoter` marks it)."""


def new_call_id(_index: int = 0) -> str:
    return "call_" + secrets.token_hex(12)


def without_reasoning(profile: Profile) -> Profile:
    """The profile with reasoning parsing switched off (`--reasoning-parser none`): thoughts stay content."""
    if profile.reasoning is None:
        return profile
    transitions = {k: r for k, r in profile.transitions.items() if not k[1].startswith("think_")}
    return dataclasses.replace(profile, reasoning=None, transitions=transitions)


def with_reasoning_of(profile: Profile, other: Profile) -> Profile:
    """`profile`'s tool syntax with `other`'s thought syntax (e.g. `--reasoning-parser deepseek_r1
    --tool-parser hermes`): the think terminals and rules of `other`, the headers and end-of-turn specials of both."""
    if other.reasoning is None:
        return without_reasoning(profile)
    think = {k: v for k, v in other.terminals.items() if k.startswith("think_")}
    base = without_reasoning(profile)
    return dataclasses.replace(
        base, reasoning=other.reasoning, terminals={**base.terminals, **think},
        token_id_terminals=base.token_id_terminals | (other.token_id_terminals & think.keys()),
        transitions={**base.transitions, **{k: r for k, r in other.transitions.items() if k[1].startswith("think_")}},
        generation_headers=tuple(dict.fromkeys(base.generation_headers + other.generation_headers)),
        end_of_turn=tuple(dict.fromkeys(base.end_of_turn + other.end_of_turn)))


def choose_profile(chat_template: str | dict[str, str] | None, model_type: str | None, reasoning_parser: str | None,
                   tool_parser: str | None) -> Profile:
    """`--tool-parser` names the family (its tool syntax and, with it, its reasoning syntax); unset, the family is
    detected from the chat template and model type. `--reasoning-parser` replaces the family's thought syntax (as in
    vLLM, where it never changes how tool calls are read), and names the family only where none is detected; "none"
    switches that part off."""
    base_name = tool_parser if tool_parser and tool_parser != "none" else detect_profile(chat_template, model_type)
    if base_name == "none" and reasoning_parser and reasoning_parser != "none":
        base_name = reasoning_parser
    profile = get_profile(base_name)
    if reasoning_parser not in (None, "none", profile.name) and profile.tool_format != "harmony":
        profile = with_reasoning_of(profile, get_profile(reasoning_parser))
    if tool_parser == "none":
        profile = dataclasses.replace(profile, tool_format=None)
    if reasoning_parser == "none":
        profile = without_reasoning(profile)
    return profile


@dataclass
class ModelRuntime:
    """Everything built once per served model. The engine is reached only through its `EngineClient`; the
    tokenizer is the front end's own copy, loaded from the folder `ModelInfo.tokenizer_path` names."""

    engine: EngineClient
    tokenizer: Any
    token_bytes: TokenBytes
    model_name: str
    max_model_len: int
    chat_template: str | dict[str, str] | None  # a tokenizer's named templates: `chat.named_template` picks
    parser: ParserSetup  # the model's family
    parser_plain: ParserSetup  # the "none" profile, for /v1/completions
    tools_enabled: bool  # False with `--tool-parser none`: tool markup is always content
    grammar: Any = None  # ember.server.structured.Structured (front-end validation), when available
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # for settings a request leaves unset
    pooling: PoolingSpec = PoolingSpec()  # how /v1/embeddings pools
    template_defaults: dict[str, Any] = field(default_factory=dict)  # --default-chat-template-kwargs
    model_aliases: tuple[str, ...] = ()  # more names requests may give the served model (--served-model-name)
    content_format: cf.ContentFormat = "string"  # how the template receives message content
    request_log: RequestLog | None = None  # --enable-log-requests
    stopping: str | None = None
    """Why generation is being cut short (the server's shutdown deadline is near); set by `stop_generating`."""
    in_flight: set[str] = field(default_factory=set, repr=False)
    """Engine request IDs of the choices running now."""
    max_prompt_chars: int = 0
    """Prompt text longer than this cannot fit the context whatever it tokenizes to (`check_text_size`); 0: no
    limit."""
    quoter: TextQuoter | None = None
    """For a harmony (gpt-oss) model: message text stays ordinary tokens, as vLLM's harmony renderer writes it."""

    def stop_generating(self, reason: str) -> None:
        """End every running choice, and each one started from now on, with an error saying ``reason``: a client
        then gets the error event (or error body) instead of a connection closed mid-stream."""
        self.stopping = reason
        for rid in list(self.in_flight):
            self.engine.abort(rid)

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def template_kwargs(self, given: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request's chat-template variables over the server's defaults (``--default-chat-template-kwargs``):
        what the request sets wins."""
        if not self.template_defaults:
            return given
        return {**self.template_defaults, **(given or {})}

    def render(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """`chat.render` with this model's tokenizer, template and content format."""
        return chat.render(self.tokenizer, self.chat_template, messages, content_format=self.content_format,
                           **options)

    def prompt_ids(self, messages: list[dict[str, Any]], *, size_param: str | None = None,
                   add_special_tokens: bool = False, **options: Any) -> list[int]:
        """The chat prompt's token IDs (`render`, then `chat.encode`); with ``size_param``, a text too long for the
        context is a 400 naming it before it is tokenized (`check_text_size`). With a `quoter`, message text that
        spells a control token is tokenized as ordinary text."""
        quoted = None
        if self.quoter is not None and not add_special_tokens:
            quoted = self.quoter.quote({"messages": messages,
                                        **{k: options[k] for k in _QUOTED_OPTIONS if options.get(k) is not None}})
        if quoted is not None:
            text = self.render(**{**options, **quoted.inputs})
        else:
            text = self.render(messages, **options)
        if size_param is not None:
            self.check_text_size(text, size_param)
        if quoted is not None:
            ids = encode_quoted(self.tokenizer, text, quoted.open, quoted.close)
            if ids is None:  # the template cut or moved a mark: its text would spell the control tokens
                param = options.get("field", "messages")
                raise bad_request(f"{param}: this model's chat template does not keep text that spells a control "
                                  "token as text", param=param)
            return ids
        return chat.encode(self.tokenizer, text, add_special_tokens)

    def check_text_size(self, text: str, param: str) -> None:
        """A 400 (``context_length_exceeded``, naming ``param``) for prompt text longer than `max_prompt_chars`:
        more characters than ``max_model_len`` tokens can spell, so the tokenizer need not spend seconds and
        gigabytes on it (a request that truncates its prompt is not checked). The token count it gives (Anthropic's
        message carries one) is the fewest tokens the text can be: it grows with the text, as a client trimming a
        conversation by it needs."""
        if self.max_prompt_chars and len(text) > self.max_prompt_chars:
            per_token = self.max_prompt_chars // self.max_model_len  # the most characters one token spells
            raise prompt_too_long(f"The prompt has {len(text)} characters, more than this model's maximum context "
                                  f"length of {self.max_model_len} tokens can hold", param,
                                  max(self.max_model_len + 1, -(-len(text) // per_token)), self.max_model_len - 1)

    @classmethod
    def build(cls, engine: EngineClient, config: ServeConfig, model_dir: Path, chat_template: str | None,
              grammar: Any = None, tokenizer: Any = None) -> "ModelRuntime":
        info = engine.model_info
        tok = tokenizer if tokenizer is not None else load_tokenizer(info.tokenizer_path)
        template = chat_template if chat_template is not None else getattr(tok, "chat_template", None)
        profile = choose_profile(template, info.model_type, config.reasoning_parser, config.tool_parser)
        tb = TokenBytes.from_tokenizer(tok)
        drop = set(info.eos_token_ids)
        for attr in ("pad_token_id", "bos_token_id"):
            tid = getattr(tok, attr, None)
            if isinstance(tid, int):
                drop.add(tid)
        eos = info.eos_token_ids
        setup = ParserSetup.from_tokenizer(tok, profile, drop_ids=drop, tb=tb, eos_ids=eos)
        plain = ParserSetup.from_tokenizer(tok, "none", drop_ids=drop, tb=tb, eos_ids=eos)
        name = config.served_model_name or model_dir.name
        log.debug("serving %s as %r with parser profile %s (delimiters %s)", model_dir, name, profile.name,
                 setup.delimiter_ids)
        # a token spells at most its longest text, from up to about 4 characters that Unicode composition folds into
        # one; a tokenizer that may drop characters (WordPiece, Unigram) bounds nothing
        longest = max((len(b) for b in tb.bytes_table), default=1)
        return cls(engine=engine, tokenizer=tok, token_bytes=tb, model_name=name, max_model_len=info.max_model_len,
                   max_prompt_chars=info.max_model_len * longest * 4 if tb.spells_every_char else 0,
                   quoter=TextQuoter.of(tok) if profile.tool_format == "harmony" else None,
                   chat_template=template, parser=setup, parser_plain=plain,
                   tools_enabled=config.tool_parser != "none" and profile.tool_format is not None, grammar=grammar,
                   sampling_defaults=SamplingDefaults.load(config.generation_config, info.model_dir,
                                                           _json(config.override_generation_config)),
                   template_defaults=_json(config.default_chat_template_kwargs) or {},
                   model_aliases=tuple(config.served_model_aliases),
                   content_format=cf.resolve(config.chat_template_content_format, template),
                   request_log=RequestLog(config.max_log_len) if config.enable_log_requests else None,
                   pooling=load_pooling_spec(Path(info.model_dir), parse_pooler_config(config.pooler_config)
                                             if config.pooler_config else None,
                                             _json(config.hf_overrides), encoder=info.encoder))


def _json(text: str | None) -> dict[str, Any] | None:
    return parse_json_object(text) if text else None


@dataclass
class ChoiceSpec:
    """One choice, ready to run: its sampling parameters, its pipeline and its constraint (None if free)."""

    prompt_ids: list[int]
    params: SamplingParams
    pipeline: OutputPipeline
    constraint: Any = None


@dataclass
class GenRequest:
    """An admitted request: its choices (each with its prompt: `n` copies of one, or a batch of prompts)."""

    request_id: str
    choices: list[ChoiceSpec]
    stop: list[str] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    choice_ended: Callable[[], None] = field(default=lambda: None, repr=False)
    """Called once as each choice's run ends (the front end's count of admitted choices, `AdmittedChoices`)."""
    engine_id: str = ""
    """The prefix of its choices' engine request IDs (logged), unique among running requests; default
    ``request_id``, which a client-given ID does not make unique."""
    generated: dict[int, int] = field(default_factory=dict, repr=False)
    """Tokens generated by each choice that ended (not refused), by index: the `n` choices of one prompt (those
    sharing its ``prompt_ids`` list) are observed as one vLLM request once all have ended."""

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or self.request_id


def make_pipeline(setup: ParserSetup, initial: InitialState, *, stop: Sequence[str] | StopStrings,
                  include_stop_str_in_output: bool, tools: Sequence[dict] | None,
                  stop_token_ids: Sequence[int] = (), skip_special_tokens: bool | None = None,
                  min_tokens: int = 0, ignore_eos: bool = False,
                  prompt_ids: Sequence[int] | None = None) -> OutputPipeline:
    """A fresh pipeline for one choice (``stop`` built once as `StopStrings` is shared by a request's choices); tool
    calls are parsed only when the request offers tools (not `none`). The
    text of a ``stop_token_ids`` token that ends the reply is left out, as EOS's is, unless
    ``include_stop_str_in_output`` (vLLM's rule). ``skip_special_tokens`` true also drops every special token that
    is not one of the parser's delimiters (`ParserSetup.dropped_ids`); unset or false keeps them as text. A stop
    string ends the reply only past the first ``min_tokens`` tokens (vLLM's rule). With ``ignore_eos`` an EOS is
    an ordinary special token, as in vLLM: it ends no turn, adds no text (unless ``skip_special_tokens`` is false)
    and splits neither a character nor a stop string (`ParserSetup.ignorable_eos_ids`). With ``prompt_ids`` (a raw
    completion, whose prompt is not a template's) the text continues the prompt's (`PromptContext`: a character the
    prompt left unfinished, a SentencePiece leading space after a prompt with no text)."""
    passed = setup.ignorable_eos_ids if ignore_eos else frozenset()
    drop = setup.dropped_ids(skip_special_tokens)
    context = PromptContext() if prompt_ids is None else PromptContext.of(setup.tb, prompt_ids, drop)
    if skip_special_tokens is False:
        drop -= passed
    return setup.pipeline(initial=initial, stop=StopStrings.of(stop),
                          include_stop_str_in_output=include_stop_str_in_output, min_tokens=min_tokens,
                          tools=list(tools) if tools else None, call_id=new_call_id, parse_tools=bool(tools),
                          special_ids_to_drop=drop, passed_ids=passed,
                          ending_ids=() if include_stop_str_in_output else frozenset(stop_token_ids),
                          prompt_context=context)


def _end_reason(engine_reason: str | None) -> str:
    return {"stop": "eos", "length": "length", "abort": "abort", "error": "error"}.get(engine_reason or "", "eos")


def _end(out: RequestOutput, params: SamplingParams | None = None, model_eos: int | None = None,
         stop_string: str | None = None) -> ChoiceEnd:
    """How a choice ended: by ``stop_string`` when its text completed one, else as the engine ended it; `stop_token`
    is the token that ended it, unless that is the model's EOS (the tokenizer's ``model_eos``) and the request did
    not ignore EOS. As vLLM: the other end tokens of ``generation_config.json`` are stop tokens, reported by ID."""
    if stop_string is not None:
        return ChoiceEnd("stop_string", stop_string=stop_string, cached_tokens=out.num_cached_tokens)
    tid = out.stop_token_id
    eos = tid == model_eos and not (params is not None and params.ignore_eos)
    return ChoiceEnd(_end_reason(out.finish_reason), error=out.error,  # type: ignore[arg-type]
                     cached_tokens=out.num_cached_tokens, rejected=out.rejected, stop_token=None if eos else tid)


async def run_choice(rt: ModelRuntime, req: GenRequest, index: int, metrics: Metrics | None = None
                     ) -> AsyncIterator[ChoiceStep]:
    """The steps of choice `index`: one per engine output (one engine step, or several merged when this consumer
    lagged), the last one carrying `end`. A stop string ends the choice at the token that completed it. A choice of
    ``max_tokens`` 0 (an echo scoring its prompt) is one step: the prompt's scores, when asked, and a `length` end."""
    spec = req.choices[index]
    pipe = spec.pipeline
    rid = f"{req.engine_id}-{index}"
    first_t: float | None = None
    last_t: float | None = None
    scheduled_at: float | None = None  # the engine's first scheduling of it (`time.monotonic()`, as first_t)
    ntok = 0
    counted = 0  # of ``ntok``, the tokens already in the generation-token counters (counted as each step delivers)
    queued: float | None = None  # seconds from arrival in the engine to the first scheduling step
    end: ChoiceEnd | None = None
    if rt.request_log is not None:
        rt.request_log.received(rid, spec.prompt_ids, spec.params, rt.tokenizer.decode)
    prompt_only = spec.params.max_tokens == 0
    held: list[TokenInfo] = []  # tokens whose channel the pipeline left PENDING

    def settle(step: ChoiceStep, pstep: PipelineStep) -> None:
        nonlocal held
        if pstep.resolved:
            for t, ch in zip(held, pstep.resolved):
                t.channel = None if ch == DELIMITER else ch
            step.tokens += held
            held = []

    def finish(step: ChoiceStep, reason: str) -> None:
        fstep = pipe.finish_step(reason)
        step.events += fstep.events
        settle(step, fstep)

    rt.in_flight.add(rid)
    try:
        if rt.stopping is not None:
            raise _Stopping(rt.stopping)
        params = dataclasses.replace(spec.params, max_tokens=1) if prompt_only else spec.params
        gen = rt.engine.generate(spec.prompt_ids, params, request_id=rid, constraint=spec.constraint)
        async with aclosing(gen):
            async for out in gen:
                if last_t is None and out.queue_seconds is not None:  # the first output: waiting time is known
                    queued, scheduled_at = out.queue_seconds, out.scheduled_at
                if prompt_only:
                    if out.new_token_ids or out.finished or out.prompt_logprobs is not None:
                        first_t = last_t = time.monotonic()  # its prefill ran: timed as vLLM times its 1 token
                        if metrics is not None:
                            metrics.ttft.observe(last_t - req.arrival)
                        end = _prompt_end(out)
                        step = ChoiceStep(index, end=end, finish_at=0, prompt_logprobs=out.prompt_logprobs)
                        finish(step, end.reason)
                        yield step
                        return
                    continue
                new_ids = out.new_token_ids
                if new_ids:
                    now = time.monotonic()
                    if metrics is not None:
                        if last_t is None:
                            metrics.ttft.observe(now - req.arrival)
                        metrics.tokens_arrived(len(new_ids), max(out.steps, 1),
                                               None if last_t is None else now - last_t)
                    first_t = now if first_t is None else first_t
                    last_t = now
                lps = out.logprobs
                step = ChoiceStep(index)
                if out.prompt_logprobs is not None:
                    step.prompt_logprobs = out.prompt_logprobs
                for k, tid in enumerate(new_ids):
                    ntok += 1
                    pstep = pipe.feed([tid])
                    lp = lps[k] if lps is not None and k < len(lps) else None
                    channel = pstep.token_channels[0] if pstep.token_channels else None
                    info = TokenInfo(tid, _floored(lp.logprob) if lp else None,
                                     [(t, _floored(v)) for t, v in lp.top] if lp else None,
                                     None if channel == DELIMITER else channel)
                    settle(step, pstep)
                    (held if channel == PENDING else step.tokens).append(info)
                    step.events += pstep.events
                    if pstep.stopped:
                        step.finish_at = len(step.events)
                        finish(step, "stop")
                        end = step.end = _end(out, stop_string=pipe.matched_stop)
                        yield step
                        return  # leaving `aclosing` aborts the engine request
                if metrics is not None and ntok > counted:
                    metrics.generation_tokens.inc(ntok - counted)
                    counted = ntok
                if out.finished:
                    if out.finish_reason == "abort" and rt.stopping is not None:
                        raise _Stopping(rt.stopping)
                    step.finish_at = len(step.events)
                    finish(step, out.finish_reason or "stop")
                    flushed_stop = pipe.stopped and out.finish_reason not in ("error", "abort")  # at the flush
                    end = step.end = _end(out, spec.params, getattr(rt.tokenizer, "eos_token_id", None),
                                          pipe.matched_stop if flushed_stop else None)
                    yield step
                    return
                if step.tokens or step.events:
                    yield step
        if rt.stopping is not None:
            raise _Stopping(rt.stopping)
        end = ChoiceEnd("abort")
        step = ChoiceStep(index, end=end, finish_at=0)
        finish(step, "abort")
        yield step
    except _Stopping as e:
        pipe.abort()
        end = ChoiceEnd("error", error=str(e))
        yield ChoiceStep(index, _unsurfaced(held), [], end)
    except (asyncio.CancelledError, GeneratorExit):
        pipe.abort()
        raise
    except Exception as e:  # an engine or pipeline failure ends this choice, never the server
        if isinstance(e, ValueError) and ntok == 0:  # `generate` refused the request at admission
            end = ChoiceEnd("error", error=str(e), rejected=True)
        elif isinstance(e, EngineDeadError):
            log.error("choice %s: %s", rid, e)
            end = ChoiceEnd("error", error=str(e))
        else:
            log.exception("choice %s failed", rid)
            end = ChoiceEnd("error", error=f"{type(e).__name__}: {e}")
        yield ChoiceStep(index, _unsurfaced(held), [], end)
    finally:
        rt.in_flight.discard(rid)
        req.choice_ended()
        if rt.request_log is not None:
            rt.request_log.finished(rid, end.reason if end else "cancelled", len(spec.prompt_ids), ntok, req.arrival,
                                    cached_tokens=end.cached_tokens if end else None, error=end.error if end else None)
        if metrics is not None:
            rejected = end is not None and end.rejected
            if ntok > counted:
                metrics.generation_tokens.inc(ntok - counted)
            metrics.finished(end.reason if end else "cancelled", rejected)
            if queued is not None and not rejected:
                metrics.queue_time.observe(queued)
            if last_t is not None:
                metrics.e2e.observe(last_t - req.arrival)
            if not rejected:
                metrics.choice_ran(len(spec.prompt_ids), ntok, spec.params.max_tokens, first_t, last_t, scheduled_at)
                req.generated[index] = ntok
                same_prompt = [i for i, c in enumerate(req.choices) if c.prompt_ids is spec.prompt_ids]
                if all(i in req.generated for i in same_prompt):
                    metrics.prompt_done(len(same_prompt), max(req.generated[i] for i in same_prompt))


class _Stopping(Exception):
    """A choice cut short by `ModelRuntime.stop_generating`."""


def _prompt_end(out: RequestOutput) -> ChoiceEnd:
    """How a ``max_tokens: 0`` choice ends at its first engine output: by length, nothing generated (the token the
    engine sampled is dropped), unless the engine failed or refused it."""
    if out.finished and out.finish_reason in ("error", "abort"):
        return _end(out)
    return ChoiceEnd("length", cached_tokens=out.num_cached_tokens)


def _unsurfaced(tokens: list[TokenInfo]) -> list[TokenInfo]:
    """``tokens`` (still `PENDING` when the choice failed) as tokens whose text never surfaced."""
    for t in tokens:
        t.channel = None
    return tokens


def run_choices(rt: ModelRuntime, req: GenRequest, metrics: Metrics | None = None) -> AsyncIterator[ChoiceStep]:
    """All choices' steps, interleaved as they are produced; each choice ends with a step carrying `end`. One choice
    is its own generator (no re-yielding layer on every step); close the iterator to abort them."""
    if len(req.choices) == 1:
        return run_choice(rt, req, 0, metrics)
    return _run_many(rt, req, metrics)


async def _run_many(rt: ModelRuntime, req: GenRequest, metrics: Metrics | None) -> AsyncIterator[ChoiceStep]:
    queue: asyncio.Queue[ChoiceStep] = asyncio.Queue()

    async def pump(i: int) -> None:
        async with aclosing(run_choice(rt, req, i, metrics)) as it:
            async for step in it:
                await queue.put(step)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(req.choices))]
    try:
        remaining = len(tasks)
        while remaining:
            step = await queue.get()
            if step.end is not None:
                remaining -= 1
            yield step
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


LOGPROB_FLOOR = -9999.0
"""The logprob reported for a token the sampling mask ruled out (a grammar, ``min_tokens``): its true value, -inf,
is not JSON. OpenAI and vLLM report the same stand-in."""


def _floored(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def sampling_params(*, max_tokens: int, temperature: float | None, top_p: float | None, top_k: int | None,
                    min_p: float | None, seed: int | None, presence_penalty: float, frequency_penalty: float,
                    repetition_penalty: float | None, logprobs: int | None, logit_bias: dict[int, float] | None,
                    stop_token_ids: Sequence[int] = (), min_tokens: int = 0, ignore_eos: bool = False,
                    prompt_logprobs: int | None = None, lora: str | None = None,
                    defaults: SamplingDefaults = SamplingDefaults(), **extras: Any) -> SamplingParams:
    """A request's engine parameters: a setting it leaves unset (None) takes the model's default (``defaults``), else
    its neutral value; ``extras`` are further `SamplingParams` fields (`admission.vllm_sampling_extras`)."""
    def pick(value: Any, default: Any, neutral: Any) -> Any:
        return value if value is not None else default if default is not None else neutral

    top_k = pick(top_k, defaults.top_k, 0)
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=pick(temperature, defaults.temperature, 1.0),
        top_p=pick(top_p, defaults.top_p, 1.0), top_k=0 if top_k == -1 else top_k,
        min_p=pick(min_p, defaults.min_p, 0.0), presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=pick(repetition_penalty, defaults.repetition_penalty, 1.0),
        seed=None if seed is None else seed % 2**64, logprobs=logprobs, logit_bias=logit_bias,
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, prompt_logprobs=prompt_logprobs, lora=lora,
        **extras)


def seeded(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a seeded request samples with seed + index (as int64 wraps: the seeds are the request's
    int64 seed taken mod 2**64, so no two seeds a request can give share a stream), so the `n` choices differ but
    repeat."""
    if params.seed is None or index == 0:
        return dataclasses.replace(params)
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)
