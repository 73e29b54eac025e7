"""HF directories: config.json + *.safetensors + tokenizer files, for LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (q/k norms) and
Gemma3ForCausalLM (text only; sliding-window and global layers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.config import SUPPORTED_ARCHITECTURES, ModelConfig, hf_attention_windows
from pagedserve.loader import ModelLoadError, ModelSource


def read_hf_config(path: Path) -> ModelConfig:
    """ModelConfig from ``path/config.json``, in transformers 4.x (rope_theta, rope_scaling) or
    5.x (rope_parameters) form. Raises FileNotFoundError or ModelLoadError naming the file."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (an HF model directory needs one)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from e
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{cfg_path}: unsupported architecture {archs}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and cfg.get("attention_bias")):
        raise ModelLoadError(f"{cfg_path}: attention_bias / mlp_bias models are not supported")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_theta = cfg.get("rope_local_base_freq")  # Gemma 3, transformers 4.x
    if "full_attention" in rope:  # per layer type (Gemma 3, transformers 5.x)
        local_theta = rope.get("sliding_attention", {}).get("rope_theta", local_theta)
        rope = dict(rope["full_attention"])
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"{cfg_path}: unsupported rope scaling {kind!r} "
                             "(supported: linear, llama3)")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    sliding, layer_types = hf_attention_windows(cfg)
    heads = cfg["num_attention_heads"]
    gemma = arch == "Gemma3ForCausalLM"
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise ModelLoadError(f"{cfg_path}: logit soft-capping is not supported")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            layer_types=layer_types,
            rope_local_theta=float(local_theta) if gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            rope_scaling=rope if kind != "default" else None,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: missing key {e}") from e


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of ``path/*.safetensors``. Raises FileNotFoundError when there are none and
    ModelLoadError naming a file that cannot be read (truncated, corrupt)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors weights ({e})") from e


def open_hf_dir(path: Path) -> ModelSource:
    from pagedserve.tokenizer import load_tokenizer

    config = read_hf_config(path)
    return ModelSource(path, config, lambda: iter_safetensors(path),
                       lambda: load_tokenizer(path))
