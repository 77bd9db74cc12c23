"""The real `strata serve` for tests, plus what tests check about its sockets."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from strata.local_server import LocalServer


def listening_sockets() -> set[tuple[str, str]]:
    """(local address, process) of every listening TCP socket, from `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = set()
    for line in out.splitlines():
        parts = line.split()
        rows.add((parts[3], parts[5] if len(parts) > 5 else ""))
    return rows


STOPPING: list[LocalServer] = []  # servers told to stop at their fixture's teardown; waited for at the session's end


def wait_for_stopping_servers() -> None:
    """Wait until every server told to stop has stopped: a test that times a stream measures on a host that
    is not also shutting a Ray cluster down (two cores here)."""
    while STOPPING:
        STOPPING.pop().stop()


def stop_later(server: LocalServer) -> None:
    """Ctrl-C now, wait at the session's end (conftest): a Ray cluster's shutdown overlaps the next tests
    instead of holding them up."""
    server.begin_stop()
    STOPPING.append(server)


class ServeProcess(LocalServer):
    def __init__(self, model_dir: Path, workdir: Path, config: dict, env: dict[str, str] | None = None) -> None:
        # Compile (or find) the CPU kernels here, before the server starts: its replicas then load the
        # cached library, and a minutes-long compile under load never runs inside wait_ready's timeout.
        from strata.kernels.cpu_kernels import cpu_kernels

        cpu_kernels()
        self.sockets_before = listening_sockets()
        super().__init__(model_dir, workdir, config, model_name="strata-test", env={"RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "1000", **(env or {})})

    def wait_ready(self, timeout: float = 360.0) -> "ServeProcess":
        """LocalServer's wait, with a timeout that says what the server was still waiting for."""
        try:
            super().wait_ready(timeout)
        except TimeoutError:
            raise TimeoutError(f"strata serve not ready after {timeout}s: {self.waiting_for()}\n{self.tail()}") from None
        return self

    def waiting_for(self) -> str:
        """What /health says the server waits for now, or that its port does not answer."""
        try:
            r = httpx.get(self.base_url + "/health", timeout=5)
        except httpx.HTTPError as exc:
            return f"its HTTP port {self.port} never answered ({type(exc).__name__})"
        try:
            body = r.json()
        except ValueError:
            body = r.text[:200]
        if isinstance(body, dict) and body.get("waiting_for"):
            return f"/health {r.status_code}, still waiting for {', '.join(map(str, body['waiting_for']))}"
        if r.status_code == 200:
            return "/health is 200 but the CLI never printed its endpoints (\"Ctrl-C stops\")"
        return f"/health {r.status_code}: {body}"

    def live_direct_url(self, deployment: str = "LLM") -> str:
        """The direct port of the ``deployment`` replica running now. The banner's ``Direct endpoint`` names
        the port of the replica that ran at start; a replica Serve replaced (an earlier test kills one)
        listens on another, so a test that must reach the replica asks the running one."""
        import psutil

        apps = httpx.get(self.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
        pids = [r["pid"] for r in apps["strata"]["deployments"][deployment]["replicas"] if r["state"] == "RUNNING"]
        for pid in pids:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.status != psutil.CONN_LISTEN or conn.laddr.port == self.port:
                    continue
                url = f"http://127.0.0.1:{conn.laddr.port}"
                try:  # its gRPC port refuses HTTP/1.1; the HTTP one answers /health
                    if httpx.get(url + "/health", timeout=5).status_code in (200, 503):
                        return url
                except httpx.HTTPError:
                    continue
        raise AssertionError(f"no running {deployment} replica serves HTTP on a port of its own")

    def shutdown_errors(self) -> list[str]:
        """What the server printed after Ctrl-C besides its own ``strata:`` lines: a clean stop prints nothing
        else (no ERROR line, traceback, or Ray's "graceful_shutdown failed ... retries" warning)."""
        text = self._log_path.read_text()
        _, _, after = text.partition("strata: shutting down")
        return [line for line in after.splitlines() if line.strip() and not line.startswith("strata:")]
