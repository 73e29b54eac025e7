"""Tensor-parallel processes: start, watch and stop the workers, and run each step on all ranks.

The driver (rank 0, in the engine's process) owns the only scheduler and block-id space: each
step it broadcasts the ModelInput (block tables, slot mapping, block copies) once, every rank
runs the same forward on its shard (``distributed.parallel_state``), and the logits are
gathered to rank 0, which samples.

Start-up is torch.distributed's environment rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE): on one host the engine starts ranks 1..N-1 itself (``python -m
pagedserve.cli worker`` with that environment); across hosts each rank is started by hand and
rank 0's engine sends the engine options to the others. A worker that dies ends the engine with
WorkerDiedError naming the rank; the remaining workers are stopped, none is left behind.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from pagedserve import envs
from pagedserve.cpu import omp_num_threads_set, set_threads, threads_per_rank
from pagedserve.distributed.parallel_state import TPGroup, device_group
from pagedserve.worker import build_worker

logger = logging.getLogger("pagedserve")


def _timeout() -> datetime.timedelta:
    """How long start-up and each collective wait for a silent peer (``envs.tp_timeout``).
    Idle workers are pinged (Driver._heartbeat), so waiting for the next step never hits it."""
    return datetime.timedelta(seconds=envs.tp_timeout())


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died or stopped answering; the engine cannot continue."""


# ---- processes --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    """Rank 0's side: starts (or meets) the workers, sends each step, watches them.

    ``spawn``: start ranks 1..N-1 on this host; otherwise the environment's MASTER_ADDR,
    MASTER_PORT, RANK=0 and WORLD_SIZE=N describe a group whose other ranks are started
    elsewhere (``pagedserve worker``).
    """

    def __init__(self, world_size: int, spawn: bool):
        if dist.is_initialized():
            raise ValueError("another tensor-parallel engine is running in this process; call "
                             "its llm_engine.shutdown() first (torch.distributed has one "
                             "default group per process)")
        _timeout()  # a bad PAGEDSERVE_TP_TIMEOUT fails here, before any worker starts
        self.world_size = world_size
        self.procs: list[subprocess.Popen] = []
        self.dead: str | None = None
        self._closed = False
        # One thread at a time talks to the group: a step (send + forward) or a heartbeat.
        self.lock = threading.RLock()
        self._last_send = time.monotonic()
        self._in_step = False
        if spawn:
            port = _free_port()
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": str(world_size), "PAGEDSERVE_TP_PARENT": str(os.getpid())}
            if not omp_num_threads_set():
                env["OMP_NUM_THREADS"] = str(threads_per_rank(world_size))
            for rank in range(1, world_size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pagedserve.cli", "worker"],
                    env={**env, "RANK": str(rank)}))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            set_threads(world_size)
            threading.Thread(target=self._watch, daemon=True).start()
        else:
            if int(os.environ.get("WORLD_SIZE", -1)) != world_size \
                    or int(os.environ.get("RANK", -1)) != 0:
                raise ValueError(
                    f"tensor_parallel_size={world_size} across hosts needs RANK=0 and "
                    f"WORLD_SIZE={world_size} (and MASTER_ADDR, MASTER_PORT) in the environment")
        try:
            dist.init_process_group("gloo", rank=0, world_size=world_size, timeout=_timeout(),
                                    init_method="env://")
        except Exception as e:
            self.close()
            raise WorkerDiedError(f"tensor-parallel start-up failed: {self.dead or e}") from e

    def _heartbeat(self) -> None:
        """Keep idle workers' wait for the next step inside the collective timeout: a ping
        every quarter of it (at most every 20 s)."""
        every = min(20.0, _timeout().total_seconds() / 4)
        while not self._closed and not self.dead:
            time.sleep(min(1.0, every / 2))
            with self.lock:
                if self._closed or self.dead or self._in_step \
                        or time.monotonic() - self._last_send < every:
                    continue
                try:
                    dist.broadcast_object_list(["ping"], src=0)
                    self._last_send = time.monotonic()
                except Exception as e:
                    self.dead = self.dead or f"a tensor-parallel worker stopped answering: {e}"
                    logger.error("%s", self.dead)
                    return

    def _watch(self) -> None:
        """Notice a dead worker within a second; stop the others so that no collective waits
        on it (their connections close and rank 0's call raises)."""
        while not self._closed:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._closed:
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
                    self.dead = (f"tensor-parallel worker rank {rank} (pid {p.pid}) died "
                                 f"({how})")
                    logger.error("%s; stopping the engine", self.dead)
                    self._kill_all()
                    return
            time.sleep(0.2)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def send(self, obj: Any) -> None:
        """Broadcast one message (engine options, a ModelInput, or None = stop) to every rank."""
        self.check()
        try:
            with self.lock:
                dist.broadcast_object_list([obj], src=0)
                self._last_send = time.monotonic()
        except Exception as e:
            raise self.failure(e) from e

    def run_step(self, inp: Any, execute: Callable[[Any], Any]) -> Any:
        """Send one step's ModelInput and run rank 0's part of it, as one unit. Anything that
        breaks it (a dead peer, KeyboardInterrupt) leaves the ranks out of step: the group is
        then stopped at once and the engine is dead."""
        with self.lock:
            self._in_step = True
            try:
                self.send(inp)
                result = execute(inp)
            except WorkerDiedError:
                raise
            except RuntimeError as e:
                raise self.failure(e) from e
            except BaseException as e:
                self.dead = self.dead or (f"a step was interrupted ({type(e).__name__}); the "
                                          "tensor-parallel group is stopped")
                self.close()
                raise
            self._in_step = False
            return result

    def wait_ready(self) -> None:
        """Wait until every worker has built its shard; raise WorkerDiedError naming the rank
        and its error when one could not (the others then exit)."""
        status: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(status, None)
        except Exception as e:
            raise self.failure(e) from e
        errors = [f"rank {r}: {err}" for r, err in enumerate(status) if err]
        if errors:
            self.dead = "tensor-parallel worker start-up failed: " + "; ".join(errors)
            self.close()
            raise WorkerDiedError(self.dead)
        self._last_send = time.monotonic()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    @property
    def alive(self) -> bool:
        """No worker died and the group is not shut down."""
        return self.dead is None and not self._closed

    def check(self) -> None:
        if self.dead:
            raise WorkerDiedError(self.dead)
        if self._closed:
            raise WorkerDiedError("the engine was shut down (LLMEngine.shutdown()); create a "
                                  "new one")

    def failure(self, e: BaseException) -> WorkerDiedError:
        """The error to raise after a collective failed: the dead rank when one is known."""
        time.sleep(0.5)  # give the watcher time to name the rank
        msg = self.dead or f"a tensor-parallel worker stopped answering: {e}"
        self.dead = msg
        self.close()
        return WorkerDiedError(msg)

    def close(self) -> None:
        """Tell the workers to stop, wait for them (killing any that hang), leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.dead or self._in_step:  # the ranks are out of step: no goodbye, just stop
            self._kill_all()
        elif dist.is_initialized():
            try:
                with self.lock:
                    dist.broadcast_object_list([None], src=0)
            except Exception:
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedRunner:
    """The engine's runner under tensor parallelism: lays out each step once (rank 0's
    ModelRunner.prepare), broadcasts it, runs rank 0's shard; the logits arrive on rank 0."""

    def __init__(self, runner, driver: Driver):
        self.runner = runner
        self.driver = driver

    def execute(self, sched):
        inp, out = self.runner.prepare(sched)
        out.logits, out.prompt_logits = self.driver.run_step(inp, self.runner.execute_model)
        return out


def _die_with_parent() -> None:
    """A locally spawned worker exits within half a second of its engine's process (even while
    loading; in a collective the closed connection ends it sooner)."""
    parent = envs.tp_parent()
    if parent is None:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def worker_main() -> NoReturn:
    """Rank > 0: join the group from the environment, build the shard the driver describes,
    run every step it broadcasts until it sends None, then end the process (exit code 0; 1
    when the build failed or the driver or a peer died).

    The process ends with ``os._exit`` and without ``destroy_process_group``: the OS closes its
    sockets as it would a killed worker's, which the driver tolerates. Tearing gloo down, or
    torch's static objects at interpreter exit, aborted a worker now and then ("terminate
    called without an active exception", SIGABRT) after a clean goodbye."""
    code = _serve_steps()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve_steps() -> int:
    _die_with_parent()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    set_threads(world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_timeout(),
                            init_method="env://")
    try:
        msg: list[Any] = ["ping"]
        while msg[0] == "ping":  # the driver's options (it may ping while loading)
            dist.broadcast_object_list(msg, src=0)
        if msg[0] is None:
            return 0
        runner, error = None, None
        try:
            if msg[0].device.startswith("cuda"):
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            tp = device_group(TPGroup(rank, world_size), msg[0].device)
            runner = build_worker(msg[0], tp)
        except Exception as e:  # reported to rank 0, which raises it
            error = f"{type(e).__name__}: {e}"
        status: list[Any] = [None] * world_size
        dist.all_gather_object(status, error)
        if any(status):
            return 1 if error else 0
        while True:
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                return 0
            if msg[0] != "ping":
                runner.execute_model(msg[0])
    except Exception as e:  # the driver or a peer died: leave quietly, the driver reports it
        print(f"pagedserve tensor-parallel worker rank {rank}: {e}", file=sys.stderr)
        return 1

