"""The OpenAI-compatible HTTP API over the engine (Starlette, served by uvicorn).

Routes: ``GET /health`` (503 while the model loads), ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (the tokenizer's chat template). ``stream: true`` answers with
Server-Sent Events in OpenAI's chunk format, one event per step's new text, ``data: [DONE]``
last. Errors are OpenAI-shaped JSON (:class:`~llm.serve.protocol.APIError`); a full queue answers
429 with ``Retry-After``; a body larger than :func:`max_body_bytes` 413 before it is read whole.
Requests are parsed and tokenized off the event loop; a client that disconnects cancels its
sequences, whose rows the engine frees at its next step. The model loads on a thread of its own after the server starts listening.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llm.generation.config import GenerationConfig
from llm.serve.engine import Engine, QueueFull, ShuttingDown
from llm.serve.metrics import Metrics, RequestClock
from llm.serve.protocol import (APIError, TextStream, Usage, chunk, logprobs_json, new_id, parse_body,
                                parse_request, response, usage, usage_chunk)

log = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) when the queue is full.
RETRY_AFTER_S = 1


@dataclass
class Served:
    """What the server serves, once loaded.

    Attributes:
        engine: the running :class:`~llm.serve.engine.Engine`.
        tokenizer: the model's tokenizer (:func:`llm.load_tokenizer`'s).
        name: the model's id in the API (``model`` fields, ``/v1/models``).
        defaults: the model's generation config (sampling defaults and eos id), under each
            request's fields.
        max_seq_len: the context: prompt + max_tokens may not exceed it.
    """

    engine: Engine
    tokenizer: object
    name: str
    defaults: GenerationConfig
    max_seq_len: int


class _State:
    def __init__(self, load: Callable[[], Served], on_failure: Callable[[str], None] | None):
        self.load, self.on_failure, self.served, self.failure = load, on_failure, None, None
        self.started = int(time.time())
        self.metrics = Metrics(running=lambda: self.served.engine.running if self.served else 0,
                               waiting=lambda: self.served.engine.waiting if self.served else 0)

    def loader(self) -> None:
        try:
            self.served = self.load()
        except Exception as err:
            log.debug("loading the model failed", exc_info=True)
            self.failure = f"{type(err).__name__}: {err}"
            if self.on_failure is not None:
                self.on_failure(self.failure)

    def ready(self) -> Served:
        if self.served is None:
            why = f"loading the model failed: {self.failure}" if self.failure else "the model is still loading"
            raise APIError(503, why, code="model_not_ready")
        return self.served


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _APIKey:
    """ASGI middleware: the ``/v1`` routes answer only requests that carry ``Authorization: Bearer
    KEY`` (401, as OpenAI answers a wrong key, otherwise); ``/health`` and ``/metrics`` stay open
    (vLLM's ``--api-key`` does the same)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessed byte by byte
                why = "Incorrect API key provided" if given else "Missing API key: send Authorization: Bearer KEY"
                await _error(APIError(401, why, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(load: Callable[[], Served], on_failure: Callable[[str], None] | None = None,
               api_key: str | None = None) -> Starlette:
    """The ASGI app; ``load`` (run on a thread at startup) builds what it serves; if it raises,
    ``/health`` says why (503) and ``on_failure`` gets the message. With ``api_key``, the ``/v1``
    routes need ``Authorization: Bearer API_KEY``. ``GET /metrics`` reports in Prometheus's format
    (:mod:`llm.serve.metrics`). ``app.state.shutdown()`` (any
    thread) ends every request with a 503 "the server is shutting down" (an error event, then
    ``[DONE]``, in a stream) and refuses new ones: what a server stopping for good calls.

    Example:
        >>> app = create_app(lambda: Served(engine, tokenizer, "my-model", GenerationConfig(), 2048))  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    state = _State(load, on_failure)

    @asynccontextmanager
    async def lifespan(app):
        thread = threading.Thread(target=state.loader, name="llm-loader", daemon=True)
        thread.start()
        yield
        if state.served is not None:
            await asyncio.to_thread(state.served.engine.close)

    async def health(request: Request):
        if state.served is not None:
            engine = state.served.engine
            return JSONResponse({"status": "ok", "running": engine.running, "waiting": engine.waiting})
        status = "error" if state.failure else "loading"
        return JSONResponse({"status": status, "error": state.failure}, status_code=503)

    async def models(request: Request):
        try:
            served = state.ready()
        except APIError as err:
            return _error(err)
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": state.started, "owned_by": "llm"}]})

    async def model(request: Request):
        try:
            served = state.ready()
        except APIError as err:
            return _error(err)
        if request.path_params["name"] != served.name:
            return _error(APIError(404, f"The model `{request.path_params['name']}` does not exist. This server "
                                        f"serves `{served.name}`.", "model", "model_not_found"))
        return JSONResponse({"id": served.name, "object": "model", "created": state.started, "owned_by": "llm"})

    async def completions(request: Request):
        return _counted(await _complete(request, state, chat=False), state, "/v1/completions")

    async def chat_completions(request: Request):
        return _counted(await _complete(request, state, chat=True), state, "/v1/chat/completions")

    async def metrics(request: Request):
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    routes = [Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
              Route("/v1/models/{name:path}", model),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    # browsers' chat UIs call from other origins, as they do llama-server and vLLM (both allow any)
    middleware = [Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])]
    if api_key:
        middleware.append(Middleware(_APIKey, key=api_key))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.served = state
    app.state.shutdown = lambda: state.served is not None and state.served.engine.shutdown()
    return app


def _counted(response: Response, state: _State, route: str) -> Response:
    state.metrics.responses.labels(route=route, status=str(response.status_code)).inc()
    return response


async def _not_found(request: Request, exc):
    return _error(APIError(404, f"no route {request.method} {request.url.path}: this server has GET /health, "
                                "GET /v1/models, POST /v1/completions and POST /v1/chat/completions",
                           code="not_found"))


async def _not_allowed(request: Request, exc):
    return _error(APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"))


def max_body_bytes(max_seq_len: int) -> int:
    """The largest request body the server reads: 1 KiB per position of the context, at least
    1 MiB (a prompt that fills the context is far smaller, even JSON-escaped)."""
    return max(1 << 20, 1024 * max_seq_len)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed ``limit`` bytes (by
    its Content-Length, or while it arrives), before it is parsed or tokenized."""
    too_large = APIError(413, f"the request body is larger than this server takes ({limit:,} bytes; "
                              f"1 KiB per position of the model's context)", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise too_large
        chunks.append(piece)
    return b"".join(chunks)


#: Parsing and tokenizing requests happen here, one at a time, off the event loop: a long prompt
#: must not stall /health and the other clients' streams (a tokenizer is not shared across threads).
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-parse")


async def _complete(request: Request, state: _State, chat: bool):
    try:
        served = state.ready()
        raw = await _read_body(request, max_body_bytes(served.max_seq_len))
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(_PARSER, parse_body, raw)
        model = body.get("model")
        if model is not None and model != served.name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{served.name}`.",
                           "model", "model_not_found")
        parsed = await loop.run_in_executor(_PARSER, functools.partial(
            parse_request, body, chat=chat, tokenizer=served.tokenizer, defaults=served.defaults,
            max_seq_len=served.max_seq_len, max_choices=served.engine.max_queue,
            vocab_size=served.engine.model.config.vocab_size))
        events: asyncio.Queue = asyncio.Queue()

        def callback(sequence, tokens, reason):
            loop.call_soon_threadsafe(events.put_nowait, (sequence, tokens, reason))

        try:
            sequences = served.engine.submit([(parsed.prompts[p], options) for p, options in parsed.choices],
                                             callback, logprobs=parsed.logprobs, grammar=parsed.grammar)
        except ShuttingDown as err:
            raise APIError(503, str(err), code="shutting_down") from None
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry after {RETRY_AFTER_S} s", None,
                           "rate_limit_exceeded", {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as err:
            raise APIError(400, str(err)) from None
    except APIError as err:
        return _error(err)
    run = _Run(served, parsed, sequences, events, chat, RequestClock(state.metrics, len(sequences)))
    if parsed.stream:
        return StreamingResponse(run.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await run.whole(request)


class _Run:
    """One request's sequences, read back from the engine's events."""

    def __init__(self, served: Served, parsed, sequences, events: asyncio.Queue, chat: bool, clock: RequestClock):
        self.served, self.parsed, self.sequences, self.events, self.chat = served, parsed, sequences, events, chat
        self.clock = clock
        self.logprobs: list[list] = [[] for _ in sequences]  # the entries read so far, per choice
        self.offsets = [0] * len(sequences)  # completions' text_offset of each choice's next token
        self.index = {s.id: i for i, s in enumerate(sequences)}
        self.texts = [TextStream(served.tokenizer, parsed.stop) for _ in sequences]
        self.reasons: list[str | None] = [None] * len(sequences)
        self.id = new_id(chat)

    def cancel(self) -> None:
        for sequence in self.sequences:
            if sequence.finish_reason is None:
                sequence.cancel()

    def usage(self) -> Usage:
        prompts = self.parsed.prompts
        n = len(self.sequences) // len(prompts)  # choice i of prompt p is sequence p * n + i
        cached = sum(self.sequences[p * n].cached_tokens for p in range(len(prompts)))
        return usage(sum(len(p) for p in prompts), sum(len(s.tokens) for s in self.sequences), cached)

    def _finish_reason(self, i: int, reason: str) -> str:
        if reason == "cancelled":  # only when the client is gone: nobody reads what follows
            raise APIError(499, "the client closed the request", code="cancelled")
        if reason == "shutdown":
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if reason == "error":
            raise APIError(500, f"decoding failed: {self.sequences[i].error}", code="internal_error")
        return "stop" if self.texts[i].stopped else reason

    def _new_logprobs(self, i: int, tokens: list[int]) -> dict | None:
        """The logprobs of choice ``i``'s new ``tokens`` in OpenAI's form (None unless asked for)."""
        if self.parsed.logprobs is None or not tokens:
            return None
        done = self.logprobs[i]
        entries = self.sequences[i].token_logprobs[len(done):len(done) + len(tokens)]
        done.extend(entries)
        out = logprobs_json(self.chat, entries, self.served.tokenizer, self.offsets[i])
        if not self.chat:
            self.offsets[i] += sum(len(piece) for piece in out["tokens"])
        return out

    async def events_until_done(self):
        """Yield (choice index, new text, finish_reason or None, logprobs of the new tokens or
        None) until every sequence is finished."""
        left = len(self.sequences)
        while left:
            sequence, tokens, reason = await self.events.get()
            i = self.index[sequence.id]
            self.clock.tokens(i, len(tokens))
            logprobs = self._new_logprobs(i, tokens)
            piece = self.texts[i].add(tokens, final=reason is not None)
            if reason is not None:
                left -= 1
                self.clock.finished(reason)
                if not left:
                    usage_ = self.usage()
                    self.clock.done(usage_.prompt_tokens, usage_.prompt_tokens_details.cached_tokens,
                                    sum(s.draft_tokens for s in self.sequences),
                                    sum(s.accepted_tokens for s in self.sequences))
                reason = self._finish_reason(i, reason)
                self.reasons[i] = reason
            yield i, piece, reason, logprobs

    async def whole(self, request: Request):
        async def watch():  # a client gone while we wait: free its rows
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)
            self.cancel()

        watcher = asyncio.create_task(watch())
        try:
            texts = [""] * len(self.sequences)
            async for i, piece, _, _ in self.events_until_done():
                texts[i] += piece
        except APIError as err:
            return _error(err)
        finally:
            watcher.cancel()
        if self.parsed.echo:
            texts = [self.parsed.texts[p] + t for (p, _), t in zip(self.parsed.choices, texts)]
        logprobs = None
        if self.parsed.logprobs is not None:
            logprobs = [logprobs_json(self.chat, entries, self.served.tokenizer) for entries in self.logprobs]
        return JSONResponse(response(self.chat, self.id, self.served.name, self.parsed.created, texts, self.reasons,
                                     self.usage(), logprobs))

    async def sse(self):
        name, created, usage_wanted = self.served.name, self.parsed.created, self.parsed.include_usage

        def event(data: dict) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            for i, (p, _) in enumerate(self.parsed.choices):
                if self.chat:
                    yield event(chunk(True, self.id, name, created, i, role=True, include_usage=usage_wanted))
                elif self.parsed.echo:
                    yield event(chunk(False, self.id, name, created, i, text=self.parsed.texts[p],
                                      include_usage=usage_wanted))
            try:
                async for i, piece, reason, logprobs in self.events_until_done():
                    if piece or logprobs:
                        yield event(chunk(self.chat, self.id, name, created, i, text=piece,
                                          include_usage=usage_wanted, logprobs=logprobs))
                    if reason is not None:
                        yield event(chunk(self.chat, self.id, name, created, i, finish_reason=reason,
                                          include_usage=usage_wanted))
            except APIError as err:
                yield event(err.body())
            else:
                if usage_wanted:
                    yield event(usage_chunk(self.chat, self.id, name, created, self.usage()))
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects and the response is cancelled
            self.cancel()
