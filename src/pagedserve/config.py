"""Engine configuration: frozen dataclasses built once at start-up and passed down explicitly.

``ModelConfig`` is the architecture read from config.json or GGUF metadata; ``CacheConfig`` sizes
the paged KV cache; ``SchedulerConfig`` bounds one scheduler step. No module reads configuration
from globals; the one environment switch, ``PAGEDSERVE_DEBUG_KV``, is read here and stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2).

    ``head_dim`` is explicit because some models set it apart from hidden_size / num_heads.
    ``rope_scaling`` is None or a dict with ``rope_type`` in {"linear", "llama3", "freq_factors"}
    and its factors. ``sliding_window``: attention is full, so max_model_len is capped at it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots each, stored as
    ``kv_cache_dtype`` (resolved: "float32", "bfloat16", "float16", "fp8" or "int8")."""

    block_size: int
    num_blocks: int
    kv_cache_dtype: str
    debug_checks: bool = field(
        default_factory=lambda: os.environ.get("PAGEDSERVE_DEBUG_KV", "0") not in ("", "0")
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds of one step: at most ``max_num_seqs`` running requests and
    ``max_num_batched_tokens`` tokens computed (prefill chunks plus decodes)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU. Raises ValueError for an unknown name."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise ValueError(f"device must be a string such as 'cpu', got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; choose auto, cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: float32 on CPU, bfloat16 on CUDA where supported (else float16).

    Raises ValueError for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]
