"""The CPU kernels' build cache: keyed on every build input, built once by concurrent first starts,
buildable at install time (`strata build-kernels`); and a server readiness timeout that says why."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import run_python, run_strata
from strata.kernels import cpu_kernels as ck


def _copy_sources(where: Path) -> tuple[Path, ...]:
    where.mkdir(parents=True)
    return tuple(Path(shutil.copy(src, where / src.name)) for src in ck.SOURCES)


def test_build_name_is_short_and_stable() -> None:
    assert re.fullmatch(r"strata_cpu_kernels_[0-9a-f]{16}", ck.build_name())
    assert ck.build_name() == ck.build_name()


def test_build_name_changes_with_the_source_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same bytes at another path (a second checkout): torch's build.ninja records absolute paths, so
    sharing a directory would rebuild on every switch between checkouts."""
    original = ck.build_name()
    monkeypatch.setattr(ck, "SOURCES", _copy_sources(tmp_path / "a" / "csrc"))
    in_a = ck.build_name()
    monkeypatch.setattr(ck, "SOURCES", _copy_sources(tmp_path / "b" / "csrc"))
    in_b = ck.build_name()
    assert len({original, in_a, in_b}) == 3


def test_build_name_resolves_symlinks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = _copy_sources(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setattr(ck, "SOURCES", sources)
    real = ck.build_name()
    monkeypatch.setattr(ck, "SOURCES", tuple(tmp_path / "link" / s.name for s in sources))
    assert ck.build_name() == real


def test_build_name_changes_with_the_source_contents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = _copy_sources(tmp_path / "csrc")
    monkeypatch.setattr(ck, "SOURCES", sources)
    before = ck.build_name()
    sources[0].write_bytes(sources[0].read_bytes() + b"\n// edited\n")
    assert ck.build_name() != before


def test_build_name_changes_with_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    before = ck.build_name()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert ck.build_name() != before


def test_build_kernels_without_a_toolchain_says_so_and_exits_0(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    r = run_strata("build-kernels", env={"CXX": "/nonexistent/c++", "STRATA_KERNEL_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and "the torch reference backend will be used" in lines[0], r.stdout
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (lock,) = cache.glob("*.lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def _toolchain_missing() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which(os.environ.get("CXX", "c++").split()[0]) is None:
        return "no C++ compiler"
    if not is_ninja_available():
        return "no ninja"
    return None


# Each child imports strata, then waits for the other at a file barrier, so both call cpu_kernels()
# within milliseconds of each other on an empty cache. They build a one-function library through the
# same builder, lock and cache (the real sources take minutes here; the protocol is the same).
_CHILD = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from strata.kernels import cpu_kernels as ck
    barrier, me = Path(sys.argv[1]), sys.argv[2]
    ck.SOURCES = (Path(sys.argv[3]),)
    (barrier / me).touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    mod = ck.cpu_kernels()
    print(json.dumps({"loaded": mod is not None, "reason": ck.unavailable_reason(),
                      "compiled": ck.compiled_here(), "file": getattr(mod, "__file__", None),
                      "answer": mod.answer() if mod is not None else None}))
""")

_TINY_SOURCE = """
#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", []() { return 42; }); }
"""


@pytest.mark.slow
def test_concurrent_first_starts_compile_once(tmp_path: Path) -> None:
    """Two processes on an empty cache: one compiles, the other waits on the lock and loads its
    result. Without the lock both would see no library and both would log 'compiling'."""
    if reason := _toolchain_missing():
        pytest.skip(reason)
    cache, barrier, source = tmp_path / "cache", tmp_path / "barrier", tmp_path / "csrc" / "tiny.cpp"
    barrier.mkdir()
    source.parent.mkdir()
    source.write_text(_TINY_SOURCE)
    env = {"STRATA_KERNEL_CACHE": str(cache)}

    def child(me: str):
        return run_python("-c", _CHILD, str(barrier), me, str(source), env=env, timeout=240)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(child, ("a", "b")))
    for r in runs:
        assert r.returncode == 0, r.stderr
    results = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
    assert all(res["loaded"] and res["answer"] == 42 for res in results), results
    assert results[0]["file"] == results[1]["file"]
    said_compiling = [r for r in runs if "compiling Strata's CPU attention kernels" in r.stderr]
    assert len(said_compiling) == 1, [r.stderr for r in runs]
    assert sorted(res["compiled"] for res in results) == [False, True]
    waiter = next(r for r in runs if r not in said_compiling)
    assert "waiting for another process" in waiter.stderr, waiter.stderr  # they did overlap

    # A later process finds the library instead of building again.
    later = child("c")
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout.splitlines()[-1]) == {**results[0], "compiled": False}
    assert "compiling" not in later.stderr and "waiting" not in later.stderr


@pytest.mark.slow
def test_build_kernels_builds_or_finds_them_in_the_default_cache() -> None:
    """`strata build-kernels` as `make install` runs it: compiles at most once; a second run finds it."""
    if reason := _toolchain_missing():
        pytest.skip(reason)
    first = run_strata("build-kernels", timeout=600)
    assert first.returncode == 0, first.stderr
    (line,) = first.stdout.splitlines()
    m = re.fullmatch(r"strata: CPU kernels (built now|found cached): (\S+\.so)", line)
    assert m, line
    assert Path(m.group(2)).is_file()
    second = run_strata("build-kernels")
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == [f"strata: CPU kernels found cached: {m.group(2)}"]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"status": "starting", "waiting_for": ["prefill", "decode"]}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _unstarted_server(tmp_path: Path, port: int):
    """A ServeProcess around a stand-in child (no Ray): only wait_ready's bookkeeping is real."""
    from serve_process import ServeProcess

    server = ServeProcess.__new__(ServeProcess)
    server.port, server.base_url = port, f"http://127.0.0.1:{port}"
    server._log_path = tmp_path / "serve.log"
    server._log = open(server._log_path, "w")
    server._log.write("booting\n")
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return server


def _discard(server) -> None:
    server.proc.kill()
    server.proc.wait()
    server._log.close()


def test_readiness_timeout_says_what_the_server_waits_for(tmp_path: Path) -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = _unstarted_server(tmp_path, httpd.server_address[1])
    try:
        with pytest.raises(TimeoutError, match=r"still waiting for prefill, decode\n(.|\n)*booting"):
            server.wait_ready(timeout=1.5)
    finally:
        _discard(server)
        httpd.shutdown()


def test_readiness_timeout_says_the_port_never_opened(tmp_path: Path) -> None:
    from strata.local_server import free_port

    server = _unstarted_server(tmp_path, free_port())
    try:
        with pytest.raises(TimeoutError, match=r"HTTP port \d+ never answered"):
            server.wait_ready(timeout=1.5)
    finally:
        _discard(server)
