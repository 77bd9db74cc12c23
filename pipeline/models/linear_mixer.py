"""What every linear-attention layer shares (Gated DeltaNet, KDA): the per-sequence state it keeps, how a
step's sequences map to state slots, and the two recurrences run over those slots.

A linear layer keeps, per sequence, the causal convolution's last inputs and a recurrent matrix per head
instead of per-token KV. Both live in the step's slots of ``kvstore.StatePool``: a decode step runs every
sequence's token at once, a prefill chunk runs its sequence's rows in the chunked form, continuing from
where the previous chunk left the state. The layer reads one slot and writes another, which the runner
swaps only when the step succeeded (``kvstore.state_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from strata.kernels.delta_rule import causal_conv, causal_conv_step, delta_rule_chunked, delta_rule_step_slots
from strata.kvstore.state_pool import StateKind, StatePool
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.models.text_config import TextConfig

CHUNK = 64  # rows solved at once by the chunked delta rule


def state_kinds(cfg: TextConfig, dtype: torch.dtype) -> tuple[StateKind, ...]:
    """What each linear layer keeps per sequence: the convolution's last inputs (model dtype) and the
    recurrent matrix per value head (fp32, as the references keep it)."""
    lin = cfg.linear
    assert lin is not None
    return (StateKind("conv", (lin.conv_dim, lin.conv_kernel - 1), dtype),
            StateKind("recurrent", (lin.num_v_heads, lin.k_head_dim, lin.v_head_dim), torch.float32))


def state_slot_counts(config: EngineConfig) -> tuple[int, int]:
    """A linear-attention model's state slots on every rank: (running: two per sequence that may run, the one
    a step reads and the one it writes; snapshots: one per such sequence with prefix caching,
    ``kvstore.state_cache``)."""
    running = config.max_num_seqs + 1
    return 2 * running, running - 1 if config.enable_prefix_caching else 0


@dataclass
class LinearStates:
    """The step's sequences as linear layers see them: the slot each one's state is read from and the one
    the step writes (``kvstore.state_cache``: swapped once the step succeeds), its rows in the step, and
    where its state at a block boundary inside its rows is copied (row, snapshot slot; row -1: none)."""

    pool: StatePool
    slots: list[int]
    write_slots: list[int]
    query_lens: list[int]
    snapshots: list[tuple[int, int]]

    def __post_init__(self) -> None:
        self.decode = all(n == 1 for n in self.query_lens)  # one row per sequence: every one steps at once
        self.read_index = torch.tensor(self.slots, dtype=torch.int64)
        self.write_index = torch.tensor(self.write_slots, dtype=torch.int64)


class LinearMixer(nn.Module):
    """A linear-attention layer's state handling; subclasses project, gate and normalise."""

    linear_index: int  # its row of the state pool

    def fuse(self) -> None:
        """Nothing to fuse: the input projections feed different paths."""

    def join_group(self, full: TextConfig, all_reduce: Callable, kv_replicas: int) -> None:
        """Nothing to join on a tensor-parallel rank: a rank's heads and their state need no other rank's."""

    def convolve(self, mixed: torch.Tensor, weight: torch.Tensor, states: LinearStates) -> torch.Tensor:
        """q|k|v [T, conv_dim] through the depthwise causal convolution (``weight`` [conv_dim, kernel]) with
        SiLU, continuing each sequence's convolution state."""
        conv = states.pool.layer("conv", self.linear_index)
        if states.decode:
            out, new = causal_conv_step(mixed, conv[states.read_index], weight)
            conv[states.write_index] = new
            return out
        return self._per_sequence(conv, states, (mixed,), lambda rows, state: causal_conv(rows[0], state, weight))

    def recur(self, q, k, v, g, beta, states: LinearStates) -> torch.Tensor:
        """The gated delta rule over each sequence's recurrent state: out [T, H, V] fp32."""
        rec = states.pool.layer("recurrent", self.linear_index)
        if states.decode:
            return delta_rule_step_slots(q, k, v, g, beta, rec, states.read_index, states.write_index)
        return self._per_sequence(rec, states, (q, k, v, g, beta),
                                  lambda rows, state: delta_rule_chunked(*rows, state, CHUNK))

    @staticmethod
    def _per_sequence(pool: torch.Tensor, states: LinearStates, inputs: tuple[torch.Tensor, ...],
                      run: Callable) -> torch.Tensor:
        """Each sequence's rows through ``run(rows, state) -> (out, state)``, from its read slot into its write
        slot; where a block boundary falls inside its rows, the state there is copied to its snapshot slot."""
        parts, start = [], 0
        for read, write, n, (at, snap) in zip(states.slots, states.write_slots, states.query_lens, states.snapshots):
            state = pool[read]
            cuts = (0, at, n) if 0 < at < n else (0, n)
            for lo, hi in zip(cuts, cuts[1:]):
                out, state = run(tuple(x[start + lo : start + hi] for x in inputs), state)
                parts.append(out)
                if hi == at < n:  # a boundary inside the rows (one at their end is copied after the step)
                    pool[snap] = state
            pool[write] = state
            start += n
        return torch.cat(parts)
