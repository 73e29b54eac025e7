"""``pagedserve serve``: load the engine, bind the socket, run uvicorn until SIGINT/SIGTERM.
Either signal shuts down gracefully (uvicorn stops accepting, open responses get up to 5 s, the
engine thread stops); then SIGTERM exits with status 0 and SIGINT with 130."""

from __future__ import annotations

import signal
import socket
import sys
import threading

from pagedserve.engine import LLMEngine


def run_server(engine: LLMEngine, served_model_name: str, host: str = "127.0.0.1",
               port: int = 8000, api_key: str | None = None,
               max_num_waiting: int | None = None, max_body_bytes: int | None = None,
               log_level: str = "warning", tool_call_parser: str = "smollm2") -> None:
    """Serve ``engine`` on ``host:port`` (port 0: any free port) until interrupted.

    Raises:
        OSError: the address cannot be bound (in use, bad host).
    """
    import uvicorn

    from pagedserve.server.api import DEFAULT_MAX_BODY_BYTES, build_app

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host

    def ready() -> None:
        print(f"pagedserve: serving {served_model_name!r} at http://{shown}:{bound_port}/v1 "
              f"(Ctrl-C to stop)", file=sys.stderr, flush=True)

    app = build_app(engine, served_model_name, api_key=api_key,
                    max_num_waiting=max_num_waiting,
                    max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, on_ready=ready,
                    tool_call_parser=tool_call_parser)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal after its graceful shutdown; let SIGTERM end as exit 0
        signal.signal(signal.SIGTERM, _exit_zero)
    uvicorn.Server(config).run(sockets=[sock])


def _exit_zero(signum, frame) -> None:
    raise SystemExit(0)
