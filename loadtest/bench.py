"""`strata bench serve` / `python -m loadtest.bench`: load a running server over HTTP and report
the metrics of the usual serving benchmarks (vLLM's `bench serve` names): request and token
throughput, TTFT / TPOT / ITL / E2EL (mean, median, p99) and goodput against SLOs. ITL is per request,
(E2EL - TTFT) / (output tokens - 1), as an independent client measures it; the gap between stream
events (IEL) and the tokens an event carries are reported next to it. Random prompts are sized in the
served model's tokens (its /tokenize).

Arrivals are Poisson at ``--request-rate`` (``inf``: all at once), capped by
``--max-concurrency``. ``--sweep`` repeats the run at several concurrency levels and plots
latency and throughput against concurrency. Results: JSON, plus PNG plots with ``--sweep``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

WORDS = "sea ship tide moon star harbour wave storm light keeper rope sail anchor deck mast wind".split()


@dataclass
class Request:
    messages: list[dict[str, Any]]
    output_len: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    events: int = 0  # stream events that carried text (one may carry several tokens)
    error: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                   help="Bearer token of a server started with --api-key (default: $STRATA_API_KEY)")
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    p.add_argument("--dataset", choices=("random", "random-mm", "prefix-repetition"), default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128,
                   help="tokens per random prompt (before the chat template), counted by the server's /tokenize")
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--mm-image-sizes", nargs="+", default=["64x64", "448x336", "1024x768", "336x896"],
                   help="random-mm: image sizes (WxH) drawn per image; a native-resolution model (Qwen-VL, "
                        "Kimi-K2.5) turns each into its own number of prompt tokens")
    p.add_argument("--mm-images-per-request", type=int, default=1, help="random-mm: images in each request")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: words of the shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: no pacing)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--sweep", nargs="+", type=int, help="run once per concurrency level and plot")
    p.add_argument("--sweep-prompts", choices=("fresh", "warm"), default="fresh",
                   help="fresh: each level gets its own prompts (no level profits from an earlier one's prefix "
                        "cache); warm: one warm-up pass, then every level replays the same prompts")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs such as ttft:500 tpot:50 e2el:5000 (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=Path("bench-results"))
    p.add_argument("--no-progress", action="store_true")


def _png_data_url(rng: random.Random, size: tuple[int, int] = (64, 64)) -> str:
    """A PNG of ``size``: a random background with a few random blocks (cheap to make at any size)."""
    from PIL import Image

    w, h = size
    img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(8):
        x, y = rng.randrange(w), rng.randrange(h)
        img.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, min(w, x + w // 4 + 1), min(h, y + h // 4 + 1)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_sizes(values: list[str]) -> list[tuple[int, int]]:
    sizes = []
    for value in values:
        w, _, h = value.lower().partition("x")
        if not (w.isdigit() and h.isdigit() and 0 < int(w) <= 8192 and 0 < int(h) <= 8192):
            raise SystemExit(f"strata: error: --mm-image-sizes takes WxH values up to 8192x8192, got {value!r}")
        sizes.append((int(w), int(h)))
    return sizes


class TokenFitter:
    """Random text of exactly N tokens of the served model, through its /tokenize and /detokenize: a word
    list overshoots, its first N tokens are kept and written back as text (what vLLM's random dataset does
    with the model's tokenizer). None when the server has neither route (then N counts words)."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=60)

    def fit(self, text: str, n: int) -> str | None:
        try:
            r = self.client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
            if r.status_code != 200:
                return None
            tokens = r.json()["tokens"][:n]
            r = self.client.post("/detokenize", json={"tokens": tokens})
            return r.json()["prompt"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None


def make_dataset(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    fitter = TokenFitter(args.base_url, _auth(args)) if getattr(args, "base_url", None) else None

    def tokens(n: int) -> str:  # n tokens of the served model (n words when the server cannot count)
        text = words(2 * n + 8)
        fitted = fitter.fit(text, n) if fitter is not None else None
        return fitted if fitted is not None else " ".join(text.split()[:n])

    prefixes = [words(args.prefix_len) for _ in range(args.num_prefixes)]
    sizes = _image_sizes(getattr(args, "mm_image_sizes", ["64x64"]))
    out = []
    for i in range(args.num_prompts):
        if args.dataset == "prefix-repetition":
            content: Any = f"{prefixes[i % len(prefixes)]}\nQuestion {i}: {words(16)}"
        elif args.dataset == "random-mm":
            images = [{"type": "image_url", "image_url": {"url": _png_data_url(rng, rng.choice(sizes))}}
                      for _ in range(getattr(args, "mm_images_per_request", 1))]
            content = images + [{"type": "text", "text": tokens(args.random_input_len)}]
        else:
            content = tokens(args.random_input_len)
        out.append(Request([{"role": "user", "content": content}], args.random_output_len))
    return out


async def _one(client: httpx.AsyncClient, model: str, req: Request) -> Result:
    body = {"model": model, "messages": req.messages, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res, last, done = Result(ok=False), None, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                done = done or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    res.events += 1
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        res.error = repr(exc)
        return res
    res.e2el = time.perf_counter() - t0
    if last is None:  # finished without visible text (e.g. an immediate EOS): the first token came at the end
        res.ttft = res.e2el
    res.ok = done
    res.error = "" if res.ok else "stream ended without [DONE]"
    return res


async def run_load(base_url: str, model: str, requests: list[Request], rate: float, max_concurrency: int | None,
                   seed: int, progress: bool, headers: dict[str, str] | None = None) -> tuple[list[Result], float]:
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    rng = np.random.default_rng(seed)
    bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr, desc="requests")
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=max_concurrency or 1000)) as client:
        async def gated(req: Request) -> Result:
            async with limit:
                res = await _one(client, model, req)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(gated(req)))
            if rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def parse_goodput(specs: list[str]) -> dict[str, float]:
    slos = {}
    for spec in specs:
        key, _, value = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad --goodput entry {spec!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[key] = float(value)
    return slos


def summarize(results: list[Result], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    """vLLM's figures, with ITL as an independent client measures it (guidellm's definition): per request,
    (end-to-end - TTFT) / (output tokens - 1), since a stream event may carry several tokens and the gaps
    between events are not gaps between tokens. The gaps between events are reported as inter-event
    latency, next to the tokens an event carries."""
    ok = [r for r in results if r.ok]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def good(r: Result) -> bool:
        tpot = (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        values = {"ttft": r.ttft, "tpot": tpot, "e2el": r.e2el}
        return all(values[k] * 1e3 <= v for k, v in slos.items())

    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": (sum(good(r) for r in ok) / duration) if slos else None,
        "tokens_per_event": out_tokens / max(1, sum(r.events for r in ok)),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", tpots),
                         ("iel", [g for r in ok for g in r.itls]), ("e2el", [r.e2el for r in ok])):
        for stat, v in _stats(values).items():
            summary[f"{stat}_{name}_ms"] = v
    return summary


def print_summary(s: dict[str, Any], label: str) -> None:
    print(f"============ Serving Benchmark Result ({label}) ============")
    print(f"{'Successful requests:':<36}{s['completed']:>12}")
    print(f"{'Failed requests:':<36}{s['failed']:>12}")
    print(f"{'Benchmark duration (s):':<36}{s['duration_s']:>12.2f}")
    print(f"{'Total input tokens (images counted):':<36}{s['total_input_tokens']:>12}")
    print(f"{'Request throughput (req/s):':<36}{s['request_throughput']:>12.2f}")
    print(f"{'Output token throughput (tok/s):':<36}{s['output_throughput']:>12.2f}")
    print(f"{'Total token throughput (tok/s):':<36}{s['total_token_throughput']:>12.2f}")
    if s["goodput"] is not None:
        print(f"{'Request goodput (req/s):':<36}{s['goodput']:>12.2f}")
    for name in ("ttft", "tpot", "itl", "iel", "e2el"):
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<36}{s[f'{stat}_{name}_ms']:>12.2f}")
    print(f"{'Tokens per stream event:':<36}{s['tokens_per_event']:>12.2f}")
    print("(ITL = (E2EL - TTFT) / (output tokens - 1) per request; IEL = the gap between stream events)")


def plot_title(rows: list[dict[str, Any]]) -> str:
    """What a plot compares: the model, the dataset, prompt and output lengths, the prompts' mode."""
    if not rows:
        return ""
    r = rows[0]
    return (f"{r.get('model', '?')} · {r.get('dataset', '?')} · in {r.get('input_len', '?')} tok / out "
            f"{r.get('output_len', '?')} tok · prompts {r.get('prompts', '?')}")


def plot_sweep(rows: list[dict[str, Any]], out: Path, run_id: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in rows]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("ttft", "tpot", "e2el"):
        ax.plot(conc, [r[f"median_{name}_ms"] for r in rows], marker="o", label=f"median {name.upper()}")
        ax.plot(conc, [r[f"p99_{name}_ms"] for r in rows], marker="x", linestyle="--", label=f"p99 {name.upper()}")
    ax.set(xlabel="max concurrency", ylabel="ms", title="Latency vs concurrency", yscale="log")
    fig.suptitle(plot_title(rows), fontsize=7)
    ax.set_xticks(conc)
    ax.legend(fontsize=7)
    suffix = f"-{run_id}" if run_id else ""
    paths.append(out / f"latency_vs_concurrency{suffix}.png")
    fig.tight_layout(), fig.savefig(paths[-1], dpi=120), plt.close(fig)
    # Two panels, not two y-axes: tokens/s and requests/s are proportional at a fixed output length,
    # so on twin axes their lines lie on top of each other.
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    top.plot(conc, [r["output_throughput"] for r in rows], marker="o")
    top.set(ylabel="output tokens/s", title="Throughput vs concurrency")
    fig.suptitle(plot_title(rows), fontsize=7)
    bottom.plot(conc, [r["request_throughput"] for r in rows], marker="s", color="tab:orange")
    bottom.set(xlabel="max concurrency", ylabel="requests/s")
    bottom.set_xticks(conc)
    paths.append(out / f"throughput_vs_concurrency{suffix}.png")
    fig.tight_layout(), fig.savefig(paths[-1], dpi=120), plt.close(fig)
    return paths


class BenchError(Exception):
    """A condition the user must fix (no server, a bad argument): printed as one line."""


def _auth(args: argparse.Namespace) -> dict[str, str]:
    key = getattr(args, "api_key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    try:
        r = httpx.get(args.base_url + "/v1/models", headers=_auth(args), timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except httpx.HTTPError as exc:
        raise BenchError(f"no Strata server answers at {args.base_url} ({type(exc).__name__}); "
                         "start one with `strata serve` or pass --base-url") from None
    except (ValueError, KeyError, IndexError):
        raise BenchError(f"{args.base_url}/v1/models did not list a model; is this an OpenAI-compatible server?") from None


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BenchError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    model = _model(args)
    levels = args.sweep or [args.max_concurrency]
    args.result_dir.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    fresh = args.sweep and args.sweep_prompts == "fresh"
    base = make_dataset(args)
    if args.sweep and not fresh:  # warm: one untimed pass, then every level replays the same prompts
        asyncio.run(run_load(args.base_url, model, base, float("inf"), levels[0], args.seed, False, _auth(args)))
    rows = []
    for i, level in enumerate(levels):
        # Fresh prompts per level (a new seed), so no level is timed against a cache an earlier one filled.
        requests = make_dataset(argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * i})) if fresh else base
        results, duration = asyncio.run(run_load(args.base_url, model, requests, args.request_rate, level,
                                                 args.seed, not args.no_progress, _auth(args)))
        summary = {**summarize(results, duration, slos), "max_concurrency": level or len(requests),
                   "request_rate": args.request_rate, "dataset": args.dataset, "num_prompts": args.num_prompts,
                   "model": model, "goodput_slos_ms": slos, "output_len": args.random_output_len,
                   "input_len": (f"{args.prefix_len} words + 16" if args.dataset == "prefix-repetition"
                                 else args.random_input_len),
                   "prompts": "fresh per level" if fresh else ("warm (replayed after a warm-up pass)" if args.sweep else "one run")}
        rows.append(summary)
        print_summary(summary, f"concurrency {level or 'unbounded'}, {args.dataset}, prompts {summary['prompts']}")
    path = args.result_dir / f"bench-{args.dataset}-{run_id}.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items() if k != "func"}, "runs": rows},
                               indent=2, default=str))
    print(f"results: {path}")
    if args.sweep:
        for png in plot_sweep(rows, args.result_dir, run_id):
            print(f"plot: {png}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
