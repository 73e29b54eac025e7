"""Fused CPU kernels (C++ in this folder, one file per op family: norm.cpp, attention.cpp,
sampling.cpp, linear.cpp, each op a raw-pointer implementation plus a thin torch binding;
vec.h holds the one SIMD type, F32x16 (AVX-512, else the target's own vectors), common.h the
shared helpers, ops.h the declarations, ops.cpp the registration), compiled on first use with
torch.utils.cpp_extension.

A float32 decode step on the CPU is dominated by the fixed cost of dispatching ~40 small torch
ops per layer, not by arithmetic. The kernels replace those chains: ``add_rms_norm`` (residual
add + RMSNorm + cast for the next matmul), ``silu_and_mul``, ``rotary_write_kv`` (rotary
embedding + the paged K/V write) and ``paged_decode_attention`` (decode attention reading K/V
through the block tables, PagedAttention sec. 4.1, with no gather and no mask). The matmuls
themselves go to ``packed_linear``: float32 weights prepacked once into 48-column panels
(model/layers.py PackedLinear). At decode's few rows this beats MKL's sgemm, which packs the
weight into its own layout inside every call (docs/performance.md); for the MLP's gate|up weight
(``gated=True``) SwiGLU is its epilogue, in place of ``silu_and_mul``. Two more serve the LM
head and the sampler: ``int8_linear`` (the int4 mode's Q8_0 LM head) and ``argmax``;
``int4_linear`` serves the int4 mode's projections at decode's few rows.
Invariants:

- The torch code in model/ and attention/ stays the reference and the fallback: the kernels
  run only for CPU tensors of a float32 model (the fused layers also need an unquantized KV
  cache), and a test compares each kernel and whole-model greedy output with the torch path.
- ``load()`` never raises: without a compiler, or with ``PAGEDSERVE_CPU_KERNELS=0``, it logs
  why once and returns None, and the model runs the torch path.
- A build lock left by a killed build is waited on, then removed once older than
  STALE_LOCK_SECONDS (torch would wait on it forever).

The build (about 20 s on 2 cores, once per machine) is cached by torch in
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); it needs g++ and ninja.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from pagedserve import envs

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
# One file per op family and the registration (ops.cpp); the headers they include.
SOURCES = [HERE / name for name in ("norm.cpp", "attention.cpp", "sampling.cpp", "linear.cpp",
                                    "ops.cpp")]
HEADERS = [HERE / "ops.h", HERE / "common.h", HERE / "vec.h"]
ENV = "PAGEDSERVE_CPU_KERNELS"
# torch's build lock is a bare file: a build killed by SIGTERM/SIGKILL leaves it behind and
# every later build waits on it forever. One older than this is taken as stale and removed.
STALE_LOCK_SECONDS = 300


BASE_FLAGS = ("-O3", "-march=native", "-fopenmp")


def _build_name(extra_flags: tuple[str, ...] = ()) -> str:
    """The extension's name: a hash of everything the binary depends on (this CPU's
    instruction set, since the build uses ``-march=native``; the kernel source and its
    folder; the compiler and its flags; torch's version and install, whose headers the build includes). Two
    checkouts, versions or virtual environments on one machine, or two machines sharing a
    cache directory, then never load or rebuild each other's binary (torch rebuilds a cached
    extension whose include paths changed)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    h = hashlib.sha256()
    sources = "".join(p.read_text() for p in (*SOURCES, *HEADERS))
    # the sources' folder too: torch rebuilds an extension whose source paths changed, so two
    # checkouts of the same sources under one name would rebuild it for each other
    for part in (cpu, sources, str(HERE), os.environ.get("CXX", "c++"), torch.__version__,
                 os.path.dirname(torch.__file__), *BASE_FLAGS, *extra_flags):
        h.update(part.encode() + b"\0")
    return f"pagedserve_cpu_ops_{h.hexdigest()[:16]}"


def _wait_for_build_lock(lock: Path) -> None:
    """Wait while another process builds (it holds ``lock``); remove the lock once it is older
    than STALE_LOCK_SECONDS, the mark of a killed build (torch itself would wait forever)."""
    waited = False
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            logger.warning("removing the stale build lock %s (left by an interrupted build)",
                           lock)
            lock.unlink(missing_ok=True)
            return
        if not waited:
            logger.info("waiting for another build of the CPU kernels (%s; removed as stale "
                        "after %d s)", lock, STALE_LOCK_SECONDS)
            waited = True
        time.sleep(1)


def build(name: str, namespace: str = "pagedserve", extra_flags: tuple[str, ...] = ()):
    """Compile (or load from torch's cache) the kernel sources as extension ``name`` with its ops
    registered under ``torch.ops.<namespace>``, which it returns. ``extra_flags`` go to g++
    after ``-O3 -march=native`` (the tests build a portable variant with ``-mno-avx512f``).
    Raises RuntimeError when there is no C++ compiler or no ninja, and what
    torch.utils.cpp_extension raises for a failed build."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found; set CXX)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    _wait_for_build_lock(Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock")
    flags = [*BASE_FLAGS, f"-DOPS_NAMESPACE={namespace}", *extra_flags]
    cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)


@functools.cache
def _log_once(level: int, message: str, *args) -> None:
    logger.log(level, message, *args)


def _switch() -> str:
    """``PAGEDSERVE_CPU_KERNELS`` read now: "off" (0), "unpacked" (the kernels with torch's
    matmuls, for comparisons) or "on" (1, the default; another value is warned about)."""
    value = envs.cpu_kernels().strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value == "unpacked":
        return value
    if value not in ("1", "true", "yes", "on"):
        _log_once(logging.WARNING, "ignoring %s=%r (use 0 or off, 1 or on, unpacked); the CPU "
                  "kernels stay on", ENV, value)
    return "on"


def load():
    """``torch.ops.pagedserve`` with the CPU kernels registered, or None when they are disabled
    (``PAGEDSERVE_CPU_KERNELS=0``, read at each call) or cannot be built (the reason is logged
    once)."""
    if _switch() == "off":
        _log_once(logging.INFO, "CPU kernels disabled by %s; running the torch path", ENV)
        return None
    return _compiled()


def pack_weights() -> bool:
    """Whether float32 linear layers keep their weights packed for ``packed_linear`` (False
    under ``PAGEDSERVE_CPU_KERNELS=unpacked``: torch's matmuls beside the other kernels)."""
    return _switch() != "unpacked"


@functools.cache
def _compiled():
    start = time.perf_counter()
    try:
        ops = build(_build_name())
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        reason = (str(e).splitlines() or [""])[0]
        logger.warning("CPU kernels unavailable (%s); running the torch path",
                       reason if len(reason) <= 160 else reason[:160] + " ...")
        return None
    if time.perf_counter() - start > 2:
        logger.info("built the CPU kernels in %.0f s (cached for later runs)",
                    time.perf_counter() - start)
    return ops
