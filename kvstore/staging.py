"""The staging buffer through which spilled KV blocks reach attention, one layer at a time.

On CPU it is one buffer: blocks are read from the tier files straight into it. On CUDA there are
two, each a pinned host buffer plus a device buffer, used alternately: while attention runs on
one segment, the next segment's blocks are read from the files into the other pinned buffer and
copied to the device on a side stream, so file reads and transfers overlap compute. Events keep
the order safe: the compute stream waits for a segment's copy before reading it; a side-stream
copy starts only after the compute work queued so far (the attention that read the buffer last);
pinned rows are rewritten only after the copy that last read them is done.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

Fill = Callable[[torch.Tensor], None]  # fills the given rows of a staging buffer for one segment


class StagingBuffers:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        count = 2 if self.cuda else 1
        self.host = [torch.empty(shape, dtype=dtype, pin_memory=self.cuda) for _ in range(count)]
        self.dev = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)] if self.cuda else self.host
        self._keys: list[Hashable | None] = [None] * count
        self._next = 0
        if self.cuda:
            self._side = torch.cuda.Stream(device=device)
            self._copied = [torch.cuda.Event() for _ in range(count)]  # the last copy into each buffer

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dev)

    def get(self, key: Hashable, rows: int, read: Fill, patch: Fill) -> torch.Tensor:
        """The device rows for segment ``key``: as :meth:`prefetch` staged them (every row read from
        the tier files), or now: ``read`` fills the host rows, which are copied to the device, then
        ``patch`` overwrites device rows it can take from the device itself (blocks still cached
        there), on the compute stream, at the moment of use."""
        if key in self._keys:
            i = self._keys.index(key)
            self._keys[i] = None
            torch.cuda.current_stream(self.device).wait_event(self._copied[i])
            return self.dev[i][:rows]
        i = self._claim()
        if self.cuda:
            self._copied[i].synchronize()  # pinned rows free to rewrite
            torch.cuda.current_stream(self.device).wait_event(self._copied[i])  # device rows free to rewrite
        read(self.host[i][:rows])
        if self.cuda:
            self.dev[i][:rows].copy_(self.host[i][:rows], non_blocking=True)
            self._copied[i].record(torch.cuda.current_stream(self.device))
        patch(self.dev[i][:rows])
        return self.dev[i][:rows]

    def prefetch(self, key: Hashable, rows: int, read_all: Fill) -> None:
        """Stage segment ``key`` ahead of its :meth:`get` (CUDA only: there is nothing to overlap on CPU).
        ``read_all`` fills every host row from the tier files (a block cached on the device now may
        be evicted before the segment is used)."""
        if not self.cuda or key in self._keys:
            return
        i = self._claim()
        self._copied[i].synchronize()  # the pinned rows may still be in flight from their last copy
        read_all(self.host[i][:rows])
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))  # includes the last reader of this buffer
        with torch.cuda.stream(self._side):
            self._side.wait_event(queued)
            self.dev[i][:rows].copy_(self.host[i][:rows], non_blocking=True)
            self._copied[i].record(self._side)
        self._keys[i] = key

    def _claim(self) -> int:
        i = self._next
        self._next = (self._next + 1) % len(self.host)
        self._keys[i] = None
        return i
