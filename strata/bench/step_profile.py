"""Where a decode step's time goes: linears, attention, norms / RoPE / activations, KV writes, sampling,
the forward's other tensor ops, and the Python and scheduling around them.

Each category is the wall time of the calls that make it, timed at their entry points while a batch of
sequences decodes (on a CPU every op is synchronous, so a call's wall time is its cost): the kernel
functions the model layers call (``linear``, ``rms_norm``, ``rotate_heads``, ...) wherever a module of
``strata`` imported them, the attention backend's ``forward``, the runner's ``execute`` (the whole
forward) and the core's sampling. What the forward spends outside the named kernels is "other forward
ops" (residual adds, the MLP's gate, embedding, the copies of a step's inputs); what the step spends
outside the forward and sampling is "Python and scheduling" (scheduling, preparing inputs, stop checks,
detokenizing). Nested calls count once, for the outermost. Each timed call adds about a microsecond,
which lands in the category it wraps: the split is accurate to that, and the step is a little slower
than unprofiled (its unprofiled time is measured too and printed beside it).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch.nn.functional as F

from strata.kernels.cache_ops import write_cache, write_kv
from strata.kernels.layer_ops import bf16_layer_ops, eager_layer_ops, silu_mul
from strata.kernels.linear import GEMM_ROWS, SMALL_ROWS, amx_in_use, linear, with_torch_gemm, without_amx
from strata.kernels.moe import moe_experts
from strata.kernels.norm import layer_norm, rms_norm
from strata.kernels.rope import apply_rope, rotate_fp32, rotate_heads

# the functions each category times (by identity, wherever a strata module imported them)
KERNEL_CATEGORIES: dict[str, tuple[Callable[..., Any], ...]] = {
    "linears": (linear, moe_experts),
    "norms / RoPE / activations": (rms_norm, layer_norm, rotate_heads, apply_rope, rotate_fp32, silu_mul),
    "KV writes": (write_cache, write_kv),
}
ACTIVATIONS = ("silu", "gelu")  # torch.nn.functional's, looked up as F.<name> at each call
ORDER = ("linears", "attention", "norms / RoPE / activations", "KV writes", "other forward ops", "sampling",
         "Python and scheduling")


class StepProfile:
    """Accumulated seconds per category over the profiled steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0  # > 0 inside a timed call: nested timed calls count for the outermost only

    def timed(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - t0
                self.depth -= 1

        return wrapper

    def split(self, step_seconds: float) -> dict[str, float]:
        """Seconds per category of :data:`ORDER`, summing to ``step_seconds``."""
        s = dict(self.seconds)
        forward = s.pop("forward", 0.0)
        inside = sum(s.get(c, 0.0) for c in ("linears", "attention", "norms / RoPE / activations", "KV writes"))
        out = {c: s.get(c, 0.0) for c in ORDER}
        out["other forward ops"] = max(0.0, forward - inside)
        out["Python and scheduling"] = max(0.0, step_seconds - forward - out["sampling"])
        return out


@contextmanager
def profiling(engine: Any) -> Iterator[StepProfile]:
    """Time ``engine``'s steps by category while inside; everything patched is put back on exit."""
    profile = StepProfile()
    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, category: str, wrapper: Callable[..., Any] | None = None) -> None:
        had_own = name in vars(owner)
        original = vars(owner)[name] if had_own else None
        setattr(owner, name, wrapper or profile.timed(category, getattr(owner, name)))
        undo.append(lambda: setattr(owner, name, original) if had_own else delattr(owner, name))

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("strata.") and m is not None]
    for category, functions in KERNEL_CATEGORIES.items():
        for module in modules:
            for name, value in list(vars(module).items()):
                if any(value is fn for fn in functions):
                    patch(module, name, category)
    for name in ACTIVATIONS:
        patch(F, name, "norms / RoPE / activations")
    core = engine.core
    patch(core.runner.backend, "forward", "attention")
    patch(core, "_sample", "sampling")
    forward = core.runner.execute

    def execute(chunks: Any) -> Any:  # the whole forward, around (not instead of) its kernels' own spans
        t0 = time.perf_counter()
        try:
            return forward(chunks)
        finally:
            profile.seconds["forward"] += time.perf_counter() - t0

    patch(core.runner, "execute", "forward", execute)
    try:
        yield profile
    finally:
        for restore in reversed(undo):
            restore()


def _decode_steps(engine: Any, prompts: list[list[int]], steps: int, tag: str,
                  profile: list[StepProfile] | None = None, temperature: float = 0.0) -> float:
    """Seconds of ``steps`` engine steps once every prompt is prefilled and decoding (then the rest aborted);
    with ``profile``, those steps (only) are profiled and their :class:`StepProfile` appended to it."""
    from strata.pipeline.contract.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=temperature, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    for _ in range(10_000):  # prefill every prompt (bounded: a stuck engine is an error, not a hang)
        if not engine.num_queued_prompt_tokens() and engine.num_running == len(prompts):
            break
        engine.step()
    else:
        raise RuntimeError("the prompts did not all reach decoding")
    with profiling(engine) if profile is not None else nullcontext() as recorded:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = time.perf_counter() - t0
    if profile is not None:
        profile.append(recorded)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return seconds


def run_profile(args: Any, model: Any) -> dict[str, Any]:
    """``strata bench step --profile``: the split of a decode step at each batch size, plus the
    unprofiled step time beside it."""
    import torch

    from strata.bench.offline import random_prompts
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.factory import build_engine

    batches = sorted(set(args.batch))
    engine = build_engine(model, EngineConfig(dtype=args.dtype, max_num_seqs=max(batches),
                                              max_num_batched_tokens=max(2048, max(batches)),
                                              max_model_len=args.prompt_len + args.steps + 64))
    print(f"# step profile: {model.name} ({args.dtype}, {torch.get_num_threads()} threads), decode steps over "
          f"{args.prompt_len}-token prompts, {args.steps} steps per batch size, temperature {args.temperature}; "
          "ms per step")
    results: dict[str, Any] = {}
    for batch in batches:
        prompts = random_prompts(batch, args.prompt_len, 500, seed=batch)

        def timed(tag: str, steps: int = args.steps) -> float:
            return _decode_steps(engine, prompts, steps, f"{tag}{batch}", temperature=args.temperature) / steps

        timed("warm", 4)
        plain = timed("plain")
        no_amx = eager_ops = torch_gemm = None
        if args.dtype == "float32" and SMALL_ROWS < batch <= GEMM_ROWS:  # the same steps on torch's fp32 GEMM
            with with_torch_gemm():
                torch_gemm = timed("torchgemm")
        if args.dtype == "bfloat16" and amx_in_use():  # the same steps with the linears a CPU without AMX runs
            with without_amx():
                no_amx = timed("noamx")
        if args.dtype == "bfloat16" and bf16_layer_ops(torch.empty(1, dtype=torch.bfloat16)) is not None:
            with eager_layer_ops():  # the same steps with torch's eager norm, RoPE and gate ops
                eager_ops = timed("eager")
        recorded: list[StepProfile] = []
        profiled = _decode_steps(engine, prompts, args.steps, f"prof{batch}", recorded, args.temperature)
        split = {k: v / args.steps for k, v in recorded[0].split(profiled).items()}
        results[str(batch)] = {"step_ms": plain * 1e3, "profiled_step_ms": profiled / args.steps * 1e3,
                               "split_ms": {k: v * 1e3 for k, v in split.items()}}
        print(f"batch {batch:>3}: {plain * 1e3:7.2f} ms a step unprofiled ({batch / plain:7.1f} tok/s), "
              f"{profiled / args.steps * 1e3:7.2f} ms profiled")
        if no_amx is not None:
            results[str(batch)]["step_ms_without_amx"] = no_amx * 1e3
            print(f"  without AMX tiles (vector kernel, torch GEMM): {no_amx * 1e3:7.2f} ms a step "
                  f"(AMX {no_amx / plain:.2f}x faster)")
        if torch_gemm is not None:
            results[str(batch)]["step_ms_torch_gemm"] = torch_gemm * 1e3
            print(f"  with torch's fp32 GEMM past {SMALL_ROWS} rows:        {torch_gemm * 1e3:7.2f} ms a step "
                  f"(C++ GEMM {torch_gemm / plain:.2f}x faster)")
        if eager_ops is not None:
            results[str(batch)]["step_ms_eager_layer_ops"] = eager_ops * 1e3
            print(f"  with torch's eager norm / RoPE / gate ops:    {eager_ops * 1e3:7.2f} ms a step "
                  f"(one-pass kernels {eager_ops / plain:.2f}x faster)")
        total = sum(split.values())
        for category in ORDER:
            print(f"  {category:<28} {split[category] * 1e3:7.2f} ms  {split[category] / total:6.1%}")
    engine.close()
    return results
