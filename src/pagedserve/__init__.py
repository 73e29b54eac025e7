"""pagedserve: an LLM inference and serving engine built around a paged KV cache.

The public names load on first use, so that torch-free commands (``pagedserve --help``,
``pagedserve plan``) do not import torch.
"""

import importlib as _importlib
import logging as _logging

from pagedserve import cpu as _cpu
from pagedserve import envs as _envs

# Before torch loads libgomp, which reads its wait policy once (pagedserve.cpu).
_cpu.limit_spinning()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedserve.llm", "LLMEngine": "pagedserve.engine", "EngineArgs": "pagedserve.config",
    "SamplingParams": "pagedserve.sampling_params",
    "RequestOutputKind": "pagedserve.sampling_params",
    "BeamSearchParams": "pagedserve.sampling_params", "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs", "Logprob": "pagedserve.outputs",
    "KVCacheStats": "pagedserve.outputs", "BeamSearchOutput": "pagedserve.outputs",
    "BeamSearchSequence": "pagedserve.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


# Like vLLM, log start-up facts (KV cache size, capacity) to stderr unless the application
# configured logging itself; PAGEDSERVE_LOGGING_LEVEL sets the level (default INFO).
_logger = _logging.getLogger("pagedserve")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                             "%H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.setLevel(_envs.logging_level())
    _logger.propagate = False
