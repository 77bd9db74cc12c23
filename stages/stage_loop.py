"""Runs a stage's step loop on its own thread and hands results to asyncio callers.

A serving replica receives requests on an event loop but must step its engine core
continuously, batching every request it holds (continuous batching). The step loop owns the
stage: requests, aborts and queries are closures queued to it and run between steps, so the
stage itself needs no locks. Results are delivered back with ``call_soon_threadsafe``.

When a step raises, ``on_error`` fails every request the stage holds (their callers get an error
now, not never) and the loop backs off before it tries again, so a persistent fault neither hangs
callers nor burns a core. A watchdog reports a step running longer than ``stuck_after_s`` (log and
``stuck_steps``), once per stuck step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoopStopped(RuntimeError):
    """The stage is shutting down: a call arrived after its loop stopped."""


class StageLoop:
    """One thread that alternates between queued commands and ``step()`` while ``has_work()``."""

    def __init__(self, step: Callable[[], None], has_work: Callable[[], bool], name: str = "stage-loop",
                 on_error: Callable[[BaseException], None] | None = None, stuck_after_s: float = 60.0) -> None:
        self._step = step
        self._has_work = has_work
        self._on_error = on_error
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.name = name
        self.steps = 0
        self.failures = 0
        self.stuck_steps = 0
        self.stuck_after_s = stuck_after_s
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    def call(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the loop thread before the next step; its result (or exception) lands in the Future."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(LoopStopped("the stage loop is stopped"))
            return fut
        self._commands.put((fn, fut))
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        """``call`` for asyncio code: await the result."""
        return await asyncio.wrap_future(self.call(fn))

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                if self._stop.is_set():
                    fut.set_exception(LoopStopped("the stage loop is stopped"))
                else:
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # delivered to the caller, never kills the loop
                        fut.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        consecutive = 0
        while not self._stop.is_set():
            busy = self._has_work()
            self._drain(block=not busy)
            if not busy and not self._has_work():
                continue
            self._step_started = time.monotonic()
            try:
                self._step()
                self.steps += 1
                consecutive = 0
            except Exception as exc:  # the replica survives; the requests it held get an error now
                self.failures += 1
                consecutive += 1
                log.exception("%s: a step failed; failing the requests it held", self.name)
                if self._on_error is not None:
                    try:
                        self._on_error(exc)
                    except Exception:
                        log.exception("%s: failing the requests did not work either", self.name)
                self._stop.wait(min(1.0, 0.01 * 2**consecutive))  # back off: a persistent fault must not spin
            finally:
                self._step_started = None

    def _watch(self) -> None:
        reported: float | None = None
        while not self._stop.wait(min(1.0, self.stuck_after_s / 4)):
            started = self._step_started
            if started is not None and started != reported and time.monotonic() - started > self.stuck_after_s:
                reported = started
                self.stuck_steps += 1
                log.error("%s: a step has been running for over %.0f s", self.name, self.stuck_after_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._drain(block=False)  # commands that raced with stopping still get an answer



class Delivery:
    """Thread-safe hand-off of per-request results to the asyncio loop that waits for them."""

    def __init__(self) -> None:
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()

    def open(self, key: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._sinks[key] = (asyncio.get_running_loop(), q)
        return q

    def close(self, key: str) -> None:
        with self._lock:
            self._sinks.pop(key, None)

    def send(self, key: str, item: Any) -> None:
        self.send_many([(key, item)])

    def send_all(self, make: Callable[[str], Any]) -> None:
        """Deliver ``make(key)`` to every open request (e.g. an error event to each)."""
        with self._lock:
            keys = list(self._sinks)
        self.send_many([(key, make(key)) for key in keys])

    def send_many(self, items: list[tuple[str, Any]]) -> None:
        """Deliver a step's results for many requests with one wake-up per event loop (not one per
        request): at high concurrency the hand-off between the step thread and the loop is per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for key, item in items:
                sink = self._sinks.get(key)
                if sink is not None:
                    by_loop.setdefault(sink[0], []).append((sink[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sinks)


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
