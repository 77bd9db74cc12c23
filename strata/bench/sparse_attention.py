"""`strata bench sparse`: sparse attention over contexts far larger than the device tier, read from the tiers.

A tiny DeepSeek-V3.2 built here (3 layers, an indexer of 2 heads keeping ``--topk`` tokens, fp32), or with
``--model deepseek_v4`` a tiny DeepSeek-V4 (two CSA layers whose indexer keeps ``--topk`` entries of 4 tokens, an
HCA layer of 16-token entries, a window-only layer), with a device pool of ``--device-blocks`` blocks and the
rest of each context in a host tier. For each ``--contexts`` length a
random prompt is prefilled (its older blocks spill as it grows), then 16 tokens are decoded. Printed per
context, with what it compared:

* decode TPOT (median of the decoded tokens) against the shortest context's;
* bytes read per decode step from each place: indexer keys and latents (V4: the CSA layers' chosen entries),
  on the device and streamed back from the host tier (``kvstore.sparse_reads``, the counters ``/strata/stats``
  reports);
* the share of spilled blocks whose latents a step read (the rest stayed in the host tier);
* the device pool's bytes (the same at every length) against the context's KV;
* whether the answer is the one an engine with every block on the device gives (``--check-all-device``).

With ``--decode-batches`` it measures instead how decode scales with the batch: decode tok/s of both tiny models
at each batch size (64-token prompts, 32 tokens decoded, all on the device, the two engines interleaved round by
round, medians of 3), each batch's rate against batch 1's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", nargs="+", type=int, default=[16384, 65536])
    p.add_argument("--model", choices=["deepseek_v32", "deepseek_v4"], default="deepseek_v32",
                   help="which tiny sparse-attention model to build")
    p.add_argument("--device-blocks", type=int, default=256, help="device pool, in 16-token blocks")
    p.add_argument("--topk", type=int, default=64, help="tokens each query's indexer keeps")
    p.add_argument("--check-all-device", action="store_true", help="also run every context all on the device")
    p.add_argument("--decode-batches", nargs="+", type=int,
                   help="instead: decode tok/s of both tiny models at these batch sizes, side by side")
    p.add_argument("--json", type=Path)


def _engine(model: Path, context: int, device_blocks: int | None, host_dir: Path | None) -> Any:
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.factory import build_engine

    longest = context + 64
    blocks = device_blocks or longest // 16 + 64
    tiers = {"host_kv_blocks": longest // 16 + 64, "host_kv_dir": str(host_dir)} if host_dir else {}
    # spills need hashes; no deadline: a 256K prompt's quadratic indexer prefill takes longer than a served
    # request may
    return build_engine(model, EngineConfig(max_model_len=longest, num_kv_blocks=blocks, request_timeout_s=0, **tiers))


def _run(engine: Any, context: int) -> tuple[list[int], float, list[dict[str, int]]]:
    """(the 16 decoded tokens, median TPOT in ms, the read counters after the prompt and after each token)."""
    from strata.pipeline.contract.sampling_params import SamplingParams

    ids = torch.randint(4, 500, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    engine.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
    stamps, tokens, counters = [], [], []
    for event in engine.run():
        if event.error is not None:
            raise SystemExit(f"strata bench sparse: the {context:,}-token request failed: {event.error}")
        stamps.append(time.perf_counter())
        tokens.append(event.token_id)
        counters.append(dict(engine.kv.sparse_reads.as_dict()))
    return tokens[1:], 1000 * statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:])), counters


def _per_step(counters: list[dict[str, int]]) -> dict[str, float]:
    """Mean bytes (and blocks) per decode step, from the counters after the first token and after the last."""
    first, last, steps = counters[1], counters[-1], len(counters) - 2
    out = {k: (last[k] - first[k]) / steps for k in last if k != "reads"}
    seen = out.pop("spilled_blocks_seen")
    out["share_of_spilled_blocks_read"] = out["spilled_blocks_read"] / seen if seen else 0.0
    return out


def _decode_batches(args: argparse.Namespace) -> dict[str, Any]:
    """Decode tok/s of the tiny DSA and DeepSeek-V4 models at ``args.decode_batches``, interleaved."""
    from strata.bench.engine_rates import measure_rates
    from strata.checkpoints.tiny_text_models import build_tiny_text_model
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.factory import build_engine

    models = ["deepseek_v32", "deepseek_v4"]
    print(f"# sparse: decode tok/s by batch size, tiny {' and '.join(models)} (fp32, all on the device, "
          f"{torch.get_num_threads()} threads), 64-token prompts, 32 tokens decoded, the engines interleaved")
    rows: dict[str, Any] = {m: {} for m in models}
    with tempfile.TemporaryDirectory(prefix="strata-sparse-") as tmp:
        engines = {m: build_engine(build_tiny_text_model(m, Path(tmp) / m), EngineConfig(max_model_len=512))
                   for m in models}
        rates = argparse.Namespace(batches=args.decode_batches, prompt_len=64, output_len=32, prefill_len=256,
                                   repeats=3)
        measure_rates(engines, rates, 500, rows)
    for m, row in rows.items():
        base = row[f"decode_b{args.decode_batches[0]}_tok_s"]
        print(f"  {m:>13}: " + "; ".join(f"batch {b}: {row[f'decode_b{b}_tok_s']:7.1f} tok/s "
                                          f"({row[f'decode_b{b}_tok_s'] / base:.2f}x batch {args.decode_batches[0]})"
                                          for b in args.decode_batches))
    return rows


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_text_models import build_tiny_text_model

    if args.decode_batches:
        rows = _decode_batches(args)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-sparse-") as tmp:
        longest = max(args.contexts) + 64
        model = build_tiny_text_model(args.model, Path(tmp) / args.model, overrides={
            "index_topk": args.topk, "max_position_embeddings": longest})
        what = (f"DeepSeek-V3.2 (3 layers, indexer top-{args.topk} tokens)" if args.model == "deepseek_v32" else
                f"DeepSeek-V4 (2 CSA layers, indexer top-{args.topk} of 4-token entries; an HCA layer; a window-only "
                "layer)")
        print(f"# sparse: tiny {what}, fp32, {torch.get_num_threads()} threads; device pool {args.device_blocks} "
              "blocks, the rest in a host tier; 16 tokens decoded")
        for n in sorted(args.contexts):
            engine = _engine(model, n, args.device_blocks, Path(tmp) / f"host-{n}")
            tokens, tpot, counters = _run(engine, n)
            layout = engine.kv.layout
            row = {"tpot_ms": tpot, "per_step": _per_step(counters),
                   "device_pool_bytes": engine.kv.stats()["device_bytes"],
                   "context_kv_bytes": n * layout.bytes_per_token()}
            engine.close()  # lands its queued tier writes before the directory goes
            if args.check_all_device:
                whole = _engine(model, n, None, None)
                row["identical_to_all_on_device"] = _run(whole, n)[0] == tokens
                whole.close()
            rows[str(n)] = row
        base = rows[str(min(args.contexts))]["tpot_ms"]
        attended = "latents" if args.model == "deepseek_v32" else "chosen entries"
        for n, row in rows.items():
            s = row["per_step"]
            same = row.get("identical_to_all_on_device")
            print(f"  context {int(n):>8,}: TPOT {row['tpot_ms']:7.2f} ms ({row['tpot_ms'] / base:.2f}x the shortest); "
                  f"per step: indexer keys {s['index_key_bytes_device'] / 2**20:.2f} MiB device + "
                  f"{s['index_key_bytes_spilled'] / 2**20:.2f} MiB host, {attended} "
                  f"{s['latent_bytes_device'] / 2**10:.1f} KiB device + {s['latent_bytes_spilled'] / 2**10:.1f} KiB host "
                  f"({100 * s['share_of_spilled_blocks_read']:.1f}% of spilled blocks touched); device pool "
                  f"{row['device_pool_bytes'] / 2**20:.2f} MiB for {row['context_kv_bytes'] / 2**20:.1f} MiB of KV"
                  + ("" if same is None else f"; answer {'identical to' if same else 'DIFFERS from'} all-on-device"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0
