"""Every ``PAGEDSERVE_*`` environment variable, read here and nowhere else.

Each is read when asked for (not at import), so a test or a launcher can set it first.

| variable | default | meaning |
|---|---|---|
| ``PAGEDSERVE_CACHE`` | the user cache dir | where the default model is cached |
| ``PAGEDSERVE_API_KEY`` | unset | the server's API key when ``--api-key`` is not given |
| ``PAGEDSERVE_CPU_KERNELS`` | ``1`` | ``0``: the torch path instead of the fused CPU kernels; ``unpacked``: the kernels with torch's matmuls (read when a model is built) |
| ``PAGEDSERVE_DEBUG_KV`` | ``0`` | ``1`` checks the block pool invariants after every step |
| ``PAGEDSERVE_CONTENTION_GUARD`` | ``1`` | ``0``: keep the thread count and libgomp's spinning when the cores are shared (pagedserve.cpu.ContentionGuard; the tests, whose equalities must not depend on a thread count changing mid-run) |
| ``PAGEDSERVE_LOGGING_LEVEL`` | ``INFO`` | the ``pagedserve`` logger's level |
| ``PAGEDSERVE_TP_EXTERNAL`` | ``0`` | ``1``: tensor-parallel ranks are started by hand |
| ``PAGEDSERVE_TP_TIMEOUT`` | ``600`` | seconds a collective waits for a silent peer |
| ``PAGEDSERVE_TP_PARENT`` | set by the engine | a local worker's parent pid (it exits with it) |
"""

from __future__ import annotations

import os

DEFAULT_TP_TIMEOUT_SECONDS = 600.0
_FALSE = ("", "0", "false", "no", "off")


def _get(name: str) -> str | None:
    return os.environ.get(name)


def cache_dir() -> str | None:
    return _get("PAGEDSERVE_CACHE")


def api_key() -> str | None:
    return _get("PAGEDSERVE_API_KEY")


def cpu_kernels() -> str:
    """The raw switch ("1" unless set); ``pagedserve.kernels`` interprets it."""
    return _get("PAGEDSERVE_CPU_KERNELS") or "1"


def debug_kv() -> bool:
    return (_get("PAGEDSERVE_DEBUG_KV") or "0").strip().lower() not in _FALSE


def contention_guard() -> bool:
    return (_get("PAGEDSERVE_CONTENTION_GUARD") or "1").strip().lower() not in _FALSE


def logging_level() -> str:
    return (_get("PAGEDSERVE_LOGGING_LEVEL") or "INFO").upper()


def tp_external() -> bool:
    return _get("PAGEDSERVE_TP_EXTERNAL") == "1"


def tp_parent() -> int | None:
    value = _get("PAGEDSERVE_TP_PARENT")
    return int(value) if value else None


def tp_timeout() -> float:
    """Seconds start-up and each collective wait for a silent peer. Generous by default,
    because a slow step or model load on oversubscribed cores is not a dead worker (a dead
    local worker is noticed within a second anyway). Raises ValueError for a value that is
    not a positive finite number."""
    raw = _get("PAGEDSERVE_TP_TIMEOUT") or ""
    try:
        seconds = float(raw) if raw.strip() else DEFAULT_TP_TIMEOUT_SECONDS
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"PAGEDSERVE_TP_TIMEOUT must be a positive number of seconds, "
                         f"got {raw!r}")
    return seconds
