"""pagedserve.cpu: usable CPUs from affinity and cgroup quotas, the OpenMP spin limit set
before torch loads, the matrix-unit choice from CPU flags, and thread caps."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedserve import cpu


def _cgroup(tmp_path, lines: str, files: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(lines)
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    return cpu._cgroup_quota(root, proc)


def test_cgroup_v2_quota(tmp_path):
    assert _cgroup(tmp_path, "0::/job\n", {"job/cpu.max": "150000 100000\n"}) == 1.5


def test_cgroup_v2_unlimited_and_parent_limit(tmp_path):
    assert _cgroup(tmp_path, "0::/a/b\n", {"a/b/cpu.max": "max 100000\n"}) is None
    # a parent's quota binds its children
    assert _cgroup(tmp_path / "x", "0::/a/b\n", {"a/b/cpu.max": "max 100000\n",
                                                 "a/cpu.max": "300000 100000\n"}) == 3.0


def test_cgroup_v1_quota(tmp_path):
    lines = "2:cpuacct:/\n1:cpu:/pod\n0::/\n"
    assert _cgroup(tmp_path, lines, {"cpu/pod/cpu.cfs_quota_us": "200000\n",
                                     "cpu/pod/cpu.cfs_period_us": "100000\n"}) == 2.0
    assert _cgroup(tmp_path / "y", lines, {"cpu/pod/cpu.cfs_quota_us": "-1\n",
                                           "cpu/pod/cpu.cfs_period_us": "100000\n"}) is None


def test_no_cgroup_file(tmp_path):
    assert cpu._cgroup_quota(tmp_path, tmp_path / "missing") is None


def test_usable_cpus_capped_by_quota(monkeypatch):
    cpu.usable_cpus.cache_clear()
    try:
        monkeypatch.setattr(cpu, "_cgroup_quota", lambda: 1.2)
        affinity = len(os.sched_getaffinity(0))
        assert cpu.usable_cpus() == min(affinity, 2)
        cpu.usable_cpus.cache_clear()
        monkeypatch.setattr(cpu, "_cgroup_quota", lambda: 0.5)
        assert cpu.usable_cpus() == 1
        assert cpu.threads_per_rank(4) == 1
    finally:
        cpu.usable_cpus.cache_clear()


def test_set_threads_only_lowers(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        monkeypatch.setattr(cpu, "usable_cpus", lambda: 64)
        torch.set_num_threads(1)
        cpu.set_threads(1)
        assert torch.get_num_threads() == 1  # an application's smaller choice stays
        monkeypatch.setattr(cpu, "usable_cpus", lambda: 1)
        torch.set_num_threads(2)
        cpu.set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_matrix_unit_from_flags():
    assert cpu.matrix_unit(frozenset({"avx512f", "amx_tile", "amx_bf16", "avx512_bf16"})) == "amx"
    assert cpu.matrix_unit(frozenset({"avx512f", "avx512_bf16"})) == "avx512_bf16"
    assert cpu.matrix_unit(frozenset({"avx2", "fma"})) == "none"
    assert cpu.matrix_unit(frozenset()) == "none"


def test_limit_spinning_respects_the_user(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cpu.limit_spinning()
    assert os.environ["GOMP_SPINCOUNT"] == cpu.SPIN_COUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")
    cpu.limit_spinning()
    assert os.environ["GOMP_SPINCOUNT"] == "77"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cpu.limit_spinning()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_import_sets_spin_count_before_torch():
    """Importing pagedserve sets the variable without loading torch, so libgomp reads it when
    torch loads; called after torch, limit_spinning reports that it came too late."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = ("import os, sys, pagedserve; print(os.environ.get('GOMP_SPINCOUNT'), "
            "'torch' in sys.modules); import torch, pagedserve.cpu as c; "
            "print(c.limit_spinning())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [cpu.SPIN_COUNT, "False", "False"]


class _Clock:
    def __init__(self):
        self.now, self.waited, self.calls = 0.0, 0, []

    def step(self, seconds: float, wait_share: float) -> None:
        self.now += seconds
        self.waited += int(seconds * wait_share * 1e9)


class _Throttle:
    def __init__(self, available: bool = True):
        self.available, self.held, self.events = available, False, []

    def hold(self, threads: int) -> bool:
        self.events.append("hold")
        self.held = self.available
        return self.available

    def release(self) -> None:
        if self.held:
            self.events.append("release")
        self.held = False


def _guard(clock, throttle=None):
    return cpu.ContentionGuard(2, interval=0.5, clock=lambda: clock.now,
                               read=lambda: (0, clock.waited),
                               set_threads=clock.calls.append,
                               throttle=throttle or _Throttle())


def test_contention_guard_drops_to_one_thread_and_back():
    c = _Clock()
    g = _guard(c)
    c.step(0.6, 0.01)
    g.check()
    assert c.calls == []  # quiet: untouched
    c.step(0.6, 0.4)
    g.check()
    assert c.calls == [1]  # the thread waited 40% of the time for a CPU
    c.step(0.6, 0.3)
    g.check()
    assert c.calls == [1]  # still contended with one thread
    for _ in range(4):  # quiet again: back to 2 once the hold (2 s) is over
        c.step(0.6, 0.0)
        g.check()
    assert c.calls == [1, 2]


def test_contention_guard_backs_off_when_the_full_count_oversubscribes():
    """One spare core: one thread sees no wait, two threads do. Each failed restore doubles the
    hold, so the flips get rarer."""
    c = _Clock()
    g = _guard(c)
    flips, t = [], 0.0
    while t < 120:
        share = 0.3 if g.threads and not g.contended else 0.0
        c.step(0.5, share)
        t += 0.5
        g.check()
        if len(c.calls) > len(flips):
            flips.append(t)
    restores = [t for t, n in zip(flips, c.calls) if n == 2]
    assert len(restores) >= 3
    gaps = [b - a for a, b in zip(restores, restores[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))  # growing holds
    assert g.hold <= cpu.ContentionGuard.MAX_HOLD


def test_contention_guard_idle_without_schedstat_or_threads():
    c = _Clock()
    g = cpu.ContentionGuard(2, clock=lambda: c.now, read=lambda: None,
                            set_threads=c.calls.append)
    c.step(10, 1.0)
    g.check()
    one = cpu.ContentionGuard(1, clock=lambda: c.now, read=lambda: (0, c.waited),
                              set_threads=c.calls.append)
    c.step(10, 1.0)
    one.check()
    assert c.calls == []


def test_contention_guard_switch(monkeypatch):
    from pagedserve import envs

    monkeypatch.setenv("PAGEDSERVE_CONTENTION_GUARD", "0")
    assert envs.contention_guard() is False
    monkeypatch.setenv("PAGEDSERVE_CONTENTION_GUARD", "1")
    assert envs.contention_guard() is True
    monkeypatch.delenv("PAGEDSERVE_CONTENTION_GUARD")
    assert envs.contention_guard() is True


def test_contention_guard_rebaselines_after_an_idle_gap():
    """A sample spanning idle time (no steps) says nothing about the cores: no switch."""
    c = _Clock()
    g = _guard(c)
    c.step(0.6, 0.5)
    g.check()
    assert c.calls == [1]
    c.step(30, 0.0)  # idle: the wait share over the gap is ~0
    g.check()
    assert c.calls == [1]  # not restored on the strength of the gap


def test_bad_omp_num_threads_is_ignored_and_odd_cgroup_files_too(monkeypatch, tmp_path):
    for value, ok in (("2", True), ("4,2", True), ("0", False), ("abc", False), ("", False)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert cpu.omp_num_threads_set() is ok
    assert _cgroup(tmp_path, "garbage\n0::/j\n", {"j/cpu.max": "100000 0\n"}) is None


def test_release_openmp_threads_frees_the_callers_pool(tmp_path):
    """After a parallel region the calling thread's OpenMP workers exist; releasing them ends
    those threads (the server does this before its engine thread takes over the model), and
    the next region starts them again. Without a libgomp in the maps: False, nothing done."""
    code = """
import os, time, torch
from pagedserve.cpu import release_openmp_threads
torch.set_num_threads(2)
x = torch.randn(4_000_000)
(x * 2).sum()
before = len(os.listdir('/proc/self/task'))
released = release_openmp_threads()
time.sleep(0.2)
after = len(os.listdir('/proc/self/task'))
(x * 2).sum()
print(released, before, after, len(os.listdir('/proc/self/task')))
"""
    if (os.cpu_count() or 1) < 2 or "libgomp" not in open("/proc/self/maps").read():
        pytest.skip("one CPU (no workers to free) or a torch without libgomp")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}, check=True)
    released, before, after, again = out.stdout.split()
    assert released == "True" and int(after) < int(before) and int(again) == int(before)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /usr/lib/libc.so.6\n")
    assert cpu.release_openmp_threads(maps) is False


def test_contention_guard_keeps_large_steps_on_all_threads_under_the_throttle():
    """Contended: the spin throttle is held, steps of ROWS tokens or more keep both threads and
    smaller ones run on one; once free, the throttle is released and both threads are back."""
    c, t = _Clock(), _Throttle()
    g = _guard(c, t)
    big, small = cpu.ContentionGuard.ROWS, cpu.ContentionGuard.ROWS - 1
    c.step(0.6, 0.4)
    g.check(big)
    assert t.held and c.calls == []  # contended, but a large step keeps 2 threads
    c.step(0.1, 0.4)
    g.check(small)
    assert c.calls == [1]
    g.check(big)
    assert c.calls == [1, 2]
    g.check(1)
    for _ in range(5):  # free again (the hold is 2 s)
        c.step(0.6, 0.0)
        g.check(1)
    assert not t.held and t.events == ["hold", "release"]
    assert c.calls == [1, 2, 1, 2]


def test_contention_guard_without_the_throttle_runs_every_step_on_one_thread():
    c = _Clock()
    g = _guard(c, _Throttle(available=False))
    c.step(0.6, 0.4)
    g.check(4 * cpu.ContentionGuard.ROWS)
    assert c.calls == [1]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_spin_throttle_holds_an_idle_openmp_pool_and_frees_it():
    """hold() adds a thread with an OpenMP pool that outnumbers the CPUs beside the engine's
    threads; release() ends both. No libgomp (another OpenMP build): nothing is held."""
    torch.ones(1 << 16).sum()  # libgomp loaded and this thread's pool made
    throttle = cpu.SpinThrottle()
    before = _threads()
    threads = torch.get_num_threads()
    held = throttle.hold(threads)
    if cpu._libgomp() is None:
        assert not held and _threads() == before
        return
    cpus = len(os.sched_getaffinity(0))
    if cpus - threads + 1 > cpu.SpinThrottle.MAX_EXTRA:
        assert not held
        return
    # >= and <=: a thread of an earlier test may end meanwhile
    assert held and throttle.held
    assert _threads() >= before + 1 + (cpus - threads + 1)  # the holder and its pool
    assert throttle.hold(threads)  # idempotent
    assert _threads() <= before + 1 + (cpus - threads + 1)
    throttle.release()
    assert not throttle.held
    deadline = time.monotonic() + 5
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() <= before


def test_a_collected_guard_releases_its_throttle():
    import gc

    c, t = _Clock(), _Throttle()
    g = _guard(c, t)
    c.step(0.6, 0.4)
    g.check(1)
    assert t.held
    del g
    gc.collect()
    assert not t.held


_THROTTLE_CHILD = """
import time, torch
from pagedserve import cpu
x = torch.ones(1 << 20)

def spun(throttled):
    throttle = cpu.SpinThrottle()
    if throttled:
        assert throttle.hold(torch.get_num_threads())
    x.sum()  # a parallel region; afterwards its worker waits for the next one
    t0 = time.process_time()
    time.sleep(1.0)
    spent = time.process_time() - t0
    throttle.release()
    return spent

print(spun(True), spun(False))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or cpu._libgomp() is None,
                    reason="needs 2 CPUs and libgomp")
def test_spin_throttle_makes_waiting_openmp_threads_sleep():
    """The mechanism itself: with a spin count of 10^10, an OpenMP worker busy-waits through a
    1 s pause after a parallel region (the process burns CPU while its main thread sleeps; on
    cores that other work also wants, a share of that second); with the throttle held it
    sleeps after 100 spins."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["GOMP_SPINCOUNT"] = "10000000000"
    out = subprocess.run([sys.executable, "-c", _THROTTLE_CHILD], env=env, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    throttled, spinning = map(float, out)
    assert throttled < 0.05 and spinning > 0.15, (throttled, spinning)


def test_spin_throttle_declines_where_the_pool_would_need_many_idle_threads(monkeypatch):
    """A CPU quota far below the affinity mask (2 threads on 16 CPUs): outnumbering the CPUs
    would take 15 idle threads, so nothing is held and the guard runs every step on one
    thread instead."""
    before = _threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    throttle = cpu.SpinThrottle()
    assert throttle.hold(2) is False and not throttle.held
    assert _threads() == before


_IDLE_SPIN_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
import shared_cores  # imports torch (through common) before pagedserve, as its children do
import torch
x = torch.ones(1 << 20)
spent = 0.0
for _ in range(20):
    x.sum()  # a parallel region; then its worker spins until its count runs out
    t0 = time.process_time()
    time.sleep(0.05)
    spent += time.process_time() - t0
print(spent)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or cpu._libgomp() is None,
                    reason="needs 2 CPUs and libgomp")
def test_the_shared_cores_benchmark_runs_its_default_with_the_spin_limit():
    """The benchmark's children load torch before pagedserve, so the spin limit pagedserve
    sets on import would come too late: its default setting must pass it. An idle worker
    spins about 30x longer after each region under libgomp's 300,000 spins than under
    pagedserve's limit."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import shared_cores
    finally:
        sys.path.remove(str(bench))
    base = {k: v for k, v in os.environ.items()
            if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}

    def idle_cpu(setting: str) -> float:
        env = {**base, **shared_cores.SETTINGS[setting], "PAGEDSERVE_LOGGING_LEVEL": "WARNING"}
        return float(subprocess.run([sys.executable, "-c", _IDLE_SPIN_CHILD, str(bench)],
                                    env=env, capture_output=True, text=True, check=True,
                                    timeout=120).stdout.split()[-1])

    default = idle_cpu("pagedserve default")
    libgomp = idle_cpu("libgomp default (300,000 spins)")
    assert default < 0.3 * libgomp, (default, libgomp)
