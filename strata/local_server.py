"""Start `strata serve` as a child process on free loopback ports and wait until it answers.

Used by `strata bench serve-overhead` (and the tests): a real server in its own temporary cluster.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    """A free loopback port in 20000-29999: above Ray's worker ports (10002-19999), below Serve's direct
    ports (30000 up) and the kernel's ephemeral range. A port the kernel hands out for bind(0) can be
    handed to one of Ray's own processes before the server binds it (seen: the proxy failed to bind)."""
    for _ in range(500):
        port = random.randint(20000, 29999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that whole range busy: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`strata serve` on free loopback ports with a given serve config; logs go to ``workdir``."""

    def __init__(self, model_dir: Path, workdir: Path, config: dict[str, Any], model_name: str = "strata",
                 env: dict[str, str] | None = None, flags: list[str] | None = None) -> None:
        self.port, self.dashboard_port, self.metrics_port = free_port(), free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "serve.json"
        config_path.write_text(json.dumps(config))
        self._log_path = self.workdir / "serve.log"
        self._log = open(self._log_path, "w")
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                    **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", "--model", str(model_dir), "--config", str(config_path),
             "--port", str(self.port), "--dashboard-port", str(self.dashboard_port),
             "--metrics-port", str(self.metrics_port), "--model-name", model_name, *(flags or [])],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=self.workdir, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 240.0) -> "LocalServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                # Healthy, and the CLI has printed its endpoints (they come after deployment).
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200 and "Ctrl-C stops" in self.tail(200):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"strata serve not ready after {timeout}s:\n{self.tail()}")

    @property
    def direct_url(self) -> str | None:
        """A replica's own HTTP address, when `strata serve` printed one (Serve's direct ingress)."""
        self._log.flush()
        for line in self._log_path.read_text().splitlines():
            if line.strip().startswith("Direct endpoint:"):
                return line.split("Direct endpoint:", 1)[1].split()[0].removesuffix("/v1")
        return None

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self._log_path.read_text().splitlines()[-n:])

    def begin_stop(self) -> None:
        """Ctrl-C (a clean shutdown of Serve and Ray), without waiting for it: stop several at once."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout: float = 90.0) -> None:
        """Ctrl-C, then wait; killed if it does not finish in time."""
        self.begin_stop()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()
