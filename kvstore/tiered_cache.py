"""The KV store's one face to the engine: a device pool plus the lower tiers, driven by a few verbs.

All block arithmetic lives in the KV store; the scheduler above only decides who runs, who waits and
who is preempted. The verbs, each on a sequence's :class:`BlockTable`:

* ``reserve(table, num_tokens, keep_free)`` - can the table hold ``num_tokens`` while
  ``keep_free`` blocks stay allocatable? Allocates, spilling leading published blocks of live
  tables to the lower tiers when the device is dry; False (nothing allocated) if even that fails.
* ``commit(table, num_tokens, hashes)`` - tokens written; newly full blocks are published under
  ``hashes`` (shareable by prefix) and written through to the top lower tier.
* ``match_prefix(table, hashes, keep_free)`` - adopt the longest cached leading run of blocks
  from any tier into an empty table, as a :class:`PrefixMatch`.
* ``make_handle(table, release)`` / ``adopt(handle)`` - hand a sequence's KV to another stage.
* ``free(table)`` - drop every reference the table holds.

A context can outgrow the device: a sequence's oldest full blocks are *spilled* (dropped from the
device, pinned in a lower tier) and attention streams them back layer by layer through a fixed
staging buffer (``spilled_reads``).

The trades behind the verbs each have a class: :class:`BlockCopies` (publish, write-through, promote),
:class:`Spiller` (whose blocks leave the device), :class:`PrefixMatcher` (lookups over every tier),
:class:`SpillLedger` (readers of spilled blocks, and the tiers' pins), :class:`SpilledReader` (streaming).
This class keeps the tables: which are live here, and what a handle or a tail carries.
"""

from __future__ import annotations

from typing import Sequence

import torch

from strata.kvstore.block_copies import BlockCopies
from strata.kvstore.block_pool import BlockPool
from strata.kvstore.block_table import BlockTable, chunk_working_set_blocks
from strata.kvstore.device_blocks import DeviceBlocks
from strata.kvstore.layout import KVLayout, dtype_name
from strata.kvstore.handle import HandleError, KVHandle
from strata.kvstore.lower_tiers import LowerTiers
from strata.kvstore.prefix_match import PrefixMatch, PrefixMatcher
from strata.kvstore.layer_mirror import SpilledLayerMirror
from strata.kvstore.sparse_reads import SparseReads
from strata.kvstore.spill_ledger import SpillLedger
from strata.kvstore.spilled_reads import SpilledBlocks, SpilledReader
from strata.kvstore.spiller import Spiller
from strata.kvstore.state_cache import StateCache
from strata.kvstore.window_claims import WindowClaims


class TieredKVCache:
    """Block pool (device tier) + optional host/disk chain + the staging buffer for streaming."""

    def __init__(self, pool: BlockPool, lower: LowerTiers | None = None, staging_blocks: int = 64,
                 fingerprint: bytes = b"", layout: KVLayout | None = None,
                 blocks: DeviceBlocks | None = None) -> None:
        """``layout`` and ``blocks``: a tensor-parallel pool holds a share of the heads; ``layout`` is
        then the whole block's (what tiers and handles see) and ``blocks`` gathers and scatters."""
        self.pool = pool
        self.lower = lower
        self.layout = layout or pool.layout
        self.blocks = blocks or DeviceBlocks(pool)
        self.fingerprint = fingerprint
        self.model_key = fingerprint  # the fingerprint without an FP8 cache's scales (set by the factory)
        self.staging_blocks = staging_blocks
        self.reader = SpilledReader(pool, lower, self.layout, staging_blocks)  # attention over spilled blocks
        self.spills = SpillLedger(lower)
        self.copies = BlockCopies(pool, lower, self.blocks, self.layout)
        self.spiller = Spiller(pool, self.copies, self.spills)
        self.claims = WindowClaims(pool)
        self.matcher = PrefixMatcher(pool, self.copies, self.spills, self.claims)
        self._live: dict[int, BlockTable] = {}  # tables holding blocks of this pool: spill candidates
        self.states: StateCache | None = None  # linear-attention layers' per-sequence state (``state_cache``)
        self.prompt_keyed = False  # a prefix's KV depends on its prompt's length (DSA): hashes seeded with it
        self.sparse_reads: SparseReads | None = None  # what sparse attention read (DSA), counted
        self.layer_mirror: SpilledLayerMirror | None = None  # DSA's indexer keys of spilled blocks, kept on the device

    @property
    def can_spill(self) -> bool:
        """Whether blocks can leave the device (a lower tier exists)."""
        return self.lower is not None

    @property
    def device_kv(self) -> list[torch.Tensor]:
        """What attention reads: per model layer, a block-major view of its group's device tensor,
        [blocks, kv_parts, block_size, heads, dim]."""
        return self.pool.kv.layers

    def staging_nbytes(self) -> int:
        return self.reader.nbytes()

    def new_table(self) -> BlockTable:
        return BlockTable(self.layout.block_size)

    # ------------------------------------------------------------ capacity
    def reserve(self, table: BlockTable, num_tokens: int, keep_free: int = 0) -> bool:
        """Give ``table`` room for ``num_tokens`` tokens, leaving ``keep_free`` blocks allocatable.

        Spills leading published blocks when the device is dry, each time from the live table whose
        spill frees the most device blocks (a block other tables share frees nothing, so a shared
        prefix is not streamed for no gain). False, with nothing allocated, if that is not enough.
        """
        needed = table.blocks_needed(num_tokens)
        if not self.claims.room(needed):  # a windowed group's slots are all read by running windows
            return False
        if self.states is not None and table.state_slot < 0 and not self.states.claim(table):
            return False
        candidates = [*self._live.values(), *([table] if id(table) not in self._live else [])]
        if not self.spiller.make_room(needed + keep_free, candidates):
            return False
        for _ in range(needed):
            table.block_ids.append(self.pool.allocate())
            self.claims.claim_new(table, table.block_ids[-1])
        self._live[id(table)] = table
        return True

    # ------------------------------------------------------------ writes
    def commit(self, table: BlockTable, num_tokens: int, hashes: Sequence[bytes] = ()) -> None:
        """``num_tokens`` of the table now hold KV; publish the newly full blocks that ``hashes``
        names (hashes of the table's leading full blocks; empty: publish nothing)."""
        if num_tokens > table.capacity():
            raise ValueError(f"{num_tokens} tokens exceed the table's {table.capacity()} slots")
        table.num_tokens = num_tokens
        end = min(len(hashes), table.num_full_blocks())
        if end > table.num_published:
            self.copies.publish(table, hashes, end)
        self.claims.slide(table)  # after publishing: a block the windows pass now stays cached for reuse

    # ------------------------------------------------------------ prefix match over tiers
    def matchable_blocks(self, num_tokens: int) -> int:
        """Full blocks of a ``num_tokens`` prompt the prefix cache may supply: never the one holding the
        last token, whose logits the step samples (so it is always computed)."""
        return (num_tokens - 1) // self.layout.block_size

    def chunk_working_set(self, chunk_tokens: int) -> int:
        """Device blocks one prefill chunk needs (see :func:`chunk_working_set_blocks`)."""
        return chunk_working_set_blocks(chunk_tokens, self.layout.block_size)

    def match_prefix(self, table: BlockTable, hashes: Sequence[bytes], keep_free: int,
                     state: bytes | None = None) -> PrefixMatch:
        """Adopt the longest cached leading run of ``hashes`` into the empty ``table``.

        Device hits are referenced; lower-tier hits are promoted into device blocks while more than
        ``keep_free`` blocks stay allocatable, and the oldest blocks beyond that stay spilled
        (pinned below). A linear-attention hybrid adopts blocks only with their state: up to a published
        snapshot, or all of ``hashes`` with ``state`` (a hand-off's, after exactly those blocks).
        """
        if self.states is not None and state is None:  # a hybrid's prefix ends where a snapshot of its state does
            hashes = hashes[: self.states.longest(hashes, len(self.matcher.locate(hashes)))]
        elif self.states is not None:
            self.states.check(state)  # before any block is adopted
        match = self.matcher.match(table, hashes, keep_free)
        if self.states is not None and (match.num_blocks or state is not None) and not (
                match.num_blocks == len(hashes) and (self.states.install(table, state) if state is not None
                                                     else self.states.claim(table, hashes[-1]))):
            self.free(table)  # never the blocks without their state
            return PrefixMatch()
        if table.num_blocks:
            self._live[id(table)] = table
        return match

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Read ahead the lower-tier blocks a prompt about to be admitted will adopt."""
        self.matcher.prefetch(hashes)

    # ------------------------------------------------------------ hand-off between stages
    def make_handle(self, table: BlockTable, release: bool = False) -> KVHandle:
        """A handle to the table's KV. Ownership of the blocks passes to the handle (the table is no
        longer a spill candidate here), or with ``release`` the device references are dropped at
        once: the consumer is on another pool and adopts full blocks by hash from the lower tiers."""
        if self.states is not None and not release:  # its state crossed as bytes (``StateCache.export``)
            self.states.release(table)
        resident_full = table.num_full_blocks() - table.num_spilled
        tail = table.block_ids[resident_full] if len(table.block_ids) > resident_full else None
        handle = KVHandle(  # block_hashes: the published blocks (all full ones when prefix caching is on)
            fingerprint=self.fingerprint, model_key=self.model_key, num_tokens=table.num_tokens,
            block_hashes=list(table.hashes), block_ids=list(table.block_ids[:resident_full]),
            pool_id=self.pool.pool_id, tail_block=tail, num_spilled=table.num_spilled,
        )
        if self.lower is not None:  # a consumer on another pool looks the full blocks up below: they land first
            self.lower.wait_for(table.hashes)
        if release:
            self.free(table)
        else:
            self._live.pop(id(table), None)
        return handle

    def adopt(self, handle: KVHandle) -> BlockTable | None:
        """The table a handle made on this pool describes (its references pass to the table);
        None for a handle from another pool (adopt its blocks with ``match_prefix`` instead)."""
        if handle.fingerprint != self.fingerprint:
            raise HandleError("KV handle was made for another model (fingerprint mismatch)")
        if handle.pool_id != self.pool.pool_id:
            return None
        table = BlockTable(self.layout.block_size, list(handle.block_ids), 0, handle.num_spilled,
                           list(handle.block_hashes))
        if handle.tail_block is not None:
            table.block_ids.append(handle.tail_block)
        table.num_tokens = handle.num_tokens
        self.claims.adopt(table)
        self._live[id(table)] = table
        return table

    def export_tail(self, table: BlockTable) -> bytes:
        """The partial last block of a table (every group, as the tiers store a block) as bytes, or b"" when the
        table ends on a block boundary: what a hand-off to another pool ships so the receiver does not
        recompute it (a partial block is never published, so no tier holds it)."""
        if table.num_tokens % table.block_size == 0:
            return b""
        return bytes(self.copies.block_bytes(table.block_ids[table.num_tokens // table.block_size - table.num_spilled]))

    def import_tail(self, table: BlockTable, data: bytes, num_tokens: int) -> bool:
        """Append an exported partial block to ``table`` (which must hold exactly the full blocks before
        it) so that it covers ``num_tokens``; False, with the table unchanged, if there is no room."""
        bs = table.block_size
        if table.num_blocks != num_tokens // bs or len(data) != self.layout.bytes_per_block():
            raise ValueError("the tail does not continue this table")
        if not self.reserve(table, num_tokens):
            return False
        self.blocks.write(table.block_ids[-1], torch.frombuffer(bytearray(data), dtype=torch.uint8))
        table.num_tokens = num_tokens
        return True

    # ------------------------------------------------------------ release
    def free(self, table: BlockTable) -> None:
        """Drop every reference the table holds: device refs and lower-tier pins. Idempotent."""
        self._live.pop(id(table), None)
        self.claims.release_all(table)
        if self.states is not None:
            self.states.release(table)
        for block_id in reversed(table.block_ids):
            self.pool.free(block_id)
        if table.num_spilled and self.lower is not None:
            self.spills.unpin(table.hashes[: table.num_spilled])
        self.spills.count(-table.num_spilled)
        table.block_ids.clear()
        table.hashes.clear()
        table.num_spilled = 0
        table.num_tokens = 0

    # ------------------------------------------------------------ streaming reads (``spilled_reads``)
    def spilled(self, table: BlockTable) -> "SpilledBlocks | None":
        """The table's spilled blocks as attention reads them, or None when all are on the device."""
        return SpilledBlocks(self.reader, table.hashes[: table.num_spilled]) if table.num_spilled else None

    def load_spilled(self, hashes: Sequence[bytes], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of spilled blocks (``SpilledReader.load``); KVBlockLostError if one is in no tier."""
        return self.reader.load(hashes, layer)

    def stats(self) -> dict[str, object]:
        bs, device = self.layout.block_size, self.pool.stats()
        pool_block = self.pool.kv.block_nbytes()  # this rank's heads of a block under tp
        return {
            "dtype": dtype_name(self.layout.dtype),
            "cache_groups": [{"layers": len(g.layers), "window": g.window} for g in self.layout.groups],
            "window_slots": self.pool.window_stats(),  # each sliding-window group's device slots
            "block_bytes": self.layout.bytes_per_block(),  # a whole block as the tiers store it (every rank's heads)
            "device_bytes": device["total"] * pool_block,  # this process's pool
            "device_bytes_in_use": device["in_use"] * pool_block,
            "device": device,
            "tiers": self.lower.stats() if self.lower else {},
            "prefix_queried_tokens": self.matcher.queried_blocks * bs,
            "prefix_hit_tokens": {k: v * bs for k, v in self.matcher.hit_blocks.items()},
            "spilled_blocks": self.spills.current,
            "peak_spilled_blocks": self.spills.peak,
            "staging_bytes": self.staging_nbytes(),
            **({"sparse_reads": self.sparse_reads.as_dict()} if self.sparse_reads is not None else {}),
            **({"layer_mirror": self.layer_mirror.stats()} if self.layer_mirror is not None else {}),
        }
