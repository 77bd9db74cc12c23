"""No head-of-line stall, against the session's real Qwen2.5-VL server (aggregated: an LLM replica with its
engine process, Preprocess and Encode replicas), in two ways.

Real work: while a plain stream decodes, a 32K-token text prompt, a cold ``json_schema`` request (the server's
first grammar) and a 4-image request arrive together. The stream's largest inter-token gap over the whole
time they take stays within ``PACE_FACTOR`` times its pace while the long prompt is in the engine. The
long prompt is prefilled in chunks that share the stream's steps (the point of chunked prefill), so those
steps are the stream's pace while it runs; a prompt prefilled whole would be a gap of seconds. A chunk's
step grows with the context it attends to (here from ~20 ms at the first chunk to ~140 ms at 30K), so the
pace is the 90th percentile of those gaps, the steps near full context: a median sits mid-prefill, and
chunks delivered in one read (zero gaps) pull it lower still (CI once saw a 27 ms median beside a 183 ms
last step). The window is the engine hop of the long request's trace (``/strata/stats`` flows), which ends
when its one token comes back. Measured here: the worst gap is 1.1-1.9x that pace, the largest in the first
~0.2 s, where decoding the images, encoding them and tokenizing the long prompt run in other processes on
the two cores the step's two threads need (one preempted thread holds its partner at every barrier).
Servers other modules stopped in the background are waited for first (CI once saw a 759 ms gap mid-prefill
against a 114 ms pace, cause unknown); a failure lists the engine's steps around the gap, wall and CPU time,
so it says whether the engine computed long, waited for a core, or the delivery held the stream.

Slow work, made slow on purpose (stall points, ``pipeline/parallel/fault_points.py``: the work sleeps, so
it costs no core and the test is not about CPU contention): tokenizing a prompt, checking a grammar at the
front door, compiling it in the engine (its request waits in its own state, as vLLM's waiting-for-FSM),
preprocessing an image and encoding it each take 3 s more, and a stream beside them never waits 1 s. Any
of them on the step loop would hold it for the whole 3 s; the margin below that is for the real work beside
the stalls (decoding and encoding the image, compiling the grammar) on a busy 2-core host, where a 0.8 s gap
was seen once against a 0.5 s bound beside 1.5 s stalls."""

from __future__ import annotations

import base64
import io
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np
import pytest
from PIL import Image

from helpers import MODEL_NAME
from serve_process import wait_for_stopping_servers

pytestmark = pytest.mark.serve
LONG_PROMPT_TOKENS = 32_000
PACE_FACTOR = 3  # the bound; measured here: 1.1-1.9 (see the module)
STALL_S = 3.0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
          "required": ["name"], "additionalProperties": False}


class PlainStream(threading.Thread):
    """A plain streamed chat completion in the background, recording when each chunk arrived, until ``stop``."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.arrivals: list[float] = []
        self.stop = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 30_000, "ignore_eos": True, "temperature": 0, "stream": True,
                "logprobs": True}  # a chunk for every token, also one whose text the detokenizer holds back
        with httpx.stream("POST", self.server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.errors.append(event["error"]["message"])
                    else:
                        self.arrivals.append(time.monotonic())

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive chunks that both arrived within [start, end]."""
        times = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in zip(times, times[1:])]

    def gap_start(self, gap: float) -> float:
        """When the chunk before a gap of exactly ``gap`` seconds arrived."""
        return next(a for a, b in zip(self.arrivals, self.arrivals[1:]) if b - a == gap)


def _long_text(model_dir, tokens: int) -> str:
    """Words of the model's own vocabulary, as many as make ``tokens`` tokens (checked with its tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    words = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 2]
    text = " ".join(rng.choice(words) for _ in range(tokens))
    ids = tok(text, add_special_tokens=False)["input_ids"][:tokens]
    return tok.decode(ids)


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (320, 320, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _body(content, **extra) -> bytes:
    return json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
                       **extra}).encode()


@dataclass
class Burst:
    """Requests sent together beside a running plain stream: each reply and when it came back, the stream,
    and when the requests went out and the last came back (``time.monotonic``)."""

    replies: list[httpx.Response]
    returned: list[float]
    stream: PlainStream
    arrived: float
    done: float


def _burst(server, bodies: list[bytes], arm: Callable[[], None] = lambda: None) -> Burst:
    """Start a plain stream, ``arm``, then post ``bodies`` together (the first 50 ms ahead of the others).
    Everything the client does besides reading the stream happens before it starts (bodies encoded,
    connections open): this process's own work would otherwise show as gaps in its reading."""
    clients = [httpx.Client(base_url=server.base_url, timeout=300) for _ in bodies]
    for client in clients:
        assert client.get("/health").status_code == 200

    def post(i: int) -> tuple[httpx.Response, float]:
        if i:
            time.sleep(0.05)
        reply = clients[i].post("/v1/chat/completions", content=bodies[i], headers={"content-type": "application/json"})
        return reply, time.monotonic()

    wait_for_stopping_servers()
    stream = PlainStream(server)
    stream.start()
    deadline = time.monotonic() + 60
    while len(stream.arrivals) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(stream.arrivals) >= 20, "the plain stream never started"
    arm()
    with ThreadPoolExecutor(len(bodies)) as pool:
        arrived = time.monotonic()
        results = [f.result() for f in [pool.submit(post, i) for i in range(len(bodies))]]
    done = time.monotonic()
    time.sleep(0.2)
    stream.stop.set()
    stream.join(60)
    for client in clients:
        client.close()
    for reply, _ in results:
        assert reply.status_code == 200, reply.text[:300]
    assert not stream.errors
    return Burst([r for r, _ in results], [t for _, t in results], stream, arrived, done)


def test_a_stream_keeps_its_pace_while_a_long_prompt_a_cold_grammar_and_images_arrive(qwen_vl_server) -> None:
    server = qwen_vl_server
    stats = httpx.get(server.base_url + "/strata/stats", timeout=30).json()
    assert stats["ingress"]["grammars"]["compiled"] == 0, "the grammar must be the server's first"
    images = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(i)).decode()}}
              for i in range(4)]
    burst = _burst(server, [_body(_long_text(server.model, LONG_PROMPT_TOKENS), max_tokens=1),
                            _body("A name in JSON.", max_tokens=16, response_format={
                                "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
                            _body([*images, {"type": "text", "text": "Describe them."}], max_tokens=4)])
    long_reply, long_done = burst.replies[0].json(), burst.returned[0]
    assert long_reply["usage"]["prompt_tokens"] >= LONG_PROMPT_TOKENS
    assert burst.replies[1].json()["choices"][0]["finish_reason"] in ("stop", "length")  # under its grammar
    flows = httpx.get(server.base_url + "/strata/stats", timeout=30).json()["ingress"]["flows"]
    (engine_hop,) = [h for f in flows if f["request_id"] == long_reply["id"] for h in f["hops"] if h["name"] == "engine"]
    window = (long_done - engine_hop["seconds"], long_done)
    prefilling = burst.stream.gaps(*window)
    assert len(prefilling) >= 20, f"only {len(prefilling)} tokens of the stream while the long prompt prefilled"
    pace = statistics.quantiles(prefilling, n=10)[-1]  # the 90th percentile: steps near full context
    everything = burst.stream.gaps(burst.arrived, burst.done)
    worst = max(everything)
    at = burst.stream.gap_start(worst) - burst.arrived
    assert worst <= PACE_FACTOR * pace, (
        f"a {worst * 1e3:.0f} ms gap {at:.2f} s after the requests arrived, against a {pace * 1e3:.1f} ms pace "
        f"while the long prompt prefilled ({window[0] - burst.arrived:.2f}-{window[1] - burst.arrived:.2f} s; "
        f"{len(everything)} gaps in {burst.done - burst.arrived:.1f} s); "
        f"{_steps_during(server, burst.arrived + at, worst, burst.arrived)}")


def _steps_during(server, start: float, seconds: float, origin: float) -> str:
    """The engine's steps that overlap [start, start + seconds] (the host's monotonic clock), as a failure
    message reads them: fast steps around a gap are the delivery's; a slow step with as much CPU time (two
    threads) computed long, one with little waited for a core."""
    steps = httpx.get(server.base_url + "/strata/stats", timeout=30).json()["prefill"].get("recent_steps", [])
    during = [(t - origin, s, c, n) for t, s, c, n in steps if t < start + seconds and t + s > start - 0.05]
    return "the engine's steps then (s after arrival, ms, CPU ms, tokens): " + (
        ", ".join(f"({t:.2f}, {s * 1e3:.0f}, {c * 1e3:.0f}, {n})" for t, s, c, n in during) or "none")


def test_work_that_is_slow_never_holds_a_running_stream(qwen_vl_server) -> None:
    server = qwen_vl_server
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["id"], "additionalProperties": False}  # not the other test's: compiled here
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(7)).decode()}}]

    def arm() -> None:
        for name in ("tokenize", "grammar", "grammar_compile", "preprocess", "encode"):
            (server.faults / f"{name}.stall").write_text(str(STALL_S))

    burst = _burst(server, [_body("Say something short.", max_tokens=4),
                            _body("An id in JSON.", max_tokens=16, response_format={
                                "type": "json_schema", "json_schema": {"name": "i", "schema": schema}}),
                            _body([*image, {"type": "text", "text": "Describe it."}], max_tokens=4)], arm)
    assert not [p.name for p in server.faults.iterdir()], "every stall point was passed"
    assert burst.done - burst.arrived >= STALL_S
    gaps = burst.stream.gaps(burst.arrived, burst.done)
    worst = max(gaps)
    assert len(gaps) > 20 and worst < STALL_S / 3, (
        f"a {worst:.2f} s gap {burst.stream.gap_start(worst) - burst.arrived:.2f} s after the requests arrived, "
        f"beside {STALL_S} s stalls")
