"""Runs a stage's step loop on its own thread and hands results to asyncio callers.

A serving replica receives requests on an event loop but must step its engine core
continuously, batching every request it holds (continuous batching). The step loop owns the
stage: requests, aborts and queries are closures queued to it and run between steps, so the
stage itself needs no locks. Results are delivered back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class StageLoop:
    """One thread that alternates between queued commands and ``step()`` while ``has_work()``."""

    def __init__(self, step: Callable[[], None], has_work: Callable[[], bool], name: str = "stage-loop") -> None:
        self._step = step
        self._has_work = has_work
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.steps = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the loop thread before the next step; its result (or exception) lands in the Future."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("the stage loop is stopped"))
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
                    fut.set_exception(RuntimeError("the stage loop is stopped"))
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
        while not self._stop.is_set():
            busy = self._has_work()
            self._drain(block=not busy)
            if not busy and not self._has_work():
                continue
            try:
                self._step()
                self.steps += 1
            except Exception:  # a bug in one step must not kill the replica; callers time out or abort
                self.failures += 1
                log.exception("stage step failed")

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
