"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
tokenize / detokenize and Prometheus metrics, over an AsyncEngine.

Every error is OpenAI's error JSON with a 4xx status (the table in ``server.errors``), 500 only
for a request the engine itself failed on, 503 once the engine is dead; the engine keeps
serving after each. A request whose client goes away, streaming or not, is aborted and its
blocks freed. Streamed text deltas concatenate to exactly the non-streamed text (the
detokenizer holds back possible stop-string prefixes and incomplete UTF-8).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedserve.engine import LLMEngine
from pagedserve.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import (
    CHAT_UNIMPLEMENTED,
    COMPLETION_UNIMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    unimplemented_field,
)
from pagedserve.server.serving import OpenAIServing

DEFAULT_MAX_BODY_BYTES = 16 << 20
# Routes open without the API key, as in vLLM: probes and scrapers carry no credentials.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class _Auth:
    """ASGI middleware: bearer-token auth on every route but ``OPEN_PATHS`` (401)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope.get("headers", [])).get(b"authorization", b"")
            scheme, _, token = header.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                       self.expected):
                return await APIError(401, "invalid or missing API key (send 'Authorization: "
                                           "Bearer <key>')").send(send)
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 (by Content-Length
    before reading, or while reading a chunked body)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = APIError(413, f"the request body is larger than {self.max_bytes} bytes")
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await error.send(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise error
            return message

        return await self.app(scope, limited_receive, send)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


class _BadNumber:
    """A number no field can take: one Python's json accepts but JSON has not (NaN, Infinity,
    1e999), or an integer of more digits than any 64-bit field (which Python would otherwise
    refuse as "not valid JSON" past 4,300 digits)."""

    def __init__(self, text: str, why: str = "is not a finite number"):
        self.text, self.why = text, why


def _parse_float(text: str) -> float | _BadNumber:
    value = float(text)
    return value if value not in (float("inf"), float("-inf")) else _BadNumber(text)


def _parse_int(text: str) -> int | _BadNumber:
    if len(text.lstrip("-")) > 40:
        return _BadNumber(text[:20] + "...", "is too large for any field")
    return int(text)


def _bad_number_at(value: Any, path: tuple = ()) -> tuple[tuple, _BadNumber] | None:
    """(path, number) of the first number no field can take in a parsed body."""
    if isinstance(value, _BadNumber):
        return path, value
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _bad_number_at(item, (*path, key))
        if found is not None:
            return found
    return None


async def _parse(request: Request, model: type[BaseModel],
                 unimplemented: dict[str, tuple] | None = None,
                 precheck: Callable[[dict], None] | None = None) -> Any:
    """The body as ``model``. Raises APIError(400) for JSON that is not an object, a number
    no field can take (NaN, Infinity, thousands of digits), a field ``unimplemented`` lists
    set to something not "off", what ``precheck`` refuses on the raw body (sizes, before the
    costlier validation), and any validation error, naming the field. A null in a field
    whose default is not null means the default, as in OpenAI's API."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        raise APIError(400, "the client disconnected while sending the body") from None
    try:
        data = json.loads(raw, parse_constant=_BadNumber, parse_float=_parse_float,
                          parse_int=_parse_int)
        found = _bad_number_at(data)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if found is not None:
        where = ".".join(str(p) for p in found[0])
        raise APIError(400, f"{where}: {found[1].text} {found[1].why}", param=where)
    name = unimplemented_field(data, unimplemented or {})
    if name is not None:
        raise APIError(400, f"{name} is not supported by this server", param=name)
    fields = model.model_fields
    data = {k: v for k, v in data.items()
            if v is not None or k not in fields or fields[k].default is None}
    if precheck is not None:
        precheck(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        # loc holds field names, list indices and, inside unions, type tags ("str", "list[int]")
        where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or (
            "[" not in p and p not in _TYPE_TAGS)) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise APIError(400, f"{where}: {first['msg']}{more}", param=where) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    unsupported = getattr(body, "unsupported", lambda: None)()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server", param=unsupported)
    return body


def build_app(engine: LLMEngine, served_model_name: str, *, api_key: str | None = None,
              max_num_waiting: int | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              on_ready: Callable[[], None] | None = None,
              tool_call_parser: str = "smollm2") -> FastAPI:
    """The FastAPI app serving ``engine``. Its engine thread starts with the app's lifespan
    and stops with it (``app.state.async_engine``; metrics in ``app.state.metrics``).

    Args:
        api_key: if set, every route but /health and /metrics needs ``Authorization: Bearer
            <api_key>``.
        max_num_waiting: requests allowed to wait for admission; beyond it 429.
        max_body_bytes: largest request body (413 beyond).
        on_ready: called once the engine thread runs (the CLI prints the URL).
        tool_call_parser: the model's tool-call format (``tool_parsers.TOOL_PARSERS``).
    """
    metrics = ServerMetrics(served_model_name, engine.kv_cache_stats().kv_groups)
    async_engine = AsyncEngine(engine, max_num_waiting, on_step=metrics.update)
    serving = OpenAIServing(async_engine, served_model_name, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            serving.close()
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="pagedserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(_Auth, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return APIError(400, str(e)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return APIError(503, str(e)).response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not async_engine.is_healthy:
            return APIError(503, f"the engine is not running: {async_engine.failure}").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return serving.model(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize(await _parse(request, TokenizeRequest,
                                                   precheck=serving.check_chat_size))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.detokenize(await _parse(request, DetokenizeRequest))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest, COMPLETION_UNIMPLEMENTED,
                            serving.check_completion_size)
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest, CHAT_UNIMPLEMENTED,
                            serving.check_chat_size)
        return await serving.chat(body, request)

    return app
