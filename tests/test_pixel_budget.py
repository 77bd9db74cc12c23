"""The per-replica budget of decoded pixels in flight: threads never hold more than it at once, waiters
are served in order, no wait outlasts its deadline, and a Preprocess replica waits off its event loop."""

from __future__ import annotations

import asyncio
import io
import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from strata.pipeline.contract.config import EngineConfig
from strata.stages import preprocessor as preprocessor_module
from strata.stages.pixel_budget import PixelBudget, PixelBudgetTimeout
from strata.stages.preprocessor import ImageError, PreprocessedImage, Preprocessor

pytestmark = pytest.mark.unit

SMALL = {"size": {"shortest_edge": 16}, "crop_size": {"height": 16, "width": 16}}


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _run_threads(n: int, target, *args: Any) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i, *args)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a thread never finished: a waiter was never woken"
    return errors


def test_threads_never_hold_more_than_the_budget() -> None:
    """Counted independently of the budget's own figures: what the holders themselves hold."""
    budget = PixelBudget(1000, timeout_s=30.0)
    lock, held, most = threading.Lock(), [0], [0]

    def worker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(20):
            pixels = rng.randint(1, 1000)
            with budget.hold(pixels):
                with lock:
                    held[0] += pixels
                    most[0] = max(most[0], held[0])
                    assert held[0] <= budget.capacity
                time.sleep(rng.random() * 0.002)
                with lock:
                    held[0] -= pixels

    assert _run_threads(12, worker) == []
    assert held[0] == 0 and budget.in_use == 0 and budget.waiting == 0
    assert most[0] <= budget.capacity and budget.peak <= budget.capacity
    assert most[0] > 1000 // 2  # the threads did overlap: the bound was exercised, not trivially met


def test_a_wait_that_outlasts_its_deadline_is_a_clear_error() -> None:
    budget = PixelBudget(100, timeout_s=0.2)
    budget.acquire(100)
    t0 = time.monotonic()
    with pytest.raises(PixelBudgetTimeout, match="busy decoding other images.*retry"):
        budget.acquire(1)  # its default allowance: timeout_s from now
    assert 0.15 < time.monotonic() - t0 < 5
    with pytest.raises(PixelBudgetTimeout):
        budget.acquire(1, deadline=time.monotonic() + 0.05)  # or a deadline the caller brings
    assert budget.waiting == 0 and budget.in_use == 100 and budget.timeouts == 2
    budget.release(100)
    budget.acquire(1, deadline=time.monotonic() - 1)  # free room is taken even past the deadline
    assert budget.in_use == 1


def test_waiters_are_served_in_arrival_order() -> None:
    """A small image that would fit does not overtake a larger one waiting ahead of it."""
    budget = PixelBudget(100, timeout_s=30.0)
    budget.acquire(60)
    order: list[str] = []

    def waiter(name: str, pixels: int) -> None:
        budget.acquire(pixels)
        order.append(name)

    big = threading.Thread(target=waiter, args=("big", 50))
    big.start()
    while budget.waiting < 1:
        time.sleep(0.001)
    small = threading.Thread(target=waiter, args=("small", 10))
    small.start()
    while budget.waiting < 2:
        time.sleep(0.001)
    time.sleep(0.05)
    assert order == []  # 10 would fit beside the 60 held, but "big" is first in line
    budget.release(60)
    big.join(5)
    small.join(5)
    assert order == ["big", "small"] and budget.in_use == 60


def test_a_waiter_that_gives_up_lets_the_next_one_through() -> None:
    budget = PixelBudget(100, timeout_s=30.0)
    budget.acquire(60)
    got: list[int] = []
    head = threading.Thread(target=lambda: pytest.raises(PixelBudgetTimeout, budget.acquire, 50,
                                                         time.monotonic() + 0.1))
    head.start()
    while budget.waiting < 1:
        time.sleep(0.001)
    behind = threading.Thread(target=lambda: (budget.acquire(30), got.append(30)))
    behind.start()
    head.join(5)
    behind.join(5)
    assert got == [30] and budget.in_use == 90


def test_more_than_the_whole_budget_is_refused_not_waited_for() -> None:
    budget = PixelBudget(100, timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="exceeds the whole decode budget"):
        budget.acquire(101)
    assert time.monotonic() - t0 < 1
    with pytest.raises(ValueError, match="must hold one image at the pixel cap"):
        Preprocessor(SMALL, max_pixels=200, pixel_budget=budget)
    with pytest.raises(ValueError, match="max_image_pixels_in_flight"):
        EngineConfig(max_image_pixels=100, max_image_pixels_in_flight=99).validate()
    with pytest.raises(ValueError, match="image_wait_timeout_s"):
        EngineConfig(image_wait_timeout_s=0).validate()
    assert EngineConfig(max_image_pixels=100).image_pixels_in_flight == 200  # default: two images at the cap


def test_an_image_over_the_pixel_cap_is_refused_before_the_budget() -> None:
    budget = PixelBudget(64 * 64, timeout_s=0.05)
    pre = Preprocessor(SMALL, max_pixels=64 * 64, pixel_budget=budget)
    budget.acquire(64 * 64)  # full: anything that asked for room would time out
    with pytest.raises(ImageError, match="limit"):
        pre.process(_png(65, 64))
    assert budget.timeouts == 0


def test_preprocessing_threads_never_decode_more_pixels_than_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight images at the cap from four threads, budget of two: at most two decode at once, and
    the results are the same as without a budget."""
    side = 64
    images = [_png(side, side, seed) for seed in range(8)]
    budget = PixelBudget(2 * side * side, timeout_s=30.0)
    pre = Preprocessor(SMALL, max_pixels=side * side, pixel_budget=budget)
    lock, decoding, most = threading.Lock(), [0], [0]
    full = threading.Event()  # two images decode at once: proof the threads did overlap
    real_load = preprocessor_module._load

    def counting_load(image: Image.Image) -> Image.Image:
        pixels = image.size[0] * image.size[1]
        with lock:
            decoding[0] += pixels
            most[0] = max(most[0], decoding[0])
            if decoding[0] >= budget.capacity:
                full.set()
        full.wait(5)  # the first image waits for a second one to join it
        time.sleep(0.01)  # time for a third to come in too, were it let in
        try:
            return real_load(image)
        finally:
            with lock:
                decoding[0] -= pixels

    monkeypatch.setattr(preprocessor_module, "_load", counting_load)
    results: dict[int, PreprocessedImage] = {}

    def worker(i: int) -> None:
        for j in range(i, len(images), 4):
            results[j] = pre.process(images[j])

    assert _run_threads(4, worker) == []
    assert most[0] == budget.capacity  # two at once, never three
    assert budget.peak <= budget.capacity and budget.in_use == 0
    plain = Preprocessor(SMALL, max_pixels=side * side)
    for j, data in enumerate(images):
        assert np.array_equal(results[j].pixel_values, plain.process(data).pixel_values)


def test_the_preprocess_replica_waits_off_its_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Images waiting for budget wait on worker threads: the replica's loop keeps answering, and
    one that waits too long ends with PixelBudgetTimeout (the ingress's 429), not an ImageError."""
    from strata.deployments.ray_serve import stage_deployments

    histogram = SimpleNamespace(observe=lambda *a, **k: None)  # no Ray metrics outside a cluster
    monkeypatch.setattr(stage_deployments.metrics, "processing_time", lambda: histogram)
    side = 32
    replica = object.__new__(stage_deployments.Preprocess.func_or_class)
    replica.budget = PixelBudget(side * side, timeout_s=0.5)
    replica.preprocessor = Preprocessor(SMALL, max_pixels=side * side, pixel_budget=replica.budget)
    replica.pending = 0

    async def go() -> tuple[list[Any], float]:
        replica.budget.acquire(side * side)  # another image holds the whole budget
        calls = asyncio.gather(*(replica.process(_png(side, side, i)) for i in range(3)), return_exceptions=True)
        gaps, last = [], time.perf_counter()
        while replica.pending == 0 or replica.budget.waiting < 1:
            await asyncio.sleep(0.005)
        for _ in range(20):  # the loop ticks on time while the images wait
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        results = await calls
        return results, max(gaps[1:])

    results, worst_gap = asyncio.run(go())
    assert worst_gap < 0.2
    assert results and all(isinstance(r, PixelBudgetTimeout) for r in results), results
    assert replica.pending == 0


def test_a_budget_timeout_reaches_the_client_as_a_429_through_ray() -> None:
    """Ray re-raises a replica's exception as ``RayTaskError(<its class>)`` after a pickle round
    trip; the ingress answers it like a full stage queue: 429 with Retry-After, no internals."""
    import pickle

    from ray.exceptions import RayTaskError

    from strata.deployments.openai.responder import client_error

    cause = pickle.loads(pickle.dumps(PixelBudgetTimeout("the server is busy decoding other images")))
    raised = RayTaskError("Preprocess.process", "Traceback (pid=1234, ip=10.0.0.1)", cause)
    for exc in (raised.as_instanceof_cause(), raised, cause):
        err = client_error(exc, retry_after_s=2.0)
        assert err.status == 429 and err.retry_after_s == 2.0 and err.type == "rate_limit_error"
        assert "1234" not in err.message and "10.0.0.1" not in err.message
