"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI) over an engine thread, and
``run_server`` (uvicorn) behind ``pagedserve serve``."""

from pagedserve.server.api import build_app
from pagedserve.server.launch import run_server

__all__ = ["build_app", "run_server"]
