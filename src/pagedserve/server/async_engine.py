"""The engine behind the server: one thread owns the LLMEngine and steps it; asyncio handlers
talk to it only through a command queue and per-request output queues.

Invariants: only the engine thread touches the LLMEngine (and its tokenizer); a request whose
consumer goes away (client disconnect, cancelled task) is aborted in the engine thread before
its next step, so its blocks are freed within a step; an engine failure ends every open stream
with the error and turns ``/health`` unhealthy instead of hanging clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.cpu import release_openmp_threads
from pagedserve.engine import LLMEngine
from pagedserve.inputs import PromptType
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.stats import EngineStats

logger = logging.getLogger("pagedserve")


class TooManyRequestsError(Exception):
    """More requests wait than ``max_num_waiting`` allows (answered with 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server cannot generate any more."""


class AsyncEngine:
    """Runs ``engine`` in a background thread.

    Args:
        engine: the LLMEngine; from now on used only by the engine thread.
        max_num_waiting: most requests allowed to wait for admission; more get
            TooManyRequestsError. None: unbounded.
        on_step: called in the engine thread after every step with the engine's
            ``EngineStats`` snapshot; the server's metrics hook. Its exceptions are logged,
            never fatal.
    """

    def __init__(self, engine: LLMEngine, max_num_waiting: int | None = None,
                 on_step: Callable[[EngineStats], None] | None = None):
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self.on_step = on_step
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._stopping = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; the caller's OpenMP threads are released first, since from
        now on only the engine thread runs the model (cpu.release_openmp_threads)."""
        release_openmp_threads()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        self._stopping = True
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and self.engine.is_healthy()

    @property
    def failure(self) -> str:
        """Why the engine is not healthy (for /health)."""
        if self.error is not None:
            return repr(self.error)
        driver = getattr(self.engine, "driver", None)
        if driver is not None and driver.dead:
            return driver.dead
        return "the engine thread stopped" if not self._thread.is_alive() else "shut down"

    # ---- the asyncio side ---------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result (its
        exception is raised here)."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def add(self, requests: list[tuple[str, PromptType, SamplingParams]]
                  ) -> list[AsyncIterator[RequestOutput]]:
        """Add requests together (all or none) and return one output stream for each.

        Each (request_id, prompt, params) goes to ``engine.add_request`` in the engine thread;
        pass prompts as token ids (``InputProcessor.process_prompt`` in a worker thread) so
        that no tokenizer runs on the engine thread. If one is refused, the ones before it are
        aborted and the error is raised here. A stream yields the request's outputs until it
        finishes; closing or cancelling it before that aborts the request.

        Raises:
            ValueError: a request was refused (bad input). TooManyRequestsError: the waiting
            queue is full. EngineDeadError: the engine failed or is shutting down.
        """
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in requests]

        def add_all(engine: LLMEngine) -> None:
            if self.max_num_waiting is not None:
                # A request of several prompts is let in whenever nothing waits, so that one
                # with more prompts than the limit is not refused forever.
                waiting, after = engine.scheduler.num_waiting(len(requests))
                if after > self.max_num_waiting and (waiting or len(requests) == 1):
                    raise TooManyRequestsError(
                        f"{waiting} requests are already waiting (max_num_waiting="
                        f"{self.max_num_waiting}); retry later")
            added = []
            try:
                for (request_id, prompt, params), outputs in zip(requests, queues):
                    engine.add_request(request_id, prompt, params)
                    added.append(request_id)
                    self._streams[request_id] = (loop, outputs)
            except BaseException:
                self._abort(engine, added)
                raise

        await self.call(add_all)
        return [self._stream(request_id, outputs)
                for (request_id, _, _), outputs in zip(requests, queues)]

    async def _stream(self, request_id: str, outputs: asyncio.Queue
                      ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort([request_id])

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests from any thread, in one command (no-op for those that finished)."""
        self._commands.put((lambda e: self._abort(e, request_ids), None))

    # ---- the engine thread --------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("the server is shutting down")

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        engine.abort_request(request_ids)

    def _run_command(self, command: Any) -> None:
        fn, future = command
        if future is not None and not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as e:  # handed to the caller; the engine goes on serving
            if future is None:
                raise
            future.set_exception(e)
        else:
            if future is not None:
                future.set_result(result)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                # Block for commands only when idle; otherwise drain what arrived and step.
                block = not engine.has_unfinished_requests()
                ran = False
                while True:
                    try:
                        command = self._commands.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    self._run_command(command)
                    block, ran = False, True
                if not engine.has_unfinished_requests():
                    if ran:  # e.g. the last request was aborted: the gauges must show it
                        self._after_step()
                    continue
                outputs = engine.step()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        if out.finished:
                            del self._streams[out.request_id]
                        stream[0].call_soon_threadsafe(stream[1].put_nowait, out)
                self._after_step()
        except BaseException as e:
            logger.exception("the engine thread failed")
            self.error = e
        finally:
            self._close_all()

    def _after_step(self) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine.engine_stats())
            except Exception:
                logger.exception("metrics hook failed")

    def _close_all(self) -> None:
        """End every open stream (error or shutdown) and fail pending commands."""
        error = EngineDeadError(f"the engine failed: {self.error!r}" if self.error is not None
                                else "the server is shutting down")
        for loop, outputs in self._streams.values():
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, error)
            except RuntimeError:  # the event loop is already closed
                pass
        self._streams.clear()
        ids = list(self.engine.requests)
        if ids:
            self.engine.abort_request(ids)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not None and command[1] is not None:
                command[1].set_exception(error)
