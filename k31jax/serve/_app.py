"""The ASGI app (FastAPI): OpenAI and Anthropic routes over one ``Scheduler``, API key, body
limit, errors in each API's schema, health and Prometheus-style metrics.

The scheduler runs on its own thread; each request gets an ``asyncio.Queue`` fed from that
thread (``loop.call_soon_threadsafe``). A request is submitted before its response starts, so
a full queue is a real 429 even for streams; a client that disconnects mid-stream cancels its
handle and the scheduler frees the row at its next step.

The app serves while the scheduler's background warm-up compiles (``Scheduler.start_warmup``):
``/health`` answers 503 ``warming_up`` with the programs left, then 200 ``ok``; requests are
accepted meanwhile and wait only for the programs they need. The access log (``ACCESS_LOG``, one
line per request: method, path, status, seconds, tokens) is on unless ``access_log=False``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..chat import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from ..generate import Failed, Finished, QueueFullError, Scheduler, TokenEvent
from . import _anthropic as anth
from . import _openai as oai
from . import _responses as rsp
from ._metrics import render_metrics
from ._protocol import APIError, GenSpec, get, invalid

OPENAI_ERRORS = {"invalid_request": ("invalid_request_error", None),
                 "authentication": ("invalid_request_error", "invalid_api_key"),
                 "not_found": ("invalid_request_error", "model_not_found"),
                 "request_too_large": ("invalid_request_error", "request_too_large"),
                 "rate_limit": ("rate_limit_error", "rate_limit_exceeded"),
                 "server_error": ("server_error", None), "overloaded": ("server_error", "overloaded")}
ANTHROPIC_ERRORS = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
                    "not_found": "not_found_error", "request_too_large": "request_too_large",
                    "rate_limit": "rate_limit_error", "server_error": "api_error",
                    "overloaded": "overloaded_error"}


ACCESS_LOG = logging.getLogger("k31jax.serve.access")
_USAGE = "k31jax.usage"  # the scope entry a route fills with its request's token counts


@dataclasses.dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1
    image_dir: str | None = None  # local image files are read only below this folder (None: none)
    default_max_tokens: int | None = 1024  # chat completions without max_tokens (None: the rest of the context)
    access_log: bool = True
    grammar: bool = True  # hold replies to their tools' schemas and JSON formats (constrained decoding)


class _AccessLog:
    """ASGI middleware: one ``ACCESS_LOG`` line per HTTP request once its response (a whole
    stream included) is sent: client, method, path, status, seconds, and the tokens a generation
    route noted in the scope (``_note_usage``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]
        usage = scope.setdefault(_USAGE, {})

        async def noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            client = scope.get("client")
            tokens = (f" tokens prompt={usage['prompt']} cached={usage['cached']} completion={usage['completion']}"
                      if usage else "")
            ACCESS_LOG.info(f"{client[0] if client else '-'} {scope['method']} {scope['path']} "
                            f"{status[0] or 500} {time.perf_counter() - t0:.3f}s{tokens}")


def _note_usage(request: Request, prompt: int, completion: int, cached: int) -> None:
    request.scope.setdefault(_USAGE, {}).update(prompt=prompt, completion=completion, cached=cached)


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, err: APIError) -> dict[str, Any]:
    if _is_anthropic(path):
        return {"type": "error", "error": {"type": ANTHROPIC_ERRORS[err.kind], "message": err.message}}
    kind, code = OPENAI_ERRORS[err.kind]
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": code}}


def create_app(scheduler: Scheduler, settings: ServeSettings) -> FastAPI:
    app = FastAPI(title="k31jax serve", docs_url=None, redoc_url=None, openapi_url=None)
    if settings.access_log:
        app.add_middleware(_AccessLog)
    tok = scheduler.tokenizer
    max_len = scheduler.max_len
    stored = rsp.ResponseStore()
    ttft_by_endpoint: dict[str, collections.deque] = {}  # recent times to first token per route

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(error_body(request.url.path, err), status_code=err.status, headers=err.headers)

    async def body_of(request: Request, model_required: bool = True) -> dict[str, Any]:
        """Auth, size limit, JSON object, known model (when one is named or `model_required`)."""
        check_key(request)
        limit = settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError("request_too_large", f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise APIError("request_too_large", f"request body exceeds the limit of {limit} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        model = get(body, "model", str, required=model_required)
        if model is not None and model != settings.model_name:
            raise APIError("not_found", f"model '{model}' does not exist; this server serves "
                                        f"'{settings.model_name}'", param="model")
        return body

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if given != settings.api_key:
            raise APIError("authentication", "invalid or missing API key (send 'Authorization: Bearer KEY' "
                                             "or 'x-api-key: KEY')")

    def submit(spec: GenSpec, request: Request) -> tuple[Any, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        ttft = ttft_by_endpoint.setdefault(request.url.path, collections.deque(maxlen=1024))

        def sink(item) -> None:  # on the scheduler thread
            if isinstance(item, Finished):
                ttft.append(item.ttft_seconds)
            loop.call_soon_threadsafe(out.put_nowait, item)

        try:
            handle = scheduler.submit(spec.request, tool_choice=spec.tool_choice, logprobs=spec.logprobs, sink=sink)
        except QueueFullError as e:
            raise APIError("rate_limit", f"the server is busy ({e}); retry later",
                           headers={"Retry-After": str(settings.retry_after_s)}) from None
        except ValueError as e:
            raise invalid(str(e)) from None
        return handle, out

    async def events(handle, out: asyncio.Queue) -> AsyncIterator[Any]:
        done = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, Failed):
                    done = True
                    raise APIError("server_error", f"generation failed: {item.error!r}")
                yield item
                if isinstance(item, Finished):
                    done = True
                    return
        finally:
            if not done:
                handle.cancel()

    async def collect(handle, out) -> tuple[Finished, list[TokenEvent]]:
        tokens = []
        async for item in events(handle, out):
            if isinstance(item, Finished):
                return item, tokens
            tokens.append(item)
        raise AssertionError("the stream ended without a result")

    # ---- service routes --------------------------------------------------------------------
    @app.get("/health")
    async def health():
        body: dict[str, Any] = {"status": "ok", "ready": True, "model": settings.model_name,
                                "queue_depth": scheduler.queue_depth, "running": scheduler.running}
        code, warm = 200, scheduler.warmup_status
        if warm is not None:
            left = list(warm.left)
            body["warmup"] = {"compiled": len(warm.done), "total": len(warm.done) + len(left), "left": left,
                              "seconds": round(warm.seconds, 1)}
            if warm.error is not None:
                body.update(status="error", ready=False)
                body["warmup"]["error"] = f"{type(warm.error).__name__}: {warm.error}"
                code = 500
            elif not warm.ready:  # requests are accepted meanwhile: they wait for what they need
                body.update(status="warming_up", ready=False)
                code = 503
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(scheduler, ttft_by_endpoint), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "k31jax", "context_length": max_len,
                                            "default_max_tokens": settings.default_max_tokens}]}

    # ---- OpenAI ----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        spec = oai.chat_spec(body, tok, max_len, image_dir=settings.image_dir,
                             default_max_tokens=settings.default_max_tokens, grammar=settings.grammar)
        handle, out = submit(spec, request)
        rid, created, model = oai.new_id("chatcmpl"), oai.now(), settings.model_name
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return _sse(_chat_stream(request, spec, handle, out, rid, created, model, include_usage))
        fin, toks = await collect(handle, out)
        c = fin.completion
        _note_usage(request, c.prompt_tokens, len(c.tokens), fin.cached_tokens)
        lps = ([oai.logprob_entry(tok, t.delta.token_ids[0], t.logprob, spec.top_logprobs) for t in toks]
               if spec.logprobs else None)
        calls = spec.calls(c.parsed)
        return oai.chat_response(rid, model, created, oai.chat_message(c.parsed, calls),
                                 oai.finish_reason(c.finish_reason, calls),
                                 oai.usage(c.prompt_tokens, len(c.tokens), fin.cached_tokens), lps)

    async def _chat_stream(request, spec, handle, out, rid, created, model, include_usage):
        yield oai.chat_chunk(rid, model, created, {"role": "assistant", "content": ""})
        try:
            async for item in events(handle, out):
                if isinstance(item, Finished):
                    c = item.completion
                    _note_usage(request, c.prompt_tokens, len(c.tokens), item.cached_tokens)
                    yield oai.chat_chunk(rid, model, created, {},
                                         oai.finish_reason(c.finish_reason, spec.calls(c.parsed)))
                    if include_usage:
                        yield oai.chat_chunk(rid, model, created, None,
                                             usage_=oai.usage(c.prompt_tokens, len(c.tokens), item.cached_tokens))
                    break
                delta = _chat_delta(item.delta.events, spec)
                lps = ([oai.logprob_entry(tok, item.delta.token_ids[0], item.logprob, spec.top_logprobs)]
                       if spec.logprobs and item.logprob is not None else None)
                if delta or lps:
                    yield oai.chat_chunk(rid, model, created, delta, logprobs=lps)
        except APIError as e:
            yield f"data: {json.dumps(error_body('/v1/chat/completions', e))}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        spec = oai.completion_spec(body, tok, max_len)
        handle, out = submit(spec, request)
        rid, created, model = oai.new_id("cmpl"), oai.now(), settings.model_name
        if body.get("stream"):
            async def gen():
                try:
                    async for item in events(handle, out):
                        if isinstance(item, Finished):
                            c = item.completion
                            _note_usage(request, c.prompt_tokens, len(c.tokens), item.cached_tokens)
                            yield oai.completion_chunk(rid, model, created, "", oai.finish_reason(c.finish_reason, None),
                                                       oai.usage(c.prompt_tokens, len(c.tokens), item.cached_tokens))
                            break
                        if item.delta.text:
                            yield oai.completion_chunk(rid, model, created, item.delta.text, None)
                except APIError as e:
                    yield f"data: {json.dumps(error_body('/v1/completions', e))}\n\n"
                yield "data: [DONE]\n\n"
            return _sse(gen())
        fin, toks = await collect(handle, out)
        c = fin.completion
        _note_usage(request, c.prompt_tokens, len(c.tokens), fin.cached_tokens)
        lps = None
        if spec.logprobs:
            lps = {"tokens": [tok.decode([t]) for t in c.tokens],
                   "token_logprobs": [t.logprob.logprob for t in toks],
                   "top_logprobs": [{tok.decode([i]): v for i, v in t.logprob.top[:spec.top_logprobs]} for t in toks],
                   "text_offset": []}
        return oai.completion_response(rid, model, created, c.text, oai.finish_reason(c.finish_reason, None),
                                       oai.usage(c.prompt_tokens, len(c.tokens), fin.cached_tokens), lps)

    # ---- OpenAI Responses ------------------------------------------------------------------
    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await body_of(request)
        spec, conversation = rsp.responses_spec(body, tok, max_len, stored, image_dir=settings.image_dir,
                                                default_max_tokens=settings.default_max_tokens,
                                                grammar=settings.grammar)
        handle, out = submit(spec, request)
        rid, created, model = rsp.new_id("resp"), rsp.now(), settings.model_name
        if body.get("stream"):
            return _sse(_responses_stream(request, body, spec, conversation, handle, out, rid, created, model))
        fin, _ = await collect(handle, out)
        c = fin.completion
        _note_usage(request, c.prompt_tokens, len(c.tokens), fin.cached_tokens)
        calls = spec.calls(c.parsed)
        return finish_response(body, conversation, c, fin, rid, created, model, rsp.output_items(c.parsed, calls))

    @app.get("/v1/responses/{rid}")
    async def stored_response(rid: str, request: Request):
        check_key(request)
        return stored.get(rid)[0]

    @app.post("/v1/responses/{rid}/compact")
    async def compact_response(rid: str, request: Request):
        return rsp.compact(stored, rid, await body_of(request, model_required=False), tok, settings.model_name)

    def finish_response(body, conversation, c, fin, rid, created, model, output) -> dict[str, Any]:
        """The final response object (stored with its conversation unless `store` is false)."""
        status, incomplete = rsp.status_of(c.finish_reason)
        reasoning = c.thinking_tokens if c.thinking_tokens is not None else (
            len(tok.encode(c.parsed.reasoning_content)) if c.parsed.reasoning_content else 0)
        response = rsp.response_object(rid, model, created, body, output, status,
                                       rsp.usage(c.prompt_tokens, len(c.tokens), fin.cached_tokens, reasoning),
                                       incomplete)
        if body.get("store", True):
            calls = [item for item in output if item["type"] == "function_call"]
            reply = rsp.assistant_message(c.parsed, [SimpleCall(i["call_id"], i["name"], i["arguments"])
                                                     for i in calls])
            stored.put(response, conversation + [reply])
        return response

    async def written(request, spec, handle, out, writer, finish) -> AsyncIterator[str]:
        """A stream of `writer`'s events: each step's parser events fed to it, then, once the
        request finished, its last events (`writer.finish()`) and `finish(completion, Finished)`'s."""
        async for item in events(handle, out):
            if isinstance(item, Finished):
                c = item.completion
                _note_usage(request, c.prompt_tokens, len(c.tokens), item.cached_tokens)
                for line in [*writer.finish(), *finish(c, item)]:
                    yield line
                return
            for ev in item.delta.events:
                for line in writer.feed(ev, spec):
                    yield line

    async def _responses_stream(request, body, spec, conversation, handle, out, rid, created, model):
        writer = _ItemWriter()
        start = rsp.response_object(rid, model, created, body, [], "in_progress", None)
        yield writer.event("response.created", {"response": start})
        yield writer.event("response.in_progress", {"response": start})

        def finish(c, fin) -> list[str]:
            final = finish_response(body, conversation, c, fin, rid, created, model, writer.items)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            return [writer.event(kind, {"response": final})]

        try:
            async for line in written(request, spec, handle, out, writer, finish):
                yield line
        except APIError as e:
            yield writer.event("error", {"code": e.kind, "message": e.message, "param": e.param})

    # ---- Anthropic -------------------------------------------------------------------------
    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await body_of(request)
        spec = anth.messages_spec(body, tok, max_len, image_dir=settings.image_dir, grammar=settings.grammar)
        handle, out = submit(spec, request)
        mid, model = anth.new_id(), settings.model_name
        if body.get("stream"):
            return _sse(_messages_stream(request, spec, handle, out, mid, model))
        fin, _ = await collect(handle, out)
        c = fin.completion
        _note_usage(request, c.prompt_tokens, len(c.tokens), fin.cached_tokens)
        calls = spec.calls(c.parsed)
        reason, seq = anth.stop_reason(c.finish_reason, c.stop, calls)
        return anth.message(mid, model, anth.content_blocks(c.parsed, calls), reason, seq,
                            c.prompt_tokens, len(c.tokens), fin.cached_tokens)

    async def _messages_stream(request, spec, handle, out, mid, model):
        n_prompt = len(spec.request.prompt)
        yield anth.event("message_start", {"message": anth.message(mid, model, [], None, None, n_prompt, 0, 0)})
        def finish(c, fin) -> list[str]:
            reason, seq = anth.stop_reason(c.finish_reason, c.stop, spec.calls(c.parsed))
            return [anth.event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                                 "usage": {"output_tokens": len(c.tokens)}}),
                    anth.event("message_stop", {})]

        try:
            async for line in written(request, spec, handle, out, _BlockWriter(), finish):
                yield line
        except APIError as e:
            yield f"event: error\ndata: {json.dumps(error_body('/v1/messages', e))}\n\n"

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await body_of(request)
        return {"input_tokens": anth.count_tokens(body, tok, image_dir=settings.image_dir)}

    return app


def _sse(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chat_delta(evs, spec: GenSpec) -> dict[str, Any]:
    """One OpenAI stream delta from one step's parser events: same-kind texts joined, and one
    ``tool_calls`` entry per call index (its start and its arguments so far, in order), as
    clients that read ``delta.tool_calls[0]`` or merge entries by index both expect."""
    delta: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for ev in evs:
        if isinstance(ev, ReasoningDelta):
            delta["reasoning_content"] = delta.get("reasoning_content", "") + ev.text
        elif isinstance(ev, ContentDelta):
            delta["content"] = delta.get("content", "") + ev.text
        elif isinstance(ev, ToolCallStart) and spec.keeps_call(ev.index):
            calls[ev.index] = {"index": ev.index, "id": ev.id, "type": "function",
                               "function": {"name": ev.name, "arguments": ""}}
        elif isinstance(ev, ToolCallArgsDelta) and spec.keeps_call(ev.index):
            entry = calls.setdefault(ev.index, {"index": ev.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += ev.arguments
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta


@dataclasses.dataclass(frozen=True)
class SimpleCall:
    """A returned call as `_openai.chat_message` reads it (id, name, arguments)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _ItemWriter:
    """Responses stream events: output items in order (reasoning → message → function calls),
    one open at a time, each added, filled by deltas and done; every event numbered."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []  # output items, final once done
        self.open: str | None = None
        self.calls: dict[int, int] = {}  # parser call index -> output index
        self.seq = 0

    def event(self, kind: str, data: dict[str, Any]) -> str:
        self.seq += 1
        return rsp.event(kind, self.seq - 1, data)

    def _add(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = kind
        return out + [self.event("response.output_item.added", {"output_index": len(self.items) - 1,
                                                                 "item": {**item, "status": "in_progress"}})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def close(self) -> list[str]:
        if self.open is None:
            return []
        item, where, out = self.items[-1], self._where(), []
        if self.open == "reasoning":
            out.append(self.event("response.reasoning_text.done",
                                  {**where, "content_index": 0, "text": item["content"][0]["text"]}))
        elif self.open == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done",
                                  {**where, "content_index": 0, "text": part["text"], "logprobs": []}))
            out.append(self.event("response.content_part.done", {**where, "content_index": 0, "part": part}))
        elif self.open == "function_call":
            out.append(self.event("response.function_call_arguments.done",
                                  {**where, "name": item["name"], "arguments": item["arguments"]}))
        out.append(self.event("response.output_item.done", {"output_index": len(self.items) - 1, "item": item}))
        self.open = None
        return out

    def feed(self, ev, spec: GenSpec) -> list[str]:
        out: list[str] = []
        if isinstance(ev, ReasoningDelta):
            if self.open != "reasoning":
                out += self._add("reasoning", rsp.reasoning_item(rsp.new_id("rs"), ""))
            self.items[-1]["content"][0]["text"] += ev.text
            out.append(self.event("response.reasoning_text.delta", {**self._where(), "content_index": 0,
                                                                     "delta": ev.text}))
        elif isinstance(ev, ContentDelta) and ev.text:
            if self.open != "message":
                out += self._add("message", rsp.message_item(rsp.new_id("msg"), ""))
                out.append(self.event("response.content_part.added", {**self._where(), "content_index": 0, "part": {
                    "type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
            self.items[-1]["content"][0]["text"] += ev.text
            out.append(self.event("response.output_text.delta", {**self._where(), "content_index": 0,
                                                                  "delta": ev.text, "logprobs": []}))
        elif isinstance(ev, ToolCallStart) and spec.keeps_call(ev.index):
            out += self._add("function_call", rsp.call_item(rsp.new_id("fc"), SimpleCall(ev.id, ev.name, "")))
            self.calls[ev.index] = len(self.items) - 1
        elif isinstance(ev, ToolCallArgsDelta) and self.calls.get(ev.index) == len(self.items) - 1 and self.open:
            self.items[-1]["arguments"] += ev.arguments
            out.append(self.event("response.function_call_arguments.delta", {**self._where(),
                                                                              "delta": ev.arguments}))
        return out

    def finish(self) -> list[str]:
        """Close the open item; a reply with neither text nor calls still gets its (empty) message."""
        out = self.close()
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            out += self._add("message", rsp.message_item(rsp.new_id("msg"), ""))
            out += self.close()
        return out


class _BlockWriter:
    """Anthropic content-block events: thinking → text → tool_use, one block open at a time."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [anth.event("content_block_start", {"index": self.index, "content_block": block})]

    def finish(self) -> list[str]:
        return self.close()

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(anth.event("content_block_delta", {"index": self.index,
                                                          "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(anth.event("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def feed(self, ev, spec: GenSpec) -> list[str]:
        out: list[str] = []
        if isinstance(ev, ReasoningDelta):
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(anth.event("content_block_delta", {"index": self.index,
                                                          "delta": {"type": "thinking_delta", "thinking": ev.text}}))
        elif isinstance(ev, ContentDelta) and ev.text:
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(anth.event("content_block_delta", {"index": self.index,
                                                          "delta": {"type": "text_delta", "text": ev.text}}))
        elif isinstance(ev, ToolCallStart) and spec.keeps_call(ev.index):
            out += self._start("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif isinstance(ev, ToolCallArgsDelta) and spec.keeps_call(ev.index) and self.open == "tool_use":
            out.append(anth.event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": ev.arguments}}))
        return out
