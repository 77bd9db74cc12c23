"""The engine core in a process of its own, as vLLM V1's EngineCore: the step loop keeps a GIL to itself.

An aggregated replica's front end (HTTP, intake, SSE) and its step loop used to share one interpreter:
every JSON body, every SSE write and every step took turns on one GIL. Here the replica starts a child
process that loads the model and runs the step loop; the two talk over a socketpair in msgpack frames:

    front end -> core:  ["add", <Request msgpack>]  ["abort", rid]  ["stats", n]  ["stop"]
    core -> front end:  ["ready"] | ["failed", why]  ["events", <one step's events, packed>]  ["stats", n, {...}]

One frame per step carries every request's events, so the cost is per step, not per token or request.
The child dies with the replica: when the replica's end of the socket closes (exit, crash, SIGKILL)
its next read sees end-of-file and it exits. When the child dies, every open stream ends with an error
event at once and ``healthy()`` turns false, so Serve replaces the replica; no caller waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from strata.pipeline.contract.request import Request, TokenEvent, pack_events, unpack_events
from strata.pipeline.contract.socket_child import child_main
from strata.stages.engine_service import INTERNAL_ERROR, EngineStreams

log = logging.getLogger(__name__)
_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode
ENGINE_GONE = "the engine process of this replica stopped; retry the request"


class EngineProcessError(RuntimeError):
    """The engine process could not start (its message says why, without internals)."""


class EngineProcess(EngineStreams):
    """The front end's handle on an engine core running in a child process."""

    def __init__(self, model_dir: str, engine_config: dict[str, Any], stream_interval_s: float = 0.0,
                 startup_timeout_s: float = 600.0) -> None:
        """Start the child, send it the model and config, and wait (bounded) until it has loaded."""
        super().__init__(stream_interval_s)
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.stages.engine_process", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._dead = threading.Event()
        self._sends: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._stats: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closing = False
        try:
            self.conn.send_bytes(_pack(["init", str(model_dir), engine_config]))
            if not self.conn.poll(startup_timeout_s):
                raise EngineProcessError(f"the engine did not load within {startup_timeout_s:.0f} s")
            reply = _unpack(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._kill()
            raise EngineProcessError("the engine process exited while loading the model") from exc
        except EngineProcessError:
            self._kill()
            raise
        if reply[0] != "ready":
            self._kill()
            raise EngineProcessError(reply[1])
        self._writer = threading.Thread(target=self._write, name="engine-process-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    # ------------------------------------------------------------ the front end's side
    async def _submit(self, request: Request) -> None:
        self._send(["add", request.to_msgpack()])

    def _abort(self, request_id: str) -> None:
        if not self._dead.is_set():  # a dead engine holds nothing to free
            self._send(["abort", request_id])

    def _send(self, message: list[Any]) -> None:
        """Queue a frame for the writer thread: a large request never blocks the event loop."""
        if self._dead.is_set():
            raise EngineProcessError(ENGINE_GONE)
        self._sends.put(_pack(message))

    async def stats(self) -> dict[str, Any]:
        n = next(self._ids)
        fut: Future = Future()
        with self._lock:
            self._stats[n] = fut
        try:
            self._send(["stats", n])
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=30.0)
        finally:
            with self._lock:
                self._stats.pop(n, None)

    def healthy(self) -> bool:
        return not self._dead.is_set() and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        """Stop the child (it finishes its step, lands its tier writes and exits); kill it if it will not."""
        self._closing = True  # its exit is expected from here on: not an error to log
        if not self._dead.is_set():
            self._sends.put(_pack(["stop"]))
            self._sends.put(None)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        self._gone(expected=True)

    # ------------------------------------------------------------ threads
    def _write(self) -> None:
        while (frame := self._sends.get()) is not None:
            try:
                self.conn.send_bytes(frame)
            except OSError:
                self._gone()
                return

    def _read(self) -> None:
        while True:
            try:
                message = _unpack(self.conn.recv_bytes())
            except (EOFError, OSError):
                self._gone()
                return
            if message[0] == "events":
                self._deliver(unpack_events(message[1]))
            elif message[0] == "stats":
                with self._lock:
                    fut = self._stats.get(message[1])
                if fut is not None and not fut.done():
                    fut.set_result(message[2])

    def _gone(self, expected: bool = False) -> None:
        """The child is gone (or going): fail every open stream and stats query now."""
        if self._dead.is_set():
            return
        self._dead.set()
        self._sends.put(None)
        if not expected and not self._closing:
            code = self.proc.poll()
            log.error("the engine process %s", "stopped answering" if code is None else f"exited (code {code})")
        self.delivery.send_all(lambda rid: [TokenEvent.failure(rid, ENGINE_GONE)])
        with self._lock:
            pending = list(self._stats.values())
        for fut in pending:
            if not fut.done():
                fut.set_exception(EngineProcessError(ENGINE_GONE))

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------- the child
def serve(conn: Connection) -> int:
    """Load the engine the first frame names, then step it while reading frames between steps."""
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.engine_service import engine_stats
    from strata.stages.factory import build_engine

    _, model_dir, config = _unpack(conn.recv_bytes())
    try:
        engine = build_engine(model_dir, EngineConfig.from_dict(config))
    except Exception as exc:
        log.exception("loading the model failed")
        conn.send_bytes(_pack(["failed", f"{type(exc).__name__}: {exc}"]))
        return 1
    conn.send_bytes(_pack(["ready"]))
    if engine.core.grammar is not None:
        engine.core.grammar.warm()  # the vocabulary's trie, before any stream could wait on it
    failures = 0
    try:
        while True:
            busy = engine.has_unfinished()
            while conn.poll(0 if busy else None):  # idle: sleep in the read; busy: take what is there
                message = _unpack(conn.recv_bytes())
                kind = message[0]
                if kind == "add":
                    request = Request.from_msgpack(message[1])
                    try:
                        engine.add(request)
                    except Exception as exc:  # a duplicate id: that request fails, nothing else
                        conn.send_bytes(_pack(["events", pack_events([TokenEvent.failure(request.request_id, str(exc))])]))
                elif kind == "abort":
                    engine.abort(message[1])
                elif kind == "stats":
                    conn.send_bytes(_pack(["stats", message[1], engine_stats(engine)]))
                elif kind == "stop":
                    return 0
                busy = engine.has_unfinished()
            if not busy:
                continue
            try:
                events = engine.step()
                failures = 0
            except Exception:  # fail what the engine holds, back off, go on (as the in-process loop does)
                log.exception("a step failed; failing the requests it held")
                failures += 1
                rids = list(engine._requests)
                for rid in rids:
                    engine.abort(rid)
                events = [TokenEvent.failure(rid, INTERNAL_ERROR) for rid in rids]
                time.sleep(min(1.0, 0.01 * 2**failures))
            if events:
                conn.send_bytes(_pack(["events", pack_events(events)]))
    except (EOFError, OSError):  # the replica is gone: so are we
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    child_main(serve, "engine-process")
