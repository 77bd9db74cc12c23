"""The whole request flow, traced at the front door: for each hop a request makes (preprocess, encode, the
engine; or prefill and decode), the bytes that crossed it each way and how long it took, and the KV its
prompt left in the host tier for decode to adopt. ``/strata/stats`` shows the last requests' traces
(``ingress.flows``) and ``strata bench flow`` reports them side by side: what an image or a long prompt
costs each hop, measured where it is sent."""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

KEPT = 32  # requests whose traces are kept


@dataclass
class Hop:
    name: str
    sent: int = 0  # bytes the front door sent on it
    received: int = 0  # bytes it got back
    seconds: float = 0.0


@dataclass
class FlowTrace:
    request_id: str
    hops: list[Hop] = field(default_factory=list)
    kv_host_tier_bytes: int = 0  # disaggregated: the prompt's full KV blocks prefill wrote for decode

    @contextmanager
    def hop(self, name: str, sent: int = 0) -> Iterator[Hop]:
        """Time one hop; the caller fills in what came back."""
        entry = Hop(name, sent)
        start = time.perf_counter()
        try:
            yield entry
        finally:
            entry.seconds = time.perf_counter() - start
            self.hops.append(entry)


class FlowTraces:
    """The traces of the last :data:`KEPT` requests of one front door."""

    def __init__(self) -> None:
        self._traces: OrderedDict[str, FlowTrace] = OrderedDict()

    def of(self, request_id: str) -> FlowTrace:
        trace = self._traces.get(request_id)
        if trace is None:
            trace = self._traces[request_id] = FlowTrace(request_id)
            while len(self._traces) > KEPT:
                self._traces.popitem(last=False)
        return trace

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(t) for t in self._traces.values()]


def request_bytes(request: Any) -> int:
    """What a Request carries, about: its token ids (4 bytes each) and its images' features."""
    images = sum(img.embeds.nbytes + (img.deepstack.nbytes if img.deepstack is not None else 0) for img in request.images)
    return 4 * len(request.prompt_token_ids) + images
