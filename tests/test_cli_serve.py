"""`strata serve`'s command line: a bad config, flag, port or model is one line before Ray starts, the flags
override the JSON config, the API key reaches replicas only as its digest, and the serving banner says what it
waits for."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import strata_in_process


@pytest.mark.parametrize(
    "config, message",
    [
        ("{oops", "not valid JSON"),
        ('{"stagez": {}}', "unknown config key stagez"),
        ('{"stages": {"prefill": {"max_replicaz": 2}}}', "unknown config key stages.prefill.max_replicaz"),
        ('{"stages": {"warp": {}}}', "stages.warp: Input should be 'preprocess', 'encode'"),
        ('{"stages": {"decode": {"min_replicas": 3, "max_replicas": 2}}}', "min_replicas <= max_replicas"),
        ('{"mode": "disaggregated", "engine": {"host_kv_blocks": 0}}', "host_kv_blocks must be > 0"),
        ('{"mode": "pipelined"}', "mode: Input should be 'aggregated' or 'disaggregated'"),
        ('{"stream_interval_ms": -1}', "stream_interval_ms"),
        ('{"stages": {"encode": {"tp": 2}}}', "only prefill, decode, llm run the decoder"),
        ('{"stages": {"decode": {"tp": 3}}}', "tp=3 does not divide the model's 4 attention heads"),
    ],
    ids=["bad-json", "unknown-key", "unknown-stage-key", "unknown-stage", "bad-bounds", "no-host-tier", "bad-mode",
         "bad-interval", "tp-on-the-encoder", "tp-does-not-split"],
)
def test_serve_refuses_a_bad_config_before_starting_anything(config: str, message: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "serve.json"
    path.write_text(config)
    res = strata_in_process(capsys, "serve", "--config", str(path), "--port", "1")
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype", "float16"], "dtype float16 runs on CUDA only; on CPU use float32 (exact) or bfloat16"),
        (["--max-model-len", "100000"], "max_model_len 100000 exceeds the model's max_position_embeddings (4096"),
        (["--tp", "3"], "tp=3 does not divide the model's 4 attention heads"),
        (["--max-model-len", "0"], "engine.max_model_len"),
        (["--kv-cache-memory", "lots"], "invalid memory budget 'lots'"),
        (["--kv-cache-memory", "16"], "kv_cache_memory 16 holds no KV block"),
        (["--kv-cache-memory", "40%", "--address", "auto"], "joining a cluster (--address), give a size"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                                  '"prompt_lookup_max": 3}'], "prompt_lookup_min (4) must be <= prompt_lookup_max (3)"),
        (["--speculative-config", "[1]"], "--speculative-config: expected a JSON object"),
        (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'], "this llama has none: use ngram"),
    ],
    ids=["float16-on-cpu", "beyond-positions", "tp-does-not-split", "zero-length", "kv-budget-junk",
         "kv-budget-too-small", "kv-share-on-a-cluster", "speculation-bounds", "speculation-not-an-object",
         "mtp-without-its-layer"],
)
def test_serve_flags_are_checked_like_the_config(flags: list[str], message: str, llama_dir: Path, capsys) -> None:
    res = strata_in_process(capsys, "serve", "--model", str(llama_dir), *flags, "--port", "1")
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_long_max_model_len_is_allowed_when_asked_for(llama_dir: Path, monkeypatch) -> None:
    from strata.deployments.ray_serve.serve_flags import check_model_len

    monkeypatch.setenv("STRATA_ALLOW_LONG_MAX_MODEL_LEN", "1")
    check_model_len(100_000, str(llama_dir))  # no error: the operator opted in
    monkeypatch.setenv("STRATA_ALLOW_LONG_MAX_MODEL_LEN", "0")
    with pytest.raises(ValueError, match="set STRATA_ALLOW_LONG_MAX_MODEL_LEN=1 to extrapolate"):
        check_model_len(100_000, str(llama_dir))


def test_serve_flags_override_the_json_config(llama_dir: Path, tmp_path: Path) -> None:
    import argparse

    from strata.deployments.ray_serve.serve_flags import add_arguments, load_config

    path = tmp_path / "serve.json"
    path.write_text('{"engine": {"max_model_len": 1024, "dtype": "bfloat16"}, "model_name": "from-json"}')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--config", str(path), "--max-model-len", "2048",
                              "--tensor-parallel-size", "2", "--served-model-name", "from-flag"])
    config = load_config(args)
    assert config.engine.max_model_len == 2048 and config.engine.tp == 2 and config.engine.dtype == "bfloat16"
    assert config.model_name == "from-flag"
    sized = load_config(parser.parse_args(["--model", str(llama_dir), "--config", str(path), "--kv-cache-memory", "1MiB"]))
    assert sized.engine.kv_cache_memory is None and 0 < sized.engine.num_kv_blocks != 1024  # counted once, here
    plain = load_config(parser.parse_args(["--model", str(llama_dir), "--config", str(path)]))
    assert plain.engine.max_model_len == 1024 and plain.engine.tp == 1 and plain.model_name == "from-json"


def test_chat_template_and_tool_call_parser_flags(llama_dir: Path, tmp_path: Path, capsys) -> None:
    """--chat-template is read into the config (a missing file or a broken template is one line, exit 2);
    --tool-call-parser names the format answers are read in."""
    import argparse

    from strata.deployments.ray_serve.serve_flags import add_arguments, load_config

    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = load_config(parser.parse_args(["--model", str(llama_dir), "--chat-template", str(template),
                                            "--tool-call-parser", "hermes"]))
    assert config.chat_template == template.read_text() and config.tool_call_parser == "hermes"
    assert load_config(parser.parse_args(["--model", str(llama_dir)])).tool_call_parser == "auto"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    for path, message in ((tmp_path / "missing.jinja", "--chat-template: cannot read"),
                          (broken, "is not a Jinja template (line 1")):
        res = strata_in_process(capsys, "serve", "--model", str(llama_dir), "--chat-template", str(path), "--port", "1")
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_the_api_key_reaches_the_replicas_only_as_its_digest(llama_dir: Path, monkeypatch) -> None:
    import argparse
    import hashlib
    import json

    from strata.deployments.openai.api_key import authorized
    from strata.deployments.ray_serve.serve_flags import add_arguments, load_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    assert load_config(parser.parse_args(["--model", str(llama_dir)])).api_key_sha256 is None
    config = load_config(parser.parse_args(["--model", str(llama_dir), "--api-key", "sk-flag"]))
    assert config.api_key_sha256 == hashlib.sha256(b"sk-flag").hexdigest()
    assert "sk-flag" not in json.dumps(config.to_dict())
    monkeypatch.setenv("STRATA_API_KEY", "sk-env")
    digest = load_config(parser.parse_args(["--model", str(llama_dir)])).api_key_sha256
    assert authorized("/v1/models", "Bearer sk-env", digest) and authorized("/v1/models", "bearer  sk-env ", digest)
    assert authorized("/health", None, digest)
    for header in (None, "", "Bearer", "Bearer sk-flag", "sk-env", "Basic sk-env", "Bearer sk-env2"):
        assert not authorized("/v1/models", header, digest), header
    with pytest.raises(ValueError, match="non-empty"):
        load_config(parser.parse_args(["--model", str(llama_dir), "--api-key", " padded "]))


def test_the_raw_key_leaves_the_environment_and_the_command_line_as_it_is_read(llama_dir: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """Ray's processes inherit the CLI's environment and Ray records the driver's command line: once read,
    the key is in neither. ``--api-key-file`` (or ``-``, standard input) keeps it off the command line."""
    import argparse
    import hashlib
    import io
    import os
    import sys

    from strata.deployments.ray_serve.serve_flags import add_arguments, load_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("STRATA_API_KEY", "sk-env-9")
    assert load_config(parser.parse_args(["--model", str(llama_dir)])).api_key_sha256 == hashlib.sha256(b"sk-env-9").hexdigest()
    assert "STRATA_API_KEY" not in os.environ
    monkeypatch.setattr(sys, "argv", ["strata", "serve", "--api-key", "sk-argv-7", "--port=1"])
    load_config(parser.parse_args(["--model", str(llama_dir), "--api-key", "sk-argv-7"]))
    assert "sk-argv-7" not in " ".join(sys.argv)
    key_file = tmp_path / "key"
    key_file.write_text("sk-file-5\n")
    key_file.chmod(0o600)
    digest = load_config(parser.parse_args(["--model", str(llama_dir), "--api-key-file", str(key_file)])).api_key_sha256
    assert digest == hashlib.sha256(b"sk-file-5").hexdigest()
    monkeypatch.setattr(sys, "stdin", io.StringIO("sk-stdin-3\n"))
    digest = load_config(parser.parse_args(["--model", str(llama_dir), "--api-key-file", "-"])).api_key_sha256
    assert digest == hashlib.sha256(b"sk-stdin-3").hexdigest()
    for args, message in ((["--api-key-file", str(tmp_path / "missing")], "cannot read"),
                          (["--api-key-file", str(key_file), "--api-key", "x"], "one of --api-key and --api-key-file")):
        with pytest.raises(ValueError, match=message):
            load_config(parser.parse_args(["--model", str(llama_dir), *args]))


def test_a_second_server_gets_the_next_free_direct_port_and_a_busy_one_asked_for_is_refused(capsys) -> None:
    import argparse
    import socket

    from strata.deployments.ray_serve.cli import DIRECT_PORT, check_ports
    from strata.deployments.ray_serve.serve_flags import add_arguments
    from strata.local_server import free_port

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ports = ["--port", str(free_port()), "--dashboard-port", str(free_port()), "--metrics-port", str(free_port())]
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", DIRECT_PORT))  # as a first server's replica would hold it
            busy.listen()
        except OSError:
            pass  # something on this machine holds it already: the same situation
        args = parser.parse_args(ports)
        check_ports(args)
        assert args.direct_port > DIRECT_PORT
        asked = parser.parse_args([*ports, "--direct-port", str(DIRECT_PORT)])
        with pytest.raises(ValueError, match=f"port {DIRECT_PORT} on 127.0.0.1 is in use; pick another with --direct-port"):
            check_ports(asked)


@pytest.mark.parametrize("flag", ["--port", "--dashboard-port", "--metrics-port"])
def test_serve_on_a_port_in_use_is_one_line_before_ray_starts(flag: str, llama_dir: Path, capsys) -> None:
    import socket

    from strata.local_server import free_port

    ports = {"--port": free_port(), "--dashboard-port": free_port(), "--metrics-port": free_port()}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[flag]))
        busy.listen()
        res = strata_in_process(capsys, "serve", "--model", str(llama_dir),
                                *(str(x) for kv in ports.items() for x in kv))
    assert res.returncode == 2
    assert res.stderr.strip() == f"strata: error: port {ports[flag]} on 127.0.0.1 is in use; pick another with {flag}"
    import ray

    assert not ray.is_initialized()  # refused before any cluster started


def test_the_serving_banner_waits_for_health_and_says_what_it_waits_for(capsys) -> None:
    """`strata serve` prints "Strata is serving" only once /health is 200; until then stderr says what the
    server waits for; a model that failed to load is an error line, not a wait until the timeout."""
    import argparse
    import http.server
    import json
    import threading

    from strata.deployments.ray_serve.cli import wait_until_healthy

    replies = [(503, {"status": "starting", "waiting_for": ["model"]})] * 2 + \
              [(503, {"status": "starting", "waiting_for": ["encode"]}), (200, {"status": "ok"})]

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = replies.pop(0) if len(replies) > 1 else replies[0]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = argparse.Namespace(host="127.0.0.1", port=server.server_address[1])
        assert wait_until_healthy(args, 60, threading.Event())
        err = capsys.readouterr().err
        assert "waiting for model" in err and "waiting for encode" in err
        replies[:] = [(503, {"status": "failed", "reason": "the model failed to load"})]
        assert not wait_until_healthy(args, 60, threading.Event())
        assert "strata: error: the model failed to load" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_a_hugging_face_id_resolves_through_the_local_cache_and_nothing_is_downloaded(
        llama_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """`strata serve org/name` (or --model org/name, or `strata generate --model org/name`) finds a model the
    local Hugging Face cache holds, offline, and serves it under that id (or the --served-model-name values:
    the first, and aliases); one it does not hold is a one-line error saying how to get it."""
    import argparse
    import shutil

    from strata.deployments.ray_serve.serve_flags import add_arguments, load_config

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llava"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(llama_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = load_config(parser.parse_args(["acme/tiny-llava"]))
    assert config.model_dir == str(snapshot) and config.model_name == "acme/tiny-llava"  # its id, not its hash
    assert load_config(parser.parse_args(["--model", "acme/tiny-llava"])).model_dir == str(snapshot)
    named = load_config(parser.parse_args(["acme/tiny-llava", "--served-model-name", "tiny", "llava-small"]))
    assert named.model_name == "tiny" and named.model_aliases == ["llava-small"]  # vLLM's several names
    res = strata_in_process(capsys, "serve", "acme/not-here", "--port", "1")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "not in the local Hugging Face cache" in res.stderr and "hf download acme/not-here" in res.stderr
    out = strata_in_process(capsys, "generate", "--model", "acme/tiny-llava", "--raw-prompt", "USER: hi ASSISTANT:",
                            "--max-tokens", "2", "--temperature", "0")
    assert out.returncode == 0, out.stderr
