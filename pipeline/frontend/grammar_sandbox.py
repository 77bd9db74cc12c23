"""Request grammars compiled where a crash or a hang costs only that request: a child process.

llguidance compiles a grammar against the vocabulary when its first mask is computed, and that can take
seconds, or overflow the compiler's stack and kill the process (SIGSEGV) on inputs the static limits
(``grammar_limits``) did not foresee. So before a constrained request is admitted, the front door sends its
spec to a sandbox child that builds the matcher with the model's own tokenizer and computes the first mask,
under :func:`structured.parser_limits`, one spec at a time, within ``timeout_s``:

* it compiles: the request goes on (the engine compiles it again, off its step loop, knowing it can);
* it is refused (invalid, past a limit, or the matcher errs on its first mask, as a ``$ref`` cycle does):
  a ``GrammarRefused`` (HTTP 400) with llguidance's first line;
* the child dies or misses the deadline: it is replaced, and the request is refused by name.

Verdicts are cached by spec, so a grammar that crashed the child once is refused at once the next time. The
child is started on first use and shared by every front door of this process that serves the same tokenizer.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Callable

import msgspec

log = logging.getLogger(__name__)
_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode
START_TIMEOUT_S = 120.0  # loading a tokenizer on a busy machine


class GrammarRefused(ValueError):
    """A structured-output spec this server will not run (an HTTP 400; the message says why)."""


class GrammarSandboxError(RuntimeError):
    """The sandbox could not start (a server fault, not the request's)."""


class GrammarSandbox:
    """One child process that compiles grammars for the front doors of one tokenizer."""

    def __init__(self, tokenizer: Callable[[], tuple[str, int | None]], vocab_size: int, timeout_s: float,
                 cache_size: int = 512) -> None:
        """``tokenizer``: the (serialized tokenizer, EOS id) pair of ``structured.tokenizer_spec``, asked for
        when the child starts."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # None: it compiles
        self._cache_size = cache_size
        self._lock = threading.Lock()  # one spec at a time through the child
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.compiled = self.refused = self.crashes = self.timeouts = 0

    def check(self, kind: str, value: str) -> None:
        """Return if ``(kind, value)`` compiles against the vocabulary; GrammarRefused saying why not."""
        key = (kind, value)
        with self._lock:
            if key not in self._verdicts:
                self._verdicts[key] = self._compile(kind, value)
                while len(self._verdicts) > self._cache_size:
                    self._verdicts.popitem(last=False)
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        if verdict is not None:
            raise GrammarRefused(verdict)

    def start(self) -> None:
        """Start the child now (a server does at start: serializing the tokenizer holds the GIL for ~0.2 s on
        a 49K vocabulary, and the child's start costs a core for ~0.5 s, neither of which should land beside
        running streams)."""
        with self._lock:
            self._child()

    def _compile(self, kind: str, value: str) -> str | None:
        conn = self._child()
        try:
            conn.send_bytes(_pack(["check", kind, value]))
            if not conn.poll(self.timeout_s):
                self.timeouts += 1
                log.warning("a %s grammar did not compile within %.0f s; restarting the grammar sandbox", kind,
                            self.timeout_s)
                self._stop()
                return f"the {kind} grammar did not compile within {self.timeout_s:g} s (the grammar compile deadline)"
            reply = _unpack(conn.recv_bytes())
        except (EOFError, OSError):
            self.crashes += 1
            code = self._stop()
            log.warning("the grammar sandbox died compiling a %s grammar (exit %s); restarting it", kind, code)
            return f"the {kind} grammar is too large or too deep to compile (the grammar compiler failed on it)"
        if reply[0] == "ok":
            self.compiled += 1
            return None
        self.refused += 1
        return str(reply[1])

    def _child(self) -> Connection:
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._stop()
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "strata.pipeline.frontend.grammar_worker", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        try:
            conn.send_bytes(_pack(["init", *self.tokenizer(), self.vocab_size]))
            if not conn.poll(START_TIMEOUT_S):
                raise GrammarSandboxError("the grammar sandbox did not start in time")
            reply = _unpack(conn.recv_bytes())
        except (EOFError, OSError):
            reply = ["failed", "it exited while loading the tokenizer"]
        except GrammarSandboxError:
            reply = ["failed", "it did not start in time"]
        if reply[0] != "ready":
            proc.kill()
            proc.wait(timeout=10)
            conn.close()
            log.error("the grammar sandbox could not start: %s", reply[1])
            raise GrammarSandboxError("structured output is unavailable: its grammar compiler could not start")
        self._proc, self._conn = proc, conn
        return conn

    def _stop(self) -> int | None:
        """Kill the child (if any); its exit code."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait(timeout=10)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def close(self) -> None:
        with self._lock:
            self._stop()


_sandboxes: dict[tuple[str, int], GrammarSandbox] = {}
_registry_lock = threading.Lock()


def sandbox_for(tokenizer_dir: str, vocab_size: int, timeout_s: float,
                tokenizer: Callable[[], tuple[str, int | None]]) -> GrammarSandbox:
    """This process's sandbox for the tokenizer in ``tokenizer_dir`` (started on its first spec)."""
    key = (os.path.realpath(tokenizer_dir), vocab_size)
    with _registry_lock:
        box = _sandboxes.get(key)
        if box is None:
            box = _sandboxes[key] = GrammarSandbox(tokenizer, vocab_size, timeout_s)
        box.timeout_s = timeout_s
        return box


@atexit.register
def _close_all() -> None:
    for box in list(_sandboxes.values()):
        box.close()
