"""Model registry: an HF architecture name -> the class that implements it.

A new model family is one new file in ``model/`` plus its line here (and its GGUF metadata
mapping in ``loader/gguf.py``). Torch-free: classes are imported when first asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture (config.json "architectures") -> (module, class)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "Gemma3ForCausalLM": ("pagedserve.model.gemma3", "Gemma3ForCausalLM"),
}
ARCHITECTURES = tuple(MODELS)


def model_class(architecture: str) -> Any:
    """The model class for ``architecture``. Raises ValueError naming the supported ones."""
    if architecture not in MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    module, name = MODELS[architecture]
    return getattr(importlib.import_module(module), name)
