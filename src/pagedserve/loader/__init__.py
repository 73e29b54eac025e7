"""Model loading: a GGUF file, an HF directory, or a model fetched by name (loader/fetched.py).

Every loader yields a ModelConfig and (name, tensor) pairs under transformers' tensor names, so
the model has one weight-loading path. Errors name the file and what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.config import ModelConfig


class ModelLoadError(ValueError):
    """A model file or directory exists but cannot be used (unsupported, malformed, truncated)."""


@dataclass
class ModelSource:
    """Where a model comes from: its config, a weight iterator and a tokenizer loader."""

    path: Path
    config: ModelConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Callable[[], Any]


def open_model(model: str | Path | None) -> ModelSource:
    """Resolve ``model`` to a ModelSource: None (the default model), a name of
    ``loader.fetched.MODELS`` ("gemma3-270m": fetched and cached on first use), a GGUF file or
    an HF directory.

    Raises:
        FileNotFoundError: the path does not exist.
        ModelLoadError: the file or directory is not a supported model.
    """
    from pagedserve.loader import gguf, hf
    from pagedserve.loader.fetched import MODELS, default_model_path, fetched_model_path

    if model is None:
        path = default_model_path()
    elif isinstance(model, str) and model in MODELS and not Path(model).exists():
        path = fetched_model_path(model)
    else:
        path = Path(model).expanduser()
    if not path.exists():
        hint = ""
        if isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/")):
            hint = (f"; to serve the hub model {model!r}, download it first "
                    f"(huggingface-cli download {model} --local-dir DIR) and pass DIR")
        elif isinstance(model, str) and "/" not in model and "." not in Path(model).name:
            hint = f"; models fetched by name: {', '.join(MODELS)}"
        raise FileNotFoundError(f"model path {str(path)!r} does not exist{hint}")
    if path.is_dir():
        return hf.open_hf_dir(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return gguf.open_gguf(path)
    raise ModelLoadError(
        f"{path}: not a GGUF file (magic {magic!r}) and not a directory with config.json"
    )
