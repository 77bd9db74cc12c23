"""A chat template's render, bounded: time, output and recursion, each failure a per-request 400.

The template comes with the checkpoint (or ``--chat-template``) and runs in the front door's process,
where a recursive macro, a loop over ``range(10**5)`` nested in another, or a string built up to hundreds
of megabytes would cost every user the time and memory it takes. Jinja compiles a template to Python
functions whose code lives in the file ``<template>``, so a trace function on the rendering thread sees
every line they run and every piece of text they yield: :func:`render_bounded` stops the render once it
runs past its deadline or yields more than its character budget, and turns Python's own ``RecursionError``
and ``MemoryError`` into the same kind of refusal. Code outside the template (transformers' preparation of
the messages, jinja's runtime) is not traced line by line, so a typical render costs ~10% more.
"""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any, Callable, TypeVar

T = TypeVar("T")
TEMPLATE_FILE = "<template>"  # jinja's name for the code of a compiled template


class TemplateBoundError(ValueError):
    """A chat template's render went past a bound (an HTTP 400; the message names the bound). ``bound``:
    time, output, recursion or memory."""

    def __init__(self, message: str, bound: str) -> None:
        super().__init__(message)
        self.bound = bound


class _Stop(Exception):
    """Raised inside the template's frames by the tracer; never escapes :func:`render_bounded`."""


def render_bounded(render: Callable[[], T], timeout_s: float, max_chars: int) -> T:
    """``render()`` under a trace that stops it past ``timeout_s`` seconds or ``max_chars`` characters of
    output, or when it recurses or runs out of memory: TemplateBoundError saying which."""
    deadline = time.monotonic() + timeout_s
    written = 0
    reason: list[tuple[str, str]] = []  # (what it did, which bound)

    def stop(why: str, bound: str) -> None:
        reason.append((why, bound))
        raise _Stop(why)

    def in_template(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal written
        if event == "line":
            if time.monotonic() > deadline:
                stop(f"took longer than {timeout_s:g} s", "time")
        elif event == "return" and isinstance(arg, str):  # a generator's yield: a piece of the output
            written += len(arg)
            if written > max_chars:
                stop(f"wrote more than {max_chars} characters", "output")
        return in_template

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename == TEMPLATE_FILE:
            if time.monotonic() > deadline:
                stop(f"took longer than {timeout_s:g} s", "time")
            return in_template
        return None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        return render()
    except RecursionError:
        raise TemplateBoundError("the chat template recursed too deeply rendering these messages", "recursion") from None
    except MemoryError:
        raise TemplateBoundError("the chat template ran out of memory rendering these messages", "memory") from None
    except Exception as exc:
        if reason:  # our stop, perhaps wrapped by the code in between: the bound is what matters
            why, bound = reason[0]
            raise TemplateBoundError(f"the chat template {why} rendering these messages", bound) from None
        raise exc
    finally:
        sys.settrace(previous)
