"""The real `strata serve` for tests, plus what tests check about its sockets."""

from __future__ import annotations

import subprocess
from pathlib import Path

from strata.local_server import LocalServer


def listening_sockets() -> set[tuple[str, str]]:
    """(local address, process) of every listening TCP socket, from `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = set()
    for line in out.splitlines():
        parts = line.split()
        rows.add((parts[3], parts[5] if len(parts) > 5 else ""))
    return rows


class ServeProcess(LocalServer):
    def __init__(self, model_dir: Path, workdir: Path, config: dict) -> None:
        self.sockets_before = listening_sockets()
        super().__init__(model_dir, workdir, config, model_name="strata-test", env={"RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "1000"})

    def shutdown_errors(self) -> list[str]:
        """ERROR lines and tracebacks the server logged after Ctrl-C (a clean stop logs none)."""
        text = self._log_path.read_text()
        _, _, after = text.partition("strata: shutting down")
        return [line for line in after.splitlines() if " ERROR " in line or "Traceback" in line]
