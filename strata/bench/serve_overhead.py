"""`strata bench serve-overhead`: what the Serve path (HTTP + HAProxy or Serve's proxy + ingress + four stage
replicas + KV hand-off through the host tier) adds to time-to-first-token and inter-token
latency, against the in-process engine on the same model, the same prompts and the same
concurrency, measured side by side in one run.

Both sides stream text: TTFT is the time to the first non-empty text delta; TPOT is vLLM's
(first to last text delta over output tokens - 1, whatever the chunking); ITL is every gap
between deltas. Greedy, ignore EOS, fixed prompt and output lengths. The HTTP clients keep
their connections open, as the openai client does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import torch

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--url", help="an already running `strata serve` (default: start one per mode for the run)")
    p.add_argument("--stream-interval-ms", type=float, default=5.0, help="serve config stream_interval_ms")
    p.add_argument("--load-model", choices=("tiny", "small", "none"), default="small",
                   help="model of the closed-loop throughput comparison (none: skip it)")
    p.add_argument("--load-prompts", type=int, default=32)
    p.add_argument("--load-in", type=int, default=256, help="prompt tokens of the throughput comparison")
    p.add_argument("--load-out", type=int, default=64, help="output tokens of the throughput comparison")
    p.add_argument("--load-concurrency", type=int, default=16)
    p.add_argument("--handoff-lens", nargs="*", type=int, default=[1024, 8192, 32768],
                   help="prompt lengths of the prefill->decode hand-off measurement (none: skip it)")
    p.add_argument("--ingress", nargs="+", choices=("haproxy", "serve-proxy"), default=["haproxy", "serve-proxy"],
                   help="what serves the load-balanced port, one server each (`strata serve --ingress`)")
    p.add_argument("--modes", nargs="+", choices=("aggregated", "disaggregated"), default=["aggregated", "disaggregated"],
                   help="serving modes to start and measure (ignored with --url)")
    p.add_argument("--json", type=Path)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _summary(ttfts: list[float], gaps: list[list[float]], out_tokens: int) -> dict[str, float]:
    """TPOT per request is vLLM's: time from the first to the last text / (output tokens - 1), so it
    does not depend on how many tokens a streamed chunk carries; ITL is every gap between chunks."""
    itls = [g for request in gaps for g in request]
    tpots = [sum(request) / max(1, out_tokens - 1) for request in gaps if request]
    return {"ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p99_ms": _percentile(ttfts, 0.99) * 1e3,
            "tpot_p50_ms": statistics.median(tpots) * 1e3,
            "itl_p50_ms": statistics.median(itls) * 1e3, "itl_p99_ms": _percentile(itls, 0.99) * 1e3}


def _prompts(n: int, words: int, salt: str = "") -> list[str]:
    """``salt`` differs per route: routes served by one server must not find each other's prompts cached."""
    return [f"Request {salt}{i}: " + " ".join(f"wave{(i * 7 + j) % 97}" for j in range(words)) for i in range(n)]


def _in_process(model: Path, prompts: list[str], concurrency: int, out_tokens: int) -> dict[str, float]:
    from strata.stages.factory import build_engine

    engine = build_engine(model, EngineConfig())
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([{"prompt": "warm up", "params": SamplingParams(max_tokens=2, temperature=0)}])
    ttfts, itls = [], []
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start : start + concurrency]
        t0 = time.perf_counter()
        ids = [engine.add_request(prompt=p, params=params) for p in batch]
        last: dict[str, float] = {}
        gaps: dict[str, list[float]] = {i: [] for i in ids}
        for out in engine.run():
            if not out.text_delta:
                continue
            now = time.perf_counter()
            if out.request_id in last:
                gaps[out.request_id].append(now - last[out.request_id])
            else:
                ttfts.append(now - t0)
            last[out.request_id] = now
        itls.extend(gaps.values())
    return _summary(ttfts, itls, out_tokens)


def _one_stream(client: httpx.Client, url: str, model: str, prompt: str, out_tokens: int, t0: float, ttfts: list,
                itls: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": out_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    last, gaps = None, []
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if not choices[0].get("delta", {}).get("content"):
                continue
            now = time.perf_counter()
            (gaps.append(now - last) if last is not None else ttfts.append(now - t0))
            last = now
    itls.append(gaps)


def _served(url: str, prompts: list[str], concurrency: int, out_tokens: int) -> dict[str, float]:
    """Each of ``concurrency`` client threads keeps one HTTP connection open (as the openai client
    does): connection setup is not part of what the server adds."""
    clients = [httpx.Client(timeout=600) for _ in range(concurrency)]
    try:
        model = clients[0].get(url + "/v1/models").json()["data"][0]["id"]
        for c in clients:  # open every connection before timing
            _one_stream(c, url, model, "warm up", 2, time.perf_counter(), [], [])
        ttfts: list[float] = []
        itls: list[float] = []
        for start in range(0, len(prompts), concurrency):
            t0 = time.perf_counter()
            threads = [threading.Thread(target=_one_stream, args=(c, url, model, p, out_tokens, t0, ttfts, itls))
                       for c, p in zip(clients, prompts[start : start + concurrency])]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return _summary(ttfts, itls, out_tokens)
    finally:
        for c in clients:
            c.close()


def _start(model: Path, mode: str, stream_interval_ms: float = 0.0, ingress: str = "haproxy") -> Any:
    import tempfile

    from strata.local_server import LocalServer

    work = Path(tempfile.mkdtemp(prefix="strata-bench-serve-"))
    config: dict[str, Any] = {"mode": mode, "stream_interval_ms": stream_interval_ms, "stages": {"ingress": {"max_ongoing_requests": 1024},
                                                      "llm": {"max_ongoing_requests": 1024}}}
    if mode == "disaggregated":
        config["engine"] = {"host_kv_blocks": 4096, "host_kv_dir": str(work / "host")}
    return LocalServer(model, work, config, env={"RAY_AUTH_MODE": "disabled"}, flags=["--ingress", ingress]).wait_ready()


def _servers(args: argparse.Namespace, model: Path) -> Iterator[list[tuple[str, str]]]:
    """One server per mode and ingress, as its routes (name, URL): the load-balanced port (named after its
    ingress) and, for a mode's first server, a replica's own port (direct ingress). Stopped after use."""
    for mode in args.modes:
        for i, ingress in enumerate(args.ingress):
            server = _start(model, mode, args.stream_interval_ms, ingress)
            direct = [(f"{mode}/direct", server.direct_url)] if i == 0 and server.direct_url else []
            try:
                yield [(f"{mode}/{ingress}", server.base_url), *direct]
            finally:
                server.stop()


def _load_prompts(model: Path, n: int, length: int, seed: int = 1234) -> list[str]:
    """Texts of about ``length`` tokens (random words added until the count is reached); both sides
    send the same texts, so they see the same token ids."""
    import random

    from strata.pipeline.frontend.tokenizer import PromptTokenizer
    from strata.pipeline.models.model_config import load_model_config

    tok = PromptTokenizer(model, load_model_config(model))
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        words = [f"Request {i}:"]
        while True:
            words.extend(f"w{rng.randrange(10_000)}" for _ in range(8))
            if len(tok.encode(" ".join(words), 0).token_ids) >= length:
                break
        texts.append(" ".join(words))
    return texts


def _percentiles(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _closed_loop_in_process(model: Path, texts: list[str], out: int, conc: int) -> dict[str, float]:
    from strata.stages.factory import build_engine

    engine = build_engine(model, EngineConfig(max_model_len=4096))
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    engine.generate([{"raw_prompt": texts[0], "params": SamplingParams(max_tokens=2, temperature=0)}])
    pending, first, last, tpots = list(texts), {}, {}, []
    t0 = time.perf_counter()
    live = 0
    tokens = 0
    while pending or engine.has_unfinished():
        while pending and live < conc:
            engine.add_request(raw_prompt=pending.pop(0), params=params)
            live += 1
        for ev in engine.step():
            now = time.perf_counter()
            tokens += 1
            first.setdefault(ev.request_id, now)
            last[ev.request_id] = now
            if ev.finished:
                live -= 1
                tpots.append((now - first[ev.request_id]) / max(1, out - 1))
    wall = time.perf_counter() - t0
    return {"output_tok_s": tokens / wall, "tpot_p50_ms": _percentiles(tpots) * 1e3}


def _closed_loop_served(url: str, texts: list[str], out: int, conc: int) -> dict[str, float]:
    import queue as queue_mod

    work: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    for t in texts:
        work.put(t)
    tpots: list[float] = []
    counts: list[int] = []
    clients = [httpx.Client(timeout=600) for _ in range(conc)]
    model = clients[0].get(url + "/v1/models").json()["data"][0]["id"]

    def worker(client: httpx.Client) -> None:
        while True:
            try:
                text = work.get_nowait()
            except queue_mod.Empty:
                return
            body = {"model": model, "prompt": text, "max_tokens": out, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t_first = t_last = None
            n = 0
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        t_last = time.perf_counter()
                        t_first = t_first or t_last
            counts.append(n)
            if t_first is not None:
                tpots.append((t_last - t_first) / max(1, out - 1))

    for c in clients:  # warm the connections
        c.post(url + "/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 2})
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    return {"output_tok_s": sum(counts) / wall, "tpot_p50_ms": _percentiles(tpots) * 1e3}


def _handoff(model: Path, lengths: list[int]) -> list[dict[str, float]]:
    """Prefill on one pool, decode on another (what two replicas do), KV through a host tier in tmpfs:
    the decoder adopting a prompt's KV (full blocks by hash, the shipped tail) vs prefilling it."""
    import tempfile

    from strata.pipeline.core.sequence import Sequence
    from strata.stages.decoder import Decoder
    from strata.stages.factory import LanguageStage
    from strata.stages.prefiller import Prefiller

    longest = max(lengths)
    host = Path(tempfile.mkdtemp(prefix="strata-handoff-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    blocks = -(-longest // 16) + 64
    config = EngineConfig(max_model_len=longest + 16, num_kv_blocks=blocks, host_kv_blocks=2 * blocks,
                          host_kv_dir=str(host), prefill_chunk_tokens=2048, max_num_batched_tokens=2048)
    prefiller = Prefiller(LanguageStage(model, config).core(), release_on_handoff=True)
    decoder = Decoder(LanguageStage(model, config).core())
    print("\n# prefill -> decode hand-off: prefill on one pool, decode adopts on another (host tier in tmpfs); "
          "tiny model fp32")
    print(f"{'prompt':>8} {'prefill':>10} {'hand-off':>10} {'fraction':>9}")
    rows = []
    for n in lengths:
        ids = torch.randint(8, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        seq = Sequence(f"handoff-{n}", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 16)
        t0 = time.perf_counter()
        prefiller.add(seq)
        results = []
        while not results:
            results = prefiller.step()
        t_prefill = time.perf_counter() - t0
        (result,) = results
        t0 = time.perf_counter()
        decoder.admit(result.seq, result.kv_handle, result.tail_kv)
        t_handoff = time.perf_counter() - t0
        assert decoder.handoff_tokens["recomputed"] == 0, "the hand-off fell back to recomputing"
        decoder.abort(result.seq)
        rows.append({"prompt_tokens": n, "prefill_s": t_prefill, "handoff_s": t_handoff,
                     "fraction": t_handoff / t_prefill})
        print(f"{n:>8} {t_prefill * 1e3:>7.0f} ms {t_handoff * 1e3:>7.1f} ms {t_handoff / t_prefill:>8.1%}", flush=True)
    import shutil

    shutil.rmtree(host, ignore_errors=True)
    return rows


def _load(args: argparse.Namespace) -> list[dict[str, Any]]:
    from strata.bench.offline import bench_model_dir

    model = bench_model_dir(args.load_model)
    print(f"\n# closed loop: {args.load_prompts} prompts of {args.load_in} tokens, {args.load_out} out, "
          f"concurrency {args.load_concurrency}, model {args.load_model} fp32; streamed /v1/completions vs the "
          f"in-process engine with the same prompts in flight")
    print(f"{'mode/route':<21} {'tok/s serve':>12} {'tok/s in-proc':>14} {'ratio':>6} {'TPOT serve':>11} "
          f"{'TPOT in-proc':>13} {'ratio':>6}")
    rows = []
    for routes in _servers(args, model):
        for k, (name, route) in enumerate(routes):
            texts = _load_prompts(model, args.load_prompts, args.load_in, seed=1234 + k)  # no prefix hits across routes
            served = _closed_loop_served(route, texts, args.load_out, args.load_concurrency)
            local = _closed_loop_in_process(model, texts, args.load_out, args.load_concurrency)
            row = {"mode": name, "serve": served, "in_process": local,
                   "throughput_ratio": served["output_tok_s"] / local["output_tok_s"],
                   "tpot_ratio": served["tpot_p50_ms"] / local["tpot_p50_ms"]}
            rows.append(row)
            print(f"{name:<21} {served['output_tok_s']:>12.1f} {local['output_tok_s']:>14.1f} "
                  f"{row['throughput_ratio']:>5.2f}x {served['tpot_p50_ms']:>8.1f} ms {local['tpot_p50_ms']:>10.1f} ms "
                  f"{row['tpot_ratio']:>5.2f}x", flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_model import ensure_demo_model

    model = args.model or ensure_demo_model()
    results: dict[str, Any] = {"levels": []}
    print(f"# Serve path vs in-process engine: {args.requests} requests per level, ~{args.prompt_words}-word prompts, "
          f"{args.output_tokens} output tokens, greedy, ignore EOS; text-delta timing on both sides")
    print(f"{'mode/route':<21} {'conc':>4} {'TTFT p50 in-proc':>17} {'TTFT p50 serve':>15} {'added':>9} "
          f"{'TPOT p50 in-proc':>17} {'TPOT p50 serve':>15} {'ratio':>7} {'ITL p50 in/serve':>17}")
    servers = iter([[("given", args.url)]]) if args.url else _servers(args, model)
    for routes in servers:
        for name, route in routes:
            for conc in args.concurrency:
                prompts = _prompts(args.requests, args.prompt_words, salt=name)
                local = _in_process(model, prompts, conc, args.output_tokens)
                served = _served(route, prompts, conc, args.output_tokens)
                row = {"mode": name, "concurrency": conc, "in_process": local, "serve": served,
                       "ttft_added_ms": served["ttft_p50_ms"] - local["ttft_p50_ms"],
                       "tpot_ratio": served["tpot_p50_ms"] / local["tpot_p50_ms"]}
                results["levels"].append(row)
                print(f"{name:<21} {conc:>4} {local['ttft_p50_ms']:>14.1f} ms {served['ttft_p50_ms']:>12.1f} ms "
                      f"{row['ttft_added_ms']:>6.1f} ms {local['tpot_p50_ms']:>14.2f} ms "
                      f"{served['tpot_p50_ms']:>12.2f} ms {row['tpot_ratio']:>6.2f}x "
                      f"{local['itl_p50_ms']:>7.2f}/{served['itl_p50_ms']:.2f} ms", flush=True)
    if args.load_model != "none" and not args.url:
        results["load"] = _load(args)
    if args.handoff_lens:
        results["handoff"] = _handoff(model, args.handoff_lens)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()
    return 0
