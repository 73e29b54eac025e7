"""KV-cache capacity planning: the arithmetic operators size deployments with, from a model's
real shape, and the one source of the engine's own KV sizing.

    block_bytes        = num_layers * num_kv_heads * (2 * block_size * head_dim * dtype_bytes
                                                      + param_bytes)
    kv_bytes_per_token = block_bytes / block_size
    kv_budget          = memory - weights - activation overhead        (per worker under TP)
    num_blocks         = kv_budget // block_bytes
    tokens_max         = num_blocks * block_size
    concurrency        = tokens_max / tokens per request

``param_bytes`` is 0 for a full-precision cache and ``4 * head_dim + 2 * block_size`` for a
quantized one (int8, fp8, int4: K's scale and offset per block and channel, V's scale per
token; kv/quant.py), whose running sequences also hold their open block's K unquantized
(``open_block_bytes`` each, counted with the activation overhead).
A model with sliding-window layers (Gemma 3) is paged in KV groups (kv/spec.py ``KVLayout``):
its window layers hold at most the blocks their window reaches, so a sequence of n tokens
costs ``blocks_per_seq(n) * bytes per block`` instead of ``n * kv_bytes_per_token``, and its
concurrency is counted in blocks; the plan shows the saving at the average length and at
max_model_len.
Memory is stated in both GB (10**9 bytes) and GiB (2**30 bytes) everywhere. GQA/MQA enter
through num_kv_heads; an explicit head_dim (not hidden / heads) is honoured. Sources: the
PagedAttention paper (Kwon et al., SOSP 2023, section 3) for the KV cost and block sizing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pagedserve.config import DTYPES, KV_CACHE_DTYPES, hf_attention_windows
from pagedserve.kv.spec import (  # noqa: F401  (the planner's public arithmetic)
    QUANTIZED_KV,
    kv_block_bytes,
    kv_bytes_per_token,
    kv_heads_per_worker,
    kv_layout,
    kv_param_bytes,
    num_blocks,
    open_block_bytes,
)

GB, GiB = 10**9, 2**30

PLAN_KV_CACHE_DTYPES = ("auto", *(a for a, (c, _) in DTYPES.items()
                                   if c in KV_CACHE_DTYPES and a not in ("float", "half")))


@dataclass(frozen=True)
class ModelShape:
    """The shapes that set a decoder's weight and KV bytes. ``gated_mlp``: three MLP matrices
    (Llama's gate/up/down) rather than two (OPT's fc1/fc2)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    layer_windows: tuple[int | None, ...] | None = None  # per layer; None: all full attention

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "vocab_size", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def num_params(self) -> int:
        """Weights: embedding, per layer q/k/v/o and the MLP, the LM head unless tied (norms
        and biases are negligible and left out)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = h * self.intermediate_size * (3 if self.gated_mlp else 2)
        embed = self.vocab_size * h
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_layers * (attn + mlp)


# Real shapes (the models' published config.json files).
PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-2-7b", 32, 4096, 32, 32, 128, 32000, 11008, 4096),
    ModelShape("llama-2-13b", 40, 5120, 40, 40, 128, 32000, 13824, 4096),
    ModelShape("llama-2-70b", 80, 8192, 64, 8, 128, 32000, 28672, 4096),
    ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 128256, 14336, 8192),
    ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 128256, 28672, 8192),
    ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 32000, 14336, 32768),
    ModelShape("qwen2-7b", 28, 3584, 28, 4, 128, 152064, 18944, 32768),
    ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 49152, 1536, 8192, tie_word_embeddings=True),
    ModelShape("gemma3-270m", 18, 640, 4, 1, 256, 262144, 2048, 32768, tie_word_embeddings=True,
               layer_windows=tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))),
    ModelShape("opt-13b", 40, 5120, 40, 40, 128, 50272, 20480, 2048, tie_word_embeddings=True,
               gated_mlp=False),
)}


def shape_from_hf_config(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """ModelShape from a config.json dict (Llama-style names, or OPT's ``ffn_dim``).
    Raises ValueError naming a missing field."""
    def need(*keys: str) -> Any:
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        raise ValueError(f"{name}: config.json has no {' or '.join(keys)}")

    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: config.json must hold a JSON object")
    heads = need("num_attention_heads", "n_head")
    hidden = need("hidden_size", "n_embd", "d_model")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0
                and hidden % heads == 0):
            raise ValueError(f"{name}: hidden_size {hidden!r} is not a multiple of "
                             f"num_attention_heads {heads!r} and there is no head_dim")
        head_dim = hidden // heads
    opt = "ffn_dim" in cfg and "intermediate_size" not in cfg
    layers = need("num_hidden_layers", "n_layer")
    sliding, layer_types = hf_attention_windows(cfg)
    if layer_types is not None and len(layer_types) != layers:
        raise ValueError(f"{name}: layer_types has {len(layer_types)} entries for {layers} "
                         "layers")
    windows = tuple(None if layer_types and layer_types[i] != "sliding_attention" else sliding
                    for i in range(layers)) if sliding else None
    return ModelShape(
        name=name, num_layers=layers, hidden_size=hidden,
        num_heads=heads, num_kv_heads=(heads if cfg.get("num_key_value_heads") is None
                                        else cfg["num_key_value_heads"]),
        head_dim=head_dim, vocab_size=need("vocab_size"),
        intermediate_size=need("intermediate_size", "ffn_dim"),
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", opt)), gated_mlp=not opt,
        layer_windows=windows)


def shape_from_model_config(cfg: Any, name: str) -> ModelShape:
    """ModelShape of the engine's ModelConfig (what the engine really loads)."""
    return ModelShape(name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size,
                      cfg.intermediate_size, cfg.max_position_embeddings,
                      cfg.tie_word_embeddings,
                      layer_windows=tuple(cfg.layer_windows()) if cfg.sliding_window else None)


def load_shape(model: str) -> ModelShape:
    """A preset name, an HF directory (config.json) or a GGUF file. Raises ValueError or
    FileNotFoundError with a clear message."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        return shape_from_hf_config(cfg, path.name)
    if path.is_file() and path.suffix == ".gguf":
        from pagedserve.loader.gguf import gguf_config

        return shape_from_model_config(gguf_config(path), path.stem)
    raise ValueError(f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}), an HF "
                     "directory or a .gguf file")


# ---- the arithmetic ---------------------------------------------------------------------------


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name. Raises ValueError for an unknown name."""
    try:
        return DTYPES[dtype][1]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}") from None


@dataclass
class Plan:
    """One configuration's figures (bytes per worker unless named ``_total``)."""

    model: str
    memory_bytes: int
    weights_dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    avg_tokens: int
    max_model_len: int
    num_params: int
    weight_bytes_total: int
    weight_bytes: int
    overhead_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_budget_bytes: int
    num_blocks: int
    tokens_max: int
    concurrency_avg: float
    concurrency_max_model_len: float
    # KV groups (sliding-window models): what they are, and one sequence's KV bytes at the
    # average length and at max_model_len, paged by window and with every layer kept whole
    kv_groups: str = ""
    kv_bytes_avg: int = 0
    kv_bytes_avg_full: int = 0
    kv_bytes_max: int = 0
    kv_bytes_max_full: int = 0

    @property
    def kv_bytes_per_token_avg(self) -> float:
        """KV bytes per token of a sequence of the average length (below kv_bytes_per_token
        when window layers drop what their window has passed)."""
        return self.kv_bytes_avg / self.avg_tokens


def make_plan(shape: ModelShape, memory_bytes: int, *, weights_dtype: str = "bf16",
              kv_cache_dtype: str = "auto", overhead_bytes: int = 0, avg_tokens: int = 2000,
              max_model_len: int | None = None, block_size: int | None = None,
              tensor_parallel_size: int = 1, weight_bytes: int | None = None) -> Plan:
    """The figures for ``shape`` on one accelerator of ``memory_bytes`` per worker.

    ``weight_bytes`` overrides the estimate from the parameter count; ``block_size`` defaults
    as the engine's does (16, or 32 for a quantized KV cache). Raises ValueError for a bad
    value or when the weights and overhead leave no room for a single block."""
    if block_size is None:
        quantized = DTYPES.get(kv_cache_dtype, ("",))[0] in QUANTIZED_KV
        block_size = 32 if quantized else 16
    for name, value in (("memory", memory_bytes), ("avg_tokens", avg_tokens),
                        ("block_size", block_size), ("tensor_parallel_size",
                                                     tensor_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    kv_heads, tp = shape.num_kv_heads, tensor_parallel_size
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{shape.name}: tensor_parallel_size {tp} neither divides the "
                         f"{kv_heads} KV heads nor is a multiple of them")
    if overhead_bytes < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead_bytes}")
    if kv_cache_dtype not in PLAN_KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: "
                         f"{', '.join(PLAN_KV_CACHE_DTYPES)}")
    w_bytes = dtype_bytes(weights_dtype)
    kv_dtype = weights_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    max_model_len = max_model_len or shape.max_position_embeddings
    total = weight_bytes if weight_bytes is not None else int(shape.num_params * w_bytes)
    per_worker = total // tensor_parallel_size
    budget = memory_bytes - per_worker - overhead_bytes
    heads = kv_heads_per_worker(shape.num_kv_heads, tensor_parallel_size)
    params = kv_param_bytes(kv_dtype, shape.head_dim, block_size)
    per_token = kv_bytes_per_token(shape.num_layers, heads, shape.head_dim,
                                   dtype_bytes(kv_dtype), params, block_size)
    if budget < per_token * block_size:
        raise ValueError(
            f"{shape.name}: {_both(memory_bytes)} per worker holds no KV cache: the weights "
            f"take {_both(per_worker)} and the overhead {_both(overhead_bytes)}")
    full_avg = -(-avg_tokens // block_size) * block_size * per_token
    full_max = -(-max_model_len // block_size) * block_size * per_token
    if not shape.layer_windows or set(shape.layer_windows) == {None}:
        block_bytes = kv_block_bytes(shape.num_layers, heads, shape.head_dim,
                                     dtype_bytes(kv_dtype), block_size, params)
        blocks = num_blocks(budget, block_bytes)
        tokens = blocks * block_size
        return Plan(shape.name, memory_bytes, weights_dtype, kv_dtype, tensor_parallel_size,
                    block_size, avg_tokens, max_model_len, shape.num_params, total, per_worker,
                    overhead_bytes, per_token, block_bytes, budget, blocks, tokens,
                    tokens / avg_tokens, tokens / max_model_len, "", per_token * avg_tokens,
                    full_avg, per_token * max_model_len, full_max)
    # a block holds ``slots`` layers of one KV group; sequences are counted in blocks
    layout = kv_layout(list(shape.layer_windows))
    block_bytes = kv_block_bytes(layout.slots, heads, shape.head_dim, dtype_bytes(kv_dtype),
                                 block_size, params)
    blocks = num_blocks(budget, block_bytes)
    held_avg = layout.blocks_per_seq(avg_tokens, block_size, 1)
    held_max = layout.blocks_per_seq(max_model_len, block_size, 1)
    return Plan(shape.name, memory_bytes, weights_dtype, kv_dtype, tensor_parallel_size,
                block_size, avg_tokens, max_model_len, shape.num_params, total, per_worker,
                overhead_bytes, per_token, block_bytes, budget, blocks,
                layout.max_tokens(blocks, block_size, 1), blocks / held_avg, blocks / held_max,
                layout.describe(), held_avg * block_bytes, full_avg,
                held_max * block_bytes, full_max)


def levers(shape: ModelShape, memory_bytes: int, shared_prefix_tokens: int = 0,
           num_sharing: int = 1, max_model_len_cap: int | None = None,
           **kwargs: Any) -> list[tuple[str, Plan, float]]:
    """(lever, plan, concurrency at the average length) for the baseline and each lever:
    full multi-head KV (what GQA saves), fp8 and int8 KV, prefix sharing, a max_model_len cap
    (its concurrency is the worst case, every request at max_model_len)."""
    if shared_prefix_tokens < 0 or num_sharing < 1:
        raise ValueError(f"shared_prefix_tokens must be >= 0 and num_sharing >= 1, got "
                         f"{shared_prefix_tokens} and {num_sharing}")
    if shared_prefix_tokens > kwargs.get("avg_tokens", 2000):
        raise ValueError(f"shared_prefix_tokens ({shared_prefix_tokens}) exceeds avg_tokens "
                         f"({kwargs.get('avg_tokens', 2000)}): a request includes its prefix")
    if shared_prefix_tokens and num_sharing < 2:
        raise ValueError("shared_prefix_tokens needs num_sharing of at least 2")
    if max_model_len_cap is not None and max_model_len_cap < 1:
        raise ValueError(f"max_model_len_cap must be positive, got {max_model_len_cap}")
    base = make_plan(shape, memory_bytes, **kwargs)
    rows = [("baseline", base, base.concurrency_avg)]
    tp = kwargs.get("tensor_parallel_size", 1)
    if shape.num_kv_heads != shape.num_heads and (shape.num_heads % tp == 0
                                                  or tp % shape.num_heads == 0):
        # the same weights: only the KV heads change, so the row isolates the KV lever (left
        # out when that head count could not be split over tensor_parallel_size)
        mha = make_plan(replace(shape, num_kv_heads=shape.num_heads), memory_bytes,
                        **{**kwargs, "weight_bytes": base.weight_bytes_total})
        rows.append((f"without GQA ({shape.num_heads} KV heads, not {shape.num_kv_heads})",
                     mha, mha.concurrency_avg))
    if base.kv_groups:  # what window paging gives: every layer kept whole instead
        whole = make_plan(replace(shape, layer_windows=None), memory_bytes,
                          **{**kwargs, "weight_bytes": base.weight_bytes_total})
        rows.append(("without window paging (every layer's K/V kept whole)", whole,
                     whole.concurrency_avg))
    for kv in ("fp8", "int8", "int4"):
        if kwargs.get("kv_cache_dtype", "auto") != kv:
            p = make_plan(shape, memory_bytes, **{**kwargs, "kv_cache_dtype": kv})
            rows.append((f"{kv} KV cache", p, p.concurrency_avg))
    if shared_prefix_tokens and num_sharing > 1:
        bs = base.block_size
        shared = (min(shared_prefix_tokens, base.avg_tokens) // bs) * bs  # full blocks only
        if base.kv_groups:  # in blocks; only full-attention groups still share the prefix
            layout = kv_layout(list(shape.layer_windows))
            full_groups = sum(g.window is None for g in layout.groups)
            per_seq = layout.blocks_per_seq(base.avg_tokens, bs, 1)
            per_group = num_sharing * per_seq - (num_sharing - 1) * full_groups * (shared // bs)
            conc = base.num_blocks / per_group * num_sharing
        else:
            per_group = num_sharing * base.avg_tokens - (num_sharing - 1) * shared
            conc = base.tokens_max / per_group * num_sharing
        rows.append((f"prefix sharing ({shared} tokens x {num_sharing} requests)", base, conc))
    worst = ("every request at max_model_len", base, base.concurrency_max_model_len)
    rows.append(worst)
    if max_model_len_cap:
        capped = make_plan(shape, memory_bytes, **{**kwargs, "max_model_len": max_model_len_cap})
        rows.append((f"max_model_len cap {max_model_len_cap} (worst case)", capped,
                     capped.concurrency_max_model_len))
    return rows


def _both(n: float) -> str:
    return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"


def render(plan: Plan, rows: list[tuple[str, Plan, float]]) -> str:
    """The plan as text: every size in GB and GiB."""
    tp = f" per worker (tensor_parallel_size={plan.tensor_parallel_size})" \
        if plan.tensor_parallel_size > 1 else ""
    facts = [
        (f"accelerator memory{tp}", _both(plan.memory_bytes)),
        (f"weights{tp}", _both(plan.weight_bytes)),
        ("activation overhead", _both(plan.overhead_bytes)),
        (f"KV budget{tp}", _both(plan.kv_budget_bytes)),
        (f"KV bytes per token{tp}", f"{plan.kv_bytes_per_token:,} B"),
        ("KV bytes per block", f"{plan.kv_bytes_per_block:,} B"),
        (f"KV bytes of {plan.avg_tokens:,} tokens", _both(plan.kv_bytes_avg)),
        ("blocks", f"{plan.num_blocks:,}"),
        ("tokens_max", f"{plan.tokens_max:,}"),
        (f"concurrency at {plan.avg_tokens:,} tokens", f"{plan.concurrency_avg:,.1f}"),
        (f"concurrency at max_model_len={plan.max_model_len:,}",
         f"{plan.concurrency_max_model_len:,.1f}"),
    ]
    if plan.kv_groups:
        facts[4:4] = [("KV groups", plan.kv_groups)]
        for n, paged, full in ((plan.avg_tokens, plan.kv_bytes_avg, plan.kv_bytes_avg_full),
                               (plan.max_model_len, plan.kv_bytes_max, plan.kv_bytes_max_full)):
            facts.append((f"window paging at {n:,} tokens",
                          f"{paged / 2**20:,.1f} MiB per sequence, {full / paged:.2f}x less "
                          f"than {full / 2**20:,.1f} MiB with every layer whole"))
    if plan.tokens_max < plan.max_model_len:
        facts.append(("note", f"one request of max_model_len={plan.max_model_len:,} tokens "
                              f"does not fit tokens_max={plan.tokens_max:,}"))
    width = max(len(k) for k, _ in facts) + 2
    lines = [f"model {plan.model}: {plan.num_params / 1e9:.2f}B parameters, weights "
             f"{plan.weights_dtype}, KV cache {plan.kv_cache_dtype}, blocks of {plan.block_size}"]
    lines += [f"{k + ':':<{width}}{v}" for k, v in facts]
    lines += [
        "",
        "| lever | KV bytes/token | tokens_max | concurrency | vs baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    base = rows[0][2]
    for name, p, conc in rows:
        lines.append(f"| {name} | {p.kv_bytes_per_token_avg:,.0f} | {p.tokens_max:,} | {conc:,.1f} | "
                     f"{conc / base:.2f}x |")
    return "\n".join(lines)


def to_json(plan: Plan, rows: list[tuple[str, Plan, float]]) -> str:
    return json.dumps({"plan": asdict(plan), "levers": [
        {"lever": name, "kv_bytes_per_token": p.kv_bytes_per_token,
         "kv_bytes_per_token_avg": p.kv_bytes_per_token_avg, "tokens_max": p.tokens_max,
         "concurrency": conc} for name, p, conc in rows]}, indent=1)


def plot(shape: ModelShape, memory_bytes: int, path: str, **kwargs: Any) -> None:
    """Concurrency against average context length, one line per lever (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [2**k for k in range(7, 16)]
    series: dict[str, dict[int, float]] = {}
    shared = kwargs.get("shared_prefix_tokens", 0)
    for n in lengths:
        kw = {**kwargs, "avg_tokens": n}
        if n <= shared:  # requests no longer than the shared prefix: no sharing point
            kw.update(shared_prefix_tokens=0, num_sharing=1)
        for name, _, conc in levers(shape, memory_bytes, **kw):
            if not name.startswith(("every request", "max_model_len cap", "int8")):
                label = "8-bit KV cache (fp8 or int8)" if name.startswith("fp8") \
                    else name.split(" (")[0]
                series.setdefault(label, {})[n] = conc
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        ax.plot(lengths, [values.get(n, float("nan")) for n in lengths], marker="o",
                label=name)
    ax.set(xscale="log", yscale="log", xlabel="average tokens per request",
           ylabel="concurrent requests", title=f"{shape.name}: KV-bound concurrency, "
           f"{memory_bytes / GB:.0f} GB")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
