"""Start `strata serve` for real (a Ray cluster on loopback, the HTTP proxy) in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_sockets() -> set[tuple[str, str]]:
    """(local address, process) of every listening TCP socket, from `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = set()
    for line in out.splitlines():
        parts = line.split()
        rows.add((parts[3], parts[5] if len(parts) > 5 else ""))
    return rows


class ServeProcess:
    def __init__(self, model_dir: Path, workdir: Path, config: dict) -> None:
        self.port, self.dashboard_port, self.metrics_port = free_port(), free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        config_path = workdir / "serve.json"
        config_path.write_text(json.dumps(config))
        self.log = open(workdir / "serve.log", "w")
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
               "RAY_USAGE_STATS_ENABLED": "0"}
        self.sockets_before = listening_sockets()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", "--model", str(model_dir), "--config", str(config_path),
             "--port", str(self.port), "--dashboard-port", str(self.dashboard_port),
             "--metrics-port", str(self.metrics_port), "--model-name", "strata-test"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )
        self.workdir = workdir

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"strata serve not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "\n".join((self.workdir / "serve.log").read_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
