"""The shared-memory collectives of a single-node CPU tensor-parallel group: exact results, the same
bits on every rank, a fallback for what does not fit, and a dead peer reported at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from strata.pipeline.parallel.shm_channel import PeerDiedError, ShmChannel

SLOT = 64 * 1024


def _pair(tmp_path: Path, size: int = 2) -> list[ShmChannel]:
    path = str(tmp_path / "channel")
    first = ShmChannel.create(path, size, SLOT)
    return [first] + [ShmChannel(path, r, size, SLOT) for r in range(1, size)]


def _together(channels: list[ShmChannel], op: Callable[[int, ShmChannel], Any]) -> list[Any]:
    """Run ``op`` on every rank at once (one thread each), as the ranks' processes would."""
    out: list[Any] = [None] * len(channels)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = op(r, channels[r])
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_all_reduce_gather_and_broadcast_are_exact_on_every_rank(tmp_path: Path) -> None:
    channels = _pair(tmp_path, size=3)
    parts = [torch.randn(7, 33, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for _ in range(5):  # several rounds: the two buffers alternate
        sums = _together(channels, lambda r, c: (c.all_reduce(t := parts[r].clone(), 10), t)[1])
        expected = parts[0] + parts[1] + parts[2]
        for s in sums:
            assert torch.equal(s, sums[0]) and torch.allclose(s, expected, rtol=0, atol=1e-6)
    gathered = _together(channels, lambda r, c: c.gather(parts[r], 10))
    assert gathered[1] is None and all(torch.equal(a, b) for a, b in zip(gathered[0], parts))
    sent = _together(channels, lambda r, c: (c.broadcast(t := parts[r].clone(), 10), t)[1])
    assert all(torch.equal(t, parts[0]) for t in sent)


def test_objects_travel_and_a_too_big_one_is_refused_on_every_rank(tmp_path: Path) -> None:
    channels = _pair(tmp_path)
    command = ("step", {"token_ids": list(range(100))})
    assert _together(channels, lambda r, c: c.broadcast_object(command if r == 0 else None, 10)) == [(True, command)] * 2
    huge = b"x" * (2 * SLOT)
    assert _together(channels, lambda r, c: c.broadcast_object(huge if r == 0 else None, 10)) == [(False, None)] * 2
    assert not channels[0].fits(SLOT + 1)


def test_a_dead_peer_is_an_error_within_a_second(tmp_path: Path) -> None:
    path = str(tmp_path / "channel")
    driver = ShmChannel.create(path, 2, SLOT)
    code = ("import sys, time; from strata.pipeline.parallel.shm_channel import ShmChannel; "
            "c = ShmChannel(sys.argv[1], 1, 2, 4096 * 16); print('in', flush=True); time.sleep(120)")
    peer = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    assert peer.stdout is not None and peer.stdout.readline().strip() == "in"
    peer.kill()
    peer.wait()
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError, match="rank 1 exited"):
        driver.all_reduce(torch.ones(4), timeout_s=60)
    assert time.monotonic() - t0 < 1.0


def test_a_peer_that_never_arrives_times_out(tmp_path: Path) -> None:
    driver, _idle = _pair(tmp_path)  # rank 1 is alive (this process) but never joins the operation
    with pytest.raises(TimeoutError):
        driver.all_reduce(torch.ones(4), timeout_s=0.3)


def test_the_file_is_private(tmp_path: Path) -> None:
    _pair(tmp_path)
    assert (tmp_path / "channel").stat().st_mode & 0o777 == 0o600


def _outcomes(channels: list[ShmChannel], op: Callable[[int, ShmChannel], Any]) -> list[Any]:
    """Like ``_together``, but each rank's exception is its result (failure paths are the point)."""
    out: list[Any] = [None] * len(channels)

    def run(r: int) -> None:
        try:
            out[r] = op(r, channels[r])
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_ranks_running_different_operations_fail_instead_of_mixing_bytes(tmp_path: Path) -> None:
    """The defect: the driver re-sent a command while a worker sat in an all-reduce of the failed step;
    pairing by sequence number alone summed the command's pickle into the worker's tensor
    ([1, 1, 1, 1, 1, 7.2e22, 1, 7.6e28]). Now both ranks see the mismatch and raise."""
    from strata.pipeline.parallel.shm_channel import ChannelDesyncError

    channels = _pair(tmp_path)
    out = _outcomes(channels, lambda r, c: c.broadcast_object(("step", [1, 2]), 10) if r == 0
                    else c.all_reduce(torch.ones(8), 10))
    assert all(isinstance(o, ChannelDesyncError) for o in out), out
    assert "rank 1 ran all-reduce where rank 0 ran object" in str(out[0])


@pytest.mark.parametrize("poisoner, poison", [(0, "ABORT"), (1, "FAILED")])
def test_a_poisoned_step_is_abandoned_by_every_rank_and_the_group_stays_in_step(
        tmp_path: Path, poisoner: int, poison: str) -> None:
    """One rank gives the step up (the driver aborts, or a worker's forward failed) while the others sit in
    the step's next collective: they raise StepAborted there, and the next operation is exact again."""
    from strata.pipeline.parallel import shm_channel
    from strata.pipeline.parallel.shm_channel import StepAborted

    channels = _pair(tmp_path, size=3)
    kind = getattr(shm_channel, poison)

    def step(r: int, c: ShmChannel):
        c.all_reduce(torch.ones(4), 10)  # the step's first collective: everyone got here
        if r == poisoner:
            return c.poison(kind, 10)
        return c.all_reduce(torch.ones(4), 10)  # never completes: the step is abandoned

    out = _outcomes(channels, step)
    assert out[poisoner] is None
    assert all(isinstance(o, StepAborted) for r, o in enumerate(out) if r != poisoner), out
    parts = [torch.full((4,), float(r + 1)) for r in range(3)]
    after = _together(channels, lambda r, c: (c.all_reduce(t := parts[r].clone(), 10), t)[1])
    assert all(torch.equal(t, torch.full((4,), 6.0)) for t in after)


def test_an_idle_rank_meets_an_abort_at_its_next_command_wait(tmp_path: Path) -> None:
    """A worker that had finished the step and waits for the next command sees the driver's abort there,
    and then takes the next command normally."""
    from strata.pipeline.parallel.shm_channel import ABORT, StepAborted

    channels = _pair(tmp_path)

    def run(r: int, c: ShmChannel):
        if r == 0:
            c.poison(ABORT, 10)
            return c.broadcast_object(("step", 7), 10)
        try:
            c.broadcast_object(None, None)
        except StepAborted:
            return c.broadcast_object(None, None)
        raise AssertionError("the abort was not seen")

    assert _together(channels, run) == [(True, ("step", 7))] * 2


def test_a_peer_that_marks_itself_gone_fails_the_wait_at_once_while_its_process_lives(tmp_path: Path) -> None:
    """A worker whose loop raised leaves its process alive (a Ray actor does): its gone mark, not its pid,
    tells the driver, within a fraction of a second instead of the 60 s collective timeout."""
    path = str(tmp_path / "channel")
    driver = ShmChannel.create(path, 2, SLOT)
    code = ("import sys, time; from strata.pipeline.parallel.shm_channel import ShmChannel; "
            "c = ShmChannel(sys.argv[1], 1, 2, 4096 * 16); c.mark_gone(); print('gone', flush=True); time.sleep(120)")
    peer = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "gone"
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError, match="rank 1 stopped"):
            driver.all_reduce(torch.ones(4), timeout_s=60)
        assert time.monotonic() - t0 < 1.0
        assert peer.poll() is None, "the peer's process is still alive: only its mark told"
    finally:
        peer.kill()
        peer.wait()
