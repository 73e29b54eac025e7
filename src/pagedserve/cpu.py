"""What the CPU under the engine really offers, and how the engine behaves on shared cores.

- ``usable_cpus()``: the CPUs this process may run on (its affinity mask) capped by its cgroup
  CPU quota (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), not the host's core count: a container
  limited to 2 CPUs on a 64-core host gets 2 threads, not 64 that the quota throttles.
- ``limit_spinning()``: OpenMP threads (torch's intra-op pool, which the fused kernels share)
  busy-wait for the next parallel region; libgomp's default is 300,000 spins. On cores that
  other processes also want, those spins burn the engine's own time slices while the thread
  that holds up the barrier waits to be scheduled, and decode collapsed to a few percent of its
  quiet rate (docs/performance.md, "Shared cores"). A spin count of ``SPIN_COUNT`` keeps the
  quiet speed (regions follow each other within microseconds) and yields the core soon after.
  libgomp reads the variable once, when torch loads it, so this runs when ``pagedserve`` is
  imported; an explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.
- ``ContentionGuard``: spinning is what keeps a quiet machine fast (a lower spin count or a
  passive wait cost 13-25% of quiet decode), and what wastes a shared one. The guard watches how
  long the engine's thread waits for a CPU and, while that share is high, holds the
  ``SpinThrottle`` (libgomp spins 100 times, then sleeps) and runs small steps on one thread
  (no barrier at all), going back to the full count when the cores are free.
- ``cpu_flags()`` / ``matrix_unit()``: the instruction-set extensions that choose the matmul
  path for large chunks (model/linear.py): AMX tiles, AVX-512 BF16, or neither.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import threading
import time
import weakref
from pathlib import Path

logger = logging.getLogger("pagedserve")

SPIN_COUNT = "10000"  # quiet decode unchanged (benchmarks/shared_cores.py); sharing needs the guard


def limit_spinning() -> bool:
    """Set ``GOMP_SPINCOUNT`` for this process and its children unless the user chose a wait
    policy. Returns False when torch (hence libgomp) was already loaded, so it comes too late
    for this process."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    return "torch" not in sys.modules


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup"),
                  proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs allowed by this process's cgroup quota (e.g. 1.5), or None when unlimited or
    unknown. Reads cgroup v2 (``cpu.max``: "quota period" or "max period") and v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, quota -1 = none), at the process's own
    cgroup path and its ancestors (a parent's limit binds its children too)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        if line.count(":") < 2:
            continue
        hier, controllers, path = line.split(":", 2)
        v2 = hier == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        base = root / "unified" if v2 and (root / "unified").is_dir() else root
        if not v2:
            base = root / "cpu" if (root / "cpu").is_dir() else root / controllers
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = base.joinpath(*parts[:depth])
            try:
                if v2:
                    quota, period = (d / "cpu.max").read_text().split()[:2]
                    if quota != "max":
                        limits.append(int(quota) / int(period))
                else:
                    quota = int((d / "cpu.cfs_quota_us").read_text())
                    if quota > 0:
                        limits.append(quota / int((d / "cpu.cfs_period_us").read_text()))
            except (OSError, ValueError, ZeroDivisionError):
                continue
    return min(limits) if limits else None


def _affinity_cpus() -> int:
    """The CPUs of this process's affinity mask (the host's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def usable_cpus() -> int:
    """CPUs this process can really use: its affinity mask, capped by the cgroup CPU quota
    (rounded up: a 1.5-CPU quota still runs two threads in parallel part of the time).
    At least 1."""
    cpus = _affinity_cpus()
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def threads_per_rank(world_size: int) -> int:
    """The usable CPUs split between ``world_size`` ranks on this host, at least 1."""
    return max(1, usable_cpus() // world_size)


def omp_num_threads_set() -> bool:
    """Whether ``OMP_NUM_THREADS`` holds a positive count (libgomp ignores another value, with
    a warning, and would run every core)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return value.isdigit() and int(value) > 0


def set_threads(world_size: int = 1) -> None:
    """Cap torch's intra-op pool (which the fused kernels use) at this rank's share of the
    usable CPUs, unless a valid ``OMP_NUM_THREADS`` says otherwise. Never raises the count, so a
    smaller ``torch.set_num_threads`` of the application stays."""
    if not omp_num_threads_set():
        import torch

        torch.set_num_threads(min(torch.get_num_threads(), threads_per_rank(world_size)))


def release_openmp_threads(maps: Path = Path("/proc/self/maps")) -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp's ``omp_pause_resource_all``,
    OpenMP 5.0) before another thread takes over the model, as the server's engine thread does
    after the main thread loaded it. libgomp counts the threads of every pool, idle ones
    included, and when they outnumber the CPUs it spins 100 times instead of its configured
    count before sleeping: each parallel region of the new thread then pays a futex wake-up
    (measured: single-sequence decode 2x slower on a separate thread than on the loading one).
    Returns whether a libgomp was found and released its pool; a torch built with another
    OpenMP, or none loaded, leaves it at False."""
    import ctypes

    gomp = _libgomp(maps)
    pause = None if gomp is None else getattr(gomp, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    return pause(2) == 0  # omp_pause_hard


def _libgomp(maps: Path = Path("/proc/self/maps")):
    """The loaded libgomp as a ctypes library, or None (none loaded, or another OpenMP)."""
    import ctypes

    try:
        path = next((line.split()[-1] for line in maps.read_text().splitlines()
                     if "libgomp" in line.rsplit("/", 1)[-1]), None)
        return None if path is None else ctypes.CDLL(path)
    except OSError:
        return None


class SpinThrottle:
    """Makes libgomp spin 100 times instead of its configured count before a waiting thread
    sleeps, for as long as it is held, by holding an idle pool of OpenMP threads on a thread of
    its own.

    libgomp reads its spin count once, but at every wait it compares the threads of all its
    pools, idle ones included, with the CPUs it may use, and when they outnumber the CPUs it
    uses its throttled count (100 spins) instead. On a quiet machine that is a cost ("One
    OpenMP pool" in docs/performance.md); on oversubscribed cores it is what the engine wants:
    its threads sleep at a barrier instead of burning the time slices the other threads need,
    close to ``OMP_WAIT_POLICY=PASSIVE``, and spin again once released. ``hold(threads)`` makes
    the pool just large enough to outnumber the CPUs beside ``threads`` engine threads (the
    holding thread and one worker where the engine uses every CPU of its affinity mask); it
    returns False, holding nothing, where it cannot (no libgomp, or a CPU quota leaves many
    CPUs of the mask unused: the pool would need that many idle threads).
    """

    MAX_EXTRA = 4  # idle threads the pool may hold

    def __init__(self):
        self._thread = None
        self._stop = threading.Event()

    @property
    def held(self) -> bool:
        return self._thread is not None

    def hold(self, threads: int) -> bool:
        if self._thread is not None:
            return True
        # libgomp counts the CPUs of the affinity mask; the holding thread is the pool's master
        size = _affinity_cpus() - threads + 2
        gomp = _libgomp()
        if gomp is None or size - 1 > self.MAX_EXTRA or not hasattr(gomp, "GOMP_parallel"):
            return False
        import ctypes

        try:
            # every pool thread calls free(NULL): a C function of one pointer that does nothing
            noop = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)
        except (OSError, AttributeError):
            return False
        parallel = gomp.GOMP_parallel
        parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        parallel.restype = None
        started = threading.Event()
        self._stop.clear()

        def run() -> None:
            try:
                parallel(noop, None, size, 0)
            finally:
                started.set()
            self._stop.wait()
            release_openmp_threads()

        thread = threading.Thread(target=run, name="pagedserve-spin-throttle", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had: a step must not fail for this
            logger.warning("the OpenMP spin throttle did not start (%s); left off", e)
            return False
        if not started.wait(timeout=10):  # never seen; the engine must not wait on it
            logger.warning("the OpenMP spin throttle did not start; left off")
            self._stop.set()
            return False
        self._thread = thread
        return True

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None


def _run_delay_ns() -> tuple[int, int] | None:
    """(ns this thread ran, ns it waited runnable for a CPU) from /proc/thread-self/schedstat;
    None where the kernel does not report it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


class ContentionGuard:
    """Adapts torch's intra-op threads to oversubscribed cores and restores them when the cores
    are free; ``check(rows)`` is called once per engine step, with the step's token count, on
    the thread that runs the forward.

    Every ``interval`` seconds it reads the share of wall time this thread waited runnable for
    a CPU (the kernel's run delay). Above ``high`` the cores are contended, and until it is
    below ``low`` again:

    - libgomp spins only 100 times before its threads sleep (``SpinThrottle``), so a thread
      waiting at a barrier for a descheduled peer gives the core back instead of spinning;
    - steps of fewer than ``ROWS`` tokens run on one thread: no barrier at all. A parallel
      region waits for both threads, and a thread that slept at the last barrier may wait
      for a time slice to run again; a step of few rows is made of short regions, so its
      second thread's share of a contended core does not pay for those waits, while a large
      step's longer regions do (docs/performance.md, "Shared cores"). Where the throttle
      cannot be held, every step runs on one thread.

    The full count is tried again after a hold that doubles each time the full count is
    contended again within a hold (up to ``MAX_HOLD``), so a machine with one spare core does
    not flip every interval. ``threads`` 1, or a kernel without schedstat, leaves it idle.
    """

    MAX_HOLD = 64.0  # seconds
    # mid-way through 8-32 tokens, where one thread and two throttled ones measured even; from
    # 64, two won by a third (benchmarks/shared_cores.py --rows-sweep)
    ROWS = 32

    def __init__(self, threads: int, interval: float = 0.5, high: float = 0.2,
                 low: float = 0.05, clock=time.monotonic, read=_run_delay_ns,
                 set_threads=None, throttle: SpinThrottle | None = None):
        import torch

        self.threads, self.interval, self.high, self.low = threads, interval, high, low
        self.clock, self.read = clock, read
        self.set_threads = set_threads or torch.set_num_threads
        self.throttle = throttle or SpinThrottle()
        self.contended = False  # the throttle held (or tried), small steps on one thread
        self.throttled = False  # the throttle is held (else every step on one thread)
        self.current = threads  # the count torch runs with now
        self.hold, self.until = 4 * interval, 0.0
        self.last = (clock(), read()) if threads > 1 else None
        self.just_restored = False  # the next sample is the first with the full count back
        # a collected guard must not leave libgomp throttled for the rest of the process
        weakref.finalize(self, self.throttle.release)

    def check(self, rows: int = 1) -> None:
        if self.last is None or self.last[1] is None:
            return
        self._sample()
        want = self.threads
        if self.contended and not (self.throttled and rows >= self.ROWS):
            want = 1
        if want != self.current:
            self.current = want
            self.set_threads(want)

    def _sample(self) -> None:
        now = self.clock()
        if now - self.last[0] < self.interval:
            return
        sample = self.read()
        if sample is None:
            self.last = None
            self._restore()
            return
        if now - self.last[0] > 4 * self.interval:  # after an idle gap: a new baseline only
            self.last = (now, sample)
            return
        waited = (sample[1] - self.last[1][1]) / 1e9 / (now - self.last[0])
        self.last = (now, sample)
        if not self.contended and waited > self.high:
            # contended right after a restore (the full count itself oversubscribes): hold
            # twice as long as last time; otherwise the base hold
            recent = self.just_restored
            self.hold = min(2 * self.hold, self.MAX_HOLD) if recent else 4 * self.interval
            self.contended, self.until = True, now + self.hold
            self.throttled = self.throttle.hold(self.threads)
            logger.debug("cores contended (waited %.0f%% for a CPU): %s for %.0fs",
                         100 * waited, "spin throttled, small steps on 1 thread"
                         if self.throttled else "1 thread", self.hold)
        elif self.contended and waited < self.low and now >= self.until:
            self._restore()
            self.just_restored = True
            logger.debug("cores free again: %d threads", self.threads)
            return
        self.just_restored = False

    def _restore(self) -> None:
        self.contended = self.throttled = False
        self.throttle.release()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of /proc/cpuinfo's first processor (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def matrix_unit(flags: frozenset[str] | None = None) -> str:
    """The fastest bfloat16 matmul unit of this CPU: "amx" (AMX tiles, Sapphire Rapids and
    later), "avx512_bf16" (``vdpbf16ps``, e.g. Zen 4, Cooper Lake) or "none"."""
    flags = cpu_flags() if flags is None else flags
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "none"
