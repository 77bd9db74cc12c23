"""The grammar sandbox's child (``grammar_sandbox``): compiles one spec at a time against the vocabulary.

    parent -> child:  ["init", tokenizer_json, eos_id, vocab_size]  then  ["check", kind, source] ...
    child -> parent:  ["ready"] | ["failed", why]          then  ["ok"] | ["refused", why] ...

A spec compiles when llguidance builds its matcher and computes the first mask without an error. The child
exits when the parent's end of the socket closes; a crash or a hang here is the parent's to report (tests
make it do either at the fault points ``grammar_crash`` and ``grammar_hang``: ``parallel.fault_points``).
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from strata.pipeline.contract.socket_child import child_main
from strata.pipeline.parallel.fault_points import armed

_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode


def compile_once(tokenizer: Any, kind: str, value: str) -> str | None:
    """None if the spec compiles and its first mask is computed; else why not (one line)."""
    from llguidance import LLMatcher

    from strata.pipeline.frontend.structured import grammar_for, parser_limits

    try:
        grammar = grammar_for(kind, value)
    except ValueError as exc:
        return str(exc)
    matcher = LLMatcher(tokenizer, grammar, limits=parser_limits(), log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        return f"the {kind} grammar cannot be followed: {first_line(matcher.get_error())}"
    return None


def first_line(error: str) -> str:
    return (error.strip().splitlines() or ["unknown error"])[0]


def load_tokenizer(text: str, eos: int | None, vocab_size: int) -> Any:
    """The llguidance tokenizer the engine builds (``core.grammar``), warmed with one matcher: the first
    one of a tokenizer costs more than a second."""
    from strata.pipeline.frontend.structured import llg_tokenizer

    tokenizer = llg_tokenizer((text, eos), vocab_size)
    compile_once(tokenizer, "regex", "[a-z]{1,4}")
    return tokenizer


def serve(conn: Connection) -> int:
    _, text, eos, vocab_size = _unpack(conn.recv_bytes())
    try:
        tokenizer = load_tokenizer(text, eos, vocab_size)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which logs it
        conn.send_bytes(_pack(["failed", f"{type(exc).__name__}: {first_line(str(exc))}"]))
        return 1
    conn.send_bytes(_pack(["ready"]))
    while True:
        try:
            _, kind, value = _unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return 0
        if armed("grammar_crash"):
            os.kill(os.getpid(), signal.SIGSEGV)  # what llguidance's compiler does when its stack overflows
        if armed("grammar_hang"):
            time.sleep(3600)
        why = compile_once(tokenizer, kind, value)
        conn.send_bytes(_pack(["ok"] if why is None else ["refused", why]))


if __name__ == "__main__":
    child_main(serve, "grammar-sandbox")
