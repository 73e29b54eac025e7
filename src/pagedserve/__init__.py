"""pagedserve: an LLM inference and serving engine built around a paged KV cache."""

import logging as _logging
import os as _os

from pagedserve.engine import LLM, LLMEngine
from pagedserve.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    KVCacheStats,
    Logprob,
    RequestOutput,
)
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput",
    "CompletionOutput", "Logprob", "KVCacheStats", "BeamSearchParams", "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = "0.1.0"

# Like vLLM, log start-up facts (KV cache size, capacity) to stderr unless the application
# configured logging itself; PAGEDSERVE_LOGGING_LEVEL sets the level (default INFO).
_logger = _logging.getLogger("pagedserve")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                             "%H:%M:%S"))
    _logger.addHandler(_handler)
    _logger.setLevel(_os.environ.get("PAGEDSERVE_LOGGING_LEVEL", "INFO").upper())
    _logger.propagate = False
