"""The plan as a table: one row per memory consumer or tier, then the verdict (``strata plan``'s output)."""

from __future__ import annotations

from strata.planning.memory_plan import MAX_NODES, MemoryPlan, format_bytes


def format_plan(plan: MemoryPlan) -> str:
    """Aligned text table: one row per memory consumer or tier, then the verdict."""
    bs = plan.block_size
    kind = f"vision + text, up to {plan.image_tokens:,} tokens an image" if plan.multimodal else "text-only"
    ctx = f"{plan.concurrency} x {plan.context_tokens:,}"
    group = plan.tp > 1
    v4 = plan.model_type == "deepseek_v4"  # its indexer keys and its HCA entries are what every step reads whole
    weights = (f"weights per rank (largest of {plan.tp} shards)" if group else f"weights ({plan.num_params:,} params)")
    rows: list[tuple[str, str, str, str]] = [
        ("item", "bytes", "blocks", "tokens"),
        (weights, format_bytes(plan.weights_bytes), "", ""),
        (f"KV per token ({plan.kv_kind})", format_bytes(plan.kv_bytes_per_token), "", "1"),
        ("KV per block", format_bytes(plan.bytes_per_block), "1", f"{bs:,}"),
        *([("sliding-window KV (fixed, on device)", format_bytes(plan.window_kv_bytes), "", "")]
          if plan.window_kv_bytes else []),
        *([("linear-attention state per sequence (fixed, on device, x3: read, write, snapshot)",
            format_bytes(plan.state_bytes_per_sequence), "", "")] if plan.state_bytes_per_sequence else []),
        *([("linear-attention state per sequence, one rank's heads", format_bytes(plan.rank_state_bytes), "", "")]
          if plan.state_bytes_per_sequence and group else []),
        *([("sparse attention, per sequence: indexer keys " + ("and HCA entries " if v4 else "") +
            "of the context (each step reads all)",
            format_bytes(plan.sparse_step[0]), "", f"{plan.context_tokens:,}"),
           ("sparse attention, per sequence: chosen " + ("entries and windows" if v4 else "latents") +
            " one decode step reads (any tier)",
            format_bytes(plan.sparse_step[1]), "", "")] if plan.sparse_step[0] else []),
        *([("sparse attention: device room for spilled blocks' indexer keys" + (" and HCA entries" if v4 else "") +
            " (one context's" + (", per rank)" if group else ")"),
            format_bytes(plan.index_mirror_bytes), "", f"{plan.context_tokens:,}")] if plan.index_mirror_bytes else []),
        (f"KV for {ctx} tokens", format_bytes(plan.kv_bytes_needed), f"{plan.blocks_needed:,}", f"{plan.blocks_needed * bs:,}"),
        (f"activations ({plan.chunk_tokens:,}-token chunk, est.)", format_bytes(plan.activation_bytes), "", ""),
        ("staging buffer", format_bytes(plan.staging_bytes), f"{plan.staging_blocks:,}", f"{plan.staging_blocks * bs:,}"),
        ("device memory" + (" per rank" if group else ""), format_bytes(plan.device_mem_bytes), "", ""),
        ("device KV capacity" + (" (all ranks)" if group else ""), format_bytes(plan.device_blocks * plan.bytes_per_block),
         f"{plan.device_blocks:,}", f"{plan.device_blocks * bs:,}"),
        ("host KV capacity", format_bytes(plan.host_blocks * plan.bytes_per_block), f"{plan.host_blocks:,}", f"{plan.host_blocks * bs:,}"),
        ("disk KV capacity", format_bytes(plan.disk_blocks * plan.bytes_per_block), f"{plan.disk_blocks:,}", f"{plan.disk_blocks * bs:,}"),
        ("total KV capacity", format_bytes(plan.total_blocks * plan.bytes_per_block), f"{plan.total_blocks:,}", f"{plan.total_blocks * bs:,}"),
    ]
    if group:
        rows.insert(4, ("KV per block per rank", format_bytes(plan.rank_bytes_per_block), "1", f"{bs:,}"))
    if plan.num_experts:
        rows.insert(2, (f"routed experts per rank ({plan.num_experts} per MoE layer, split whole)",
                        f"{plan.experts_per_rank:,}", "", ""))
    if group and plan.multimodal:
        rows.insert(2, ("vision encoder + projector (own replica)", format_bytes(plan.encoder_weights_bytes), "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"model:  {plan.config_path} ({plan.model_type}, {kind}, {plan.dtype}, {plan.num_params:,} params)",
        f"plan:   {ctx} tokens, block {bs} tokens, working set {plan.working_set_blocks:,} blocks on device",
        f"dtype:  {plan.dtype} weights and " + ("KV" if plan.kv_cache_dtype == "auto" else "fp8 (e4m3) KV")
        + (" (strata serve's default on CUDA; on a CPU it serves float32 unless given --dtype bfloat16)"
           if plan.dtype == "bfloat16" else ""),
    ]
    if plan.weight_formats:
        lines.append(f"stored: {plan.weight_formats} (quantized weights sized as stored)")
    if group or plan.nodes > 1:
        lines.append(f"group:  tp={plan.tp} over {plan.nodes} node(s), {plan.ranks_per_node} rank(s) per node; "
                     "host and disk tiers on the driver's node")
    lines.append("")
    for i, row in enumerate(rows):
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]:>{widths[3]}}".rstrip())
        if i == 0:
            lines.append("-" * (sum(widths) + 6))
    lines += ["", "verdict: fits" if plan.fits else f"verdict: does NOT fit: {plan.reason}"]
    if not plan.fits and plan.nodes_needed is not None:
        lines.append(f"needs:  {plan.nodes_needed} node(s) of {plan.ranks_per_node} rank(s): tp={plan.tp_needed}")
    elif not plan.fits and (group or plan.nodes > 1):
        lines.append(f"needs:  more than {MAX_NODES} nodes of {plan.ranks_per_node} rank(s), or more memory per rank")
    if (group or plan.nodes > 1) and (plan.host_mem_bytes or plan.disk_bytes):
        lines.append("without host and disk tiers: " + (
            f"{plan.nodes_without_tiers} node(s) of {plan.ranks_per_node} rank(s): "
            f"tp={plan.nodes_without_tiers * plan.ranks_per_node}, every block on device"
            if plan.nodes_without_tiers is not None else
            f"no group of up to {MAX_NODES} nodes fits: every rank holds every block (MLA's latent is not split), "
            "so more ranks only shrink each one's weights"
            if plan.rank_bytes_per_block == plan.bytes_per_block else f"more than {MAX_NODES} nodes of {plan.ranks_per_node} rank(s)"))
    return "\n".join(lines)
