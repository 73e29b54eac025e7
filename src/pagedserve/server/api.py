"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
tokenize / detokenize and Prometheus metrics, over an AsyncEngine.

Every error is OpenAI's error JSON with a 4xx status (malformed body 400, unknown model 404,
auth 401, body too large 413, queue full 429, engine dead 503); the engine keeps serving after
each. A request whose client goes away, streaming or not, is aborted and its blocks freed.
Streamed text deltas concatenate to exactly the non-streamed text (the detokenizer holds back
possible stop-string prefixes and incomplete UTF-8).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedserve.engine import LLMEngine
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import MAX_LOGPROBS
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError, TooManyRequestsError
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.tokenizer import apply_chat_template, check_text, encode

logger = logging.getLogger("pagedserve")

MIN_LOGPROB = -9999.0  # what -inf (and NaN) logprobs are sent as: JSON has no infinities
DEFAULT_MAX_BODY_BYTES = 16 << 20


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "BadRequestError", 401: "AuthenticationError",
                              404: "NotFoundError", 413: "RequestTooLargeError",
                              429: "RateLimitError", 503: "ServiceUnavailableError"}.get(
                                  status, "APIError")


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else (MIN_LOGPROB if x < 0 or math.isnan(x) else -MIN_LOGPROB)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and abort their requests, when the client disconnects:
    the stream runs beside a task listening for ``http.disconnect`` whatever the server's ASGI
    version (Starlette itself watches only for ASGI < 2.4)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


class _Auth:
    """ASGI middleware: bearer-token auth on ``/v1/*`` (401 otherwise)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope.get("headers", [])).get(b"authorization", b"")
            scheme, _, token = header.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                       self.expected):
                body = json.dumps(error_body(401, "invalid or missing API key (send "
                                                  "'Authorization: Bearer <key>')",
                                             "AuthenticationError")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 (by Content-Length
    before reading, or while reading a chunked body)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._too_large(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"the request body is larger than {self.max_bytes} bytes")
            return message

        return await self.app(scope, limited_receive, send)

    async def _too_large(self, send):
        body = json.dumps(error_body(413, f"the request body is larger than {self.max_bytes} "
                                          "bytes", "RequestTooLargeError")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        raise APIError(400, "the client disconnected while sending the body") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # loc holds field names, list indices and, inside unions, type tags ("str", "list[int]")
        where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or (
            "[" not in p and p not in _TYPE_TAGS)) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise APIError(400, f"{where}: {first['msg']}{more}", param=where) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()  # its requests are aborted; nobody is left to read an answer
        return Response(status_code=499)
    return task.result()


def _bad_params(e: ValueError, body: BaseModel) -> APIError:
    """A SamplingParams error as a 400 whose ``param`` is the field it names."""
    name = str(e).split(" ", 1)[0]
    return APIError(400, str(e), param=name if name in type(body).model_fields else None)


def _check_supported(body: Any) -> None:
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"{name} is not supported by this server", param=name)


class OpenAIServing:
    """The handlers' shared state: the engine, the model's name, its limits."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str):
        self.engine = async_engine
        self.model_name = served_model_name
        engine = async_engine.engine
        self.max_model_len = engine.scheduler_config.max_model_len
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "NotFoundError", "model")

    async def add(self, requests: list[tuple[str, Callable[[LLMEngine], Any]]]
                  ) -> list[AsyncIterator[RequestOutput]]:
        try:
            return await self.engine.add(requests)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except TooManyRequestsError as e:
            raise APIError(429, str(e)) from None

    # ---- shared pieces --------------------------------------------------------------------

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def completion_logprobs(self, c: CompletionOutput, offset: int) -> dict:
        """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            text = entry[token_id].decoded_token or ""
            tokens.append(text)
            token_logprobs.append(_finite(entry[token_id].logprob))
            top.append({(lp.decoded_token or ""): _finite(lp.logprob)
                        for lp in sorted(entry.values(), key=lambda lp: lp.rank)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    @staticmethod
    def chat_logprobs(c: CompletionOutput, top_k: int) -> dict:
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[token_id]
            text = chosen.decoded_token or ""
            alternatives = sorted((lp for lp in entry.values() if lp.rank <= top_k),
                                  key=lambda lp: lp.rank)[:top_k]
            content.append({
                "token": text, "logprob": _finite(chosen.logprob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": lp.decoded_token or "",
                                  "logprob": _finite(lp.logprob),
                                  "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                                 for lp in alternatives]})
        return {"content": content}


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a final-only stream."""
    last = None
    async for last in stream:  # noqa: B007
        pass
    return last


def _completion_prompts(prompt: Any) -> list[Any]:
    """The completions ``prompt`` field as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [{"prompt_token_ids": ids} for ids in prompt]


def build_app(engine: LLMEngine, served_model_name: str, *, api_key: str | None = None,
              max_num_waiting: int | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``. Its engine thread starts with the app's lifespan
    and stops with it (``app.state.async_engine``; metrics in ``app.state.metrics``).

    Args:
        api_key: if set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_num_waiting: requests allowed to wait for admission; beyond it 429.
        max_body_bytes: largest request body (413 beyond).
        on_ready: called once the engine thread runs (the CLI prints the URL).
    """
    metrics = ServerMetrics(served_model_name)
    async_engine = AsyncEngine(engine, max_num_waiting, on_step=metrics.update)
    serving = OpenAIServing(async_engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="pagedserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(_Auth, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(APIError(400, str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return _error_response(APIError(503, str(e)))

    # ---- GET endpoints ------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not async_engine.is_healthy:
            return _error_response(APIError(503, f"the engine is not running: "
                                                 f"{async_engine.failure}"))
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": serving.created,
            "owned_by": "pagedserve", "root": str(engine.model_path),
            "max_model_len": serving.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- tokenize / detokenize --------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either 'prompt' or 'messages'")

        def run(e: LLMEngine) -> list[int]:
            if e.tokenizer is None:
                raise ValueError("the server runs without a tokenizer")
            if body.messages is not None:
                return apply_chat_template(
                    e.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])[1]
            check_text(body.prompt)
            if body.add_special_tokens:
                return encode(e.tokenizer, body.prompt)
            return e.tokenizer.encode(body.prompt, add_special_tokens=False)

        try:
            tokens = await async_engine.call(run)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        serving.check_model(body.model)

        def run(e: LLMEngine) -> str:
            vocab = e.model_config.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
            if e.tokenizer is None:
                raise ValueError("the server runs without a tokenizer")
            return e.tokenizer.decode(body.tokens)

        try:
            return {"prompt": await async_engine.call(run)}
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # ---- completions --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await _parse(request, CompletionRequest)
        serving.check_model(body.model)
        _check_supported(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _completion_prompts(body.prompt)
        max_tokens = body.max_tokens
        if max_tokens is not None and max_tokens < 0:
            raise APIError(400, f"max_tokens must be at least 0, got {max_tokens}",
                           param="max_tokens")
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo)",
                           param="max_tokens")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported",
                           param="logprobs")
        if max_tokens == 0:
            return await _echo_only(body, prompts)
        try:
            params = body.sampling_params(max_tokens, body.logprobs)
        except ValueError as e:
            raise _bad_params(e, body) from None
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [f"{rid}-{i}" for i in range(len(prompts))]

        def maker(request_id: str, prompt: Any):
            if isinstance(prompt, str):
                prompt = {"prompt": prompt}
            if body.cache_salt is not None:
                prompt = {**prompt, "cache_salt": body.cache_salt}
            return lambda e: e.add_request(request_id, prompt, params)

        streams = await serving.add([(i, maker(i, p)) for i, p in zip(ids, prompts)])
        if body.stream:
            return _EventStream(_guard(_stream_completion(body, rid, streams), ids))
        return await _unless_disconnected(request, _guard_await(
            _full_completion(body, rid, streams), ids))

    def _guard(gen: AsyncIterator[str], ids: list[str]) -> AsyncIterator[str]:
        async def guarded():
            try:
                async for chunk in gen:
                    yield chunk
            except EngineDeadError as e:
                yield _sse(error_body(503, str(e), "ServiceUnavailableError"))
                yield "data: [DONE]\n\n"
            finally:
                for i in ids:
                    async_engine.abort(i)
        return guarded()

    async def _guard_await(work: Awaitable[Any], ids: list[str]) -> Any:
        try:
            return await work
        finally:
            for i in ids:
                async_engine.abort(i)

    async def _echo_only(body: CompletionRequest, prompts: list[Any]) -> Any:
        def run(e: LLMEngine) -> list[tuple[str, list[int]]]:
            out = []
            for p in prompts:
                text, ids, _ = e.process_prompt({"prompt": p} if isinstance(p, str) else p)
                if text is None:
                    text = e.tokenizer.decode(ids) if e.tokenizer is not None else ""
                out.append((text, ids))
            return out

        try:
            rendered = await async_engine.call(run)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        choices = [{"index": i * body.n + k, "text": text, "logprobs": None,
                    "finish_reason": "length", "stop_reason": None}
                   for i, (text, _) in enumerate(rendered) for k in range(body.n)]
        response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": int(time.time()), "model": served_model_name,
                    "choices": choices,
                    "usage": serving.usage(sum(len(ids) for _, ids in rendered), 0, 0)}
        if not body.stream:
            return response

        async def events():
            head = {k: response[k] for k in ("id", "object", "created", "model")}
            for choice in choices:
                yield _sse({**head, "choices": [choice]})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**head, "choices": [], "usage": response["usage"]})
            yield "data: [DONE]\n\n"

        return _EventStream(events())

    async def _full_completion(body: CompletionRequest, rid: str, streams) -> dict:
        outs: list[RequestOutput] = await asyncio.gather(*(_last(s) for s in streams))
        choices = []
        for i, out in enumerate(outs):
            prefix = (out.prompt or "") if body.echo else ""
            for c in out.outputs:
                choices.append({
                    "index": i * body.n + c.index, "text": prefix + c.text,
                    "logprobs": serving.completion_logprobs(c, len(prefix))
                    if body.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices,
                "usage": serving.usage(sum(len(o.prompt_token_ids) for o in outs),
                                       sum(len(c.token_ids) for o in outs for c in o.outputs),
                                       sum(o.num_cached_tokens for o in outs))}

    async def _merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the stream's index."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as e:
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _stream_completion(body: CompletionRequest, rid: str, streams):
        created = int(time.time())
        prompt_tokens = completion_tokens = cached = 0
        offsets: dict[int, int] = {}

        def chunk(index: int, text: str, logprobs, finish_reason, stop_reason) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": created,
                         "model": served_model_name,
                         "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish_reason,
                                      "stop_reason": stop_reason}]})

        started: set[int] = set()
        async for i, out in _merged(streams):
            if i not in started:
                started.add(i)
                prompt_tokens += len(out.prompt_token_ids)
                cached += out.num_cached_tokens
                if body.echo:
                    for k in range(body.n):
                        offsets[i * body.n + k] = len(out.prompt or "")
                        yield chunk(i * body.n + k, out.prompt or "", None, None, None)
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                index = i * body.n + c.index
                completion_tokens += len(c.token_ids)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = serving.completion_logprobs(c, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(c.text)
                yield chunk(index, c.text, logprobs, c.finish_reason, c.stop_reason)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created,
                        "model": served_model_name, "choices": [],
                        "usage": serving.usage(prompt_tokens, completion_tokens, cached)})
        yield "data: [DONE]\n\n"

    # ---- chat completions ----------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        serving.check_model(body.model)
        _check_supported(body)
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        field = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = getattr(body, field)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{field} must be at least 1, got {max_tokens}", param=field)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                f"{body.top_logprobs}", param="top_logprobs")
        top_k = body.top_logprobs or 0
        try:
            params = body.sampling_params(max_tokens, top_k if body.logprobs else None)
        except ValueError as e:
            raise _bad_params(e, body) from None
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def make(e: LLMEngine) -> None:
            if e.tokenizer is None:
                raise ValueError("the server runs without a tokenizer")
            text, ids = apply_chat_template(e.tokenizer, messages, body.add_generation_prompt)
            prompt: dict = {"prompt": text, "prompt_token_ids": ids}
            if body.cache_salt is not None:
                prompt["cache_salt"] = body.cache_salt
            e.add_request(rid, prompt, params)

        streams = await serving.add([(rid, make)])
        if body.stream:
            return _EventStream(_guard(_stream_chat(body, rid, streams[0], top_k), [rid]))
        return await _unless_disconnected(request, _guard_await(
            _full_chat(body, rid, streams[0], top_k), [rid]))

    async def _full_chat(body: ChatCompletionRequest, rid: str, stream, top_k: int) -> dict:
        out = await _last(stream)
        choices = [{"index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": serving.chat_logprobs(c, top_k) if body.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name, "choices": choices,
                "usage": serving.usage(len(out.prompt_token_ids),
                                       sum(len(c.token_ids) for c in out.outputs),
                                       out.num_cached_tokens)}

    async def _stream_chat(body: ChatCompletionRequest, rid: str, stream, top_k: int):
        created = int(time.time())

        def chunk(choices: list[dict], **extra) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": served_model_name, "choices": choices, **extra})

        yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for k in range(body.n)])
        prompt_tokens = completion_tokens = cached = 0
        async for out in stream:
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                yield chunk([{"index": c.index, "delta": {"content": c.text} if c.text else {},
                              "logprobs": serving.chat_logprobs(c, top_k)
                              if body.logprobs else None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=serving.usage(prompt_tokens, completion_tokens, cached))
        yield "data: [DONE]\n\n"

    return app
