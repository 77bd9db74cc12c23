"""A per-replica budget of decoded image pixels in flight.

Decoding an image costs memory in proportion to its pixels (Pillow's buffer, an RGB copy, a tensor
copy), and a Preprocess replica decodes on several threads at once: eight images at the pixel cap
from three concurrent requests took one replica from 1.0 to 1.9 GiB RSS. Each image reserves its
pixel count (read from its header, before anything is decoded) and gives it back once its pixel
values are made, so the decoded pixels a replica holds at once never exceed the budget.

Waiters are served in arrival order (a large image is not starved by a stream of small ones) and
never wait past their deadline: then :class:`PixelBudgetTimeout`, which the ingress answers with a
429 and ``Retry-After`` (the replica is saturated; the request was fine).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator


class PixelBudgetTimeout(TimeoutError):
    """An image waited its whole allowance for decode budget; the message is fit for the client."""


class PixelBudget:
    """Counts decoded pixels in flight across threads; :meth:`hold` blocks (bounded) until there is room.

    ``timeout_s`` is the default wait of one image, from the moment it asks (a caller that knows its
    own deadline passes that instead)."""

    def __init__(self, capacity: int, timeout_s: float) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"pixel budget capacity must be an integer >= 1, got {capacity!r}")
        if not timeout_s > 0:
            raise ValueError(f"pixel budget timeout_s must be > 0, got {timeout_s!r}")
        self.capacity = capacity
        self.timeout_s = float(timeout_s)
        self._cond = threading.Condition()
        self._in_use = 0
        self._queue: deque[object] = deque()  # one ticket per waiter, in arrival order
        self.peak = 0  # most pixels ever held at once (stats, tests)
        self.timeouts = 0

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._in_use

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    def deadline(self) -> float:
        """The ``time.monotonic()`` instant an image asking now may wait until."""
        return time.monotonic() + self.timeout_s

    def acquire(self, pixels: int, deadline: float | None = None) -> None:
        """Reserve ``pixels`` once every earlier waiter is served and they fit; PixelBudgetTimeout if
        that has not happened by ``deadline`` (monotonic; default: ``timeout_s`` from now). Room that is
        free at once is taken even past the deadline. More pixels than the whole budget is a
        ValueError: no wait could ever satisfy it (the preprocessor's pixel cap refuses such images first)."""
        if pixels < 0:
            raise ValueError(f"pixels must be >= 0, got {pixels}")
        if pixels > self.capacity:
            raise ValueError(f"an image of {pixels} pixels exceeds the whole decode budget of {self.capacity}")
        deadline = self.deadline() if deadline is None else deadline
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._in_use + pixels <= self.capacity):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.timeouts += 1
                        raise PixelBudgetTimeout(
                            f"the server is busy decoding other images (no room for a {pixels}-pixel image "
                            "in time); retry shortly")
                    self._cond.wait(left)
                self._in_use += pixels
                self.peak = max(self.peak, self._in_use)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may fit now (or the head changed)

    def release(self, pixels: int) -> None:
        with self._cond:
            if pixels > self._in_use:
                raise RuntimeError(f"releasing {pixels} pixels, only {self._in_use} are held")
            self._in_use -= pixels
            self._cond.notify_all()

    @contextmanager
    def hold(self, pixels: int, deadline: float | None = None) -> Iterator[None]:
        """Hold ``pixels`` of the budget for the duration of the block (see :meth:`acquire`)."""
        self.acquire(pixels, deadline)
        try:
            yield
        finally:
            self.release(pixels)
