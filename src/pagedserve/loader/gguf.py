"""GGUF files: metadata -> ModelConfig, tensors -> dequantized weights under transformers' names.

Architectures: ``llama`` (Llama, SmolLM2, and Mistral, which llama.cpp converts to it),
``qwen2`` (q/k/v bias), ``qwen3`` (q/k norms), ``gemma3`` (hybrid sliding-window attention;
the facts GGUF leaves out, its layer pattern and local rope base, are Gemma 3's fixed ones). Tensors are dequantized to float32 with the
``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and every other type it
knows). llama.cpp's converter permutes the rows of attn_q/attn_k of llama for its
interleaved rotary layout; they are permuted back to transformers' rotate-half layout here.
The tokenizer comes from the GGUF vocabulary through transformers and is cached as
tokenizer.json (building it takes seconds).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.config import ModelConfig
from pagedserve.loader import ModelLoadError, ModelSource

logger = logging.getLogger(__name__)

# GGUF architecture -> (transformers architecture, q/k rows permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms apart; llama.cpp stores Gemma's norm weights as 1 + w
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
GEMMA3_GLOBAL_EVERY = 6  # every 6th layer attends globally (llama.cpp and transformers fix it)
GEMMA3_LOCAL_ROPE_THETA = 10000.0
_BLK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/... on bad or short files
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf_config(reader, path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata. Raises ModelLoadError for another architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {scaling_type!r}")
    if "rope_freqs.weight" in tensor_names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope_scaling = {"rope_type": "freq_factors",
                        "factors": [float(x) for x in np.asarray(t.data, dtype=np.float32)]}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=ARCHITECTURES[arch][0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=rope_scaling,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        **(_gemma3_fields(reader, get) if arch == "gemma3" else {}),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _gemma3_fields(reader, get) -> dict[str, Any]:
    layers = int(get("block_count"))
    return dict(
        sliding_window=int(get("attention.sliding_window")),
        layer_types=tuple("full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0
                          else "sliding_attention" for i in range(layers)),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=float(get("attention.key_length")),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(arch: str, tensors, config: ModelConfig, path: Path
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors under transformers names, from a reader's ``tensors`` of
    a GGUF of architecture ``arch``. Raises ModelLoadError naming the tensor that cannot be
    dequantized."""
    from gguf.quants import dequantize

    permuted = ARCHITECTURES[arch][1]
    layer_names = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    for t in tensors:
        if t.name == "rope_freqs.weight":
            continue
        m = _BLK_RE.fullmatch(t.name)
        kind = suffix = None
        if m:
            i, kind, suffix = m.groups()
            if kind not in layer_names:
                raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
            name = f"model.layers.{i}.{layer_names[kind]}.{suffix}"
        elif t.name in _NAMES:
            name = _NAMES[t.name]
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
        try:
            w = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot dequantize {t.name} "
                                 f"({t.tensor_type.name}): {e}") from e
        if permuted and kind == "attn_q" and suffix == "weight":
            w = _unpermute(w, config.num_attention_heads)
        elif permuted and kind == "attn_k" and suffix == "weight":
            w = _unpermute(w, config.num_key_value_heads)
        w = np.asarray(w, dtype=np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1  # transformers' convention: the model adds the 1 back
        if not (w.flags.writeable and w.flags.c_contiguous):  # memory-mapped F32 tensors
            w = w.copy()
        yield name, torch.from_numpy(w)


def load_gguf_tokenizer(path: Path, cache_dir: Path) -> Any:
    """The GGUF's embedded tokenizer via transformers, cached as tokenizer.json under
    ``cache_dir/tokenizers/<key>`` where key depends on the file's path, size and mtime."""
    from pagedserve.tokenizer import load_tokenizer

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir / "tokenizers" / key[:16]
    if (cached / "tokenizer_config.json").is_file():
        try:
            return load_tokenizer(cached)
        except ValueError as e:
            logger.warning("the cached tokenizer in %s is unreadable (%s); rebuilding it", cached, e)
    logger.info("building the tokenizer from %s (once, ~15 s; cached in %s)", path, cached)
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tokenizer


@functools.lru_cache(maxsize=4)
def _parsed(path: str, size: int, mtime_ns: int) -> tuple[ModelConfig, str, tuple]:
    """(config, architecture, tensors) of one version of a GGUF file, kept for the process:
    the reader parses every metadata field, and a 262k-token vocabulary takes it ~10 s, which
    a second engine on the same file (a test, a benchmark's peer run) need not pay again. The
    tensors' data stay memory-mapped, not read; the parsed vocabulary is dropped."""
    reader = _reader(Path(path))
    config = read_gguf_config(reader, Path(path))
    return config, _field(reader, "general.architecture"), tuple(reader.tensors)


def gguf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a GGUF file (cached per path, size and mtime). Raises
    ModelLoadError for an unreadable file or an unsupported architecture."""
    return _parse(path)[0]


def _parse(path: Path) -> tuple[ModelConfig, str, tuple]:
    st = path.stat()
    return _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns)


def open_gguf(path: Path) -> ModelSource:
    from pagedserve.loader.fetched import cache_dir

    config, arch, tensors = _parse(path)
    return ModelSource(path, config, lambda: iter_gguf_weights(arch, tensors, config, path),
                       lambda: load_gguf_tokenizer(path, cache_dir()))
