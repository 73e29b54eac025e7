"""The server's error contract: every error is OpenAI's error JSON with its HTTP status.

==========================================  ======  ==========================================
what                                        status  body
==========================================  ======  ==========================================
malformed body, bad field, unknown vLLM     400     ``param`` names the field
field set, prompt id outside the vocabulary
prompt (+ max_tokens) beyond the context    400     ``code: "context_length_exceeded"``
missing or wrong API key                    401
unknown model / route                       404
wrong method                                405     ``Allow`` header
body over ``max_body_bytes``                413
waiting queue full                          429     ``Retry-After`` header
the engine failed on this request           500     the request alone; others go on
engine dead (worker died, repeated failed   503     ``/health`` answers 503 too
steps, shutting down)
==========================================  ======  ==========================================
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from pagedserve.inputs import ContextLengthError

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``. ``code`` defaults to the
    status (as vLLM sends it); ``headers`` go with the response."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None, code: int | str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or _TYPES.get(status, "APIError")
        self.code = status if code is None else code
        self.headers = headers

    @classmethod
    def bad_input(cls, e: ValueError, param: str | None = None) -> APIError:
        """A refused request: 400, with OpenAI's code for a context-length error."""
        if isinstance(e, ContextLengthError):
            return cls(400, str(e), param=param or "messages", code="context_length_exceeded")
        return cls(400, str(e), param=param)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def raw(self) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """(headers, body) for ASGI middleware that answers before the app runs."""
        body = json.dumps(self.body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (self.headers or {}).items()]
        return headers, body

    async def send(self, send) -> None:
        headers, body = self.raw()
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
