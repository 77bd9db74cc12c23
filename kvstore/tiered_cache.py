"""The KV store's one face to the engine: a device pool plus the lower tiers, driven by a few verbs.

All block arithmetic lives here; the scheduler above only decides who runs, who waits and who
is preempted. The verbs, each on a sequence's :class:`BlockTable`:

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from strata.kvstore.block_pool import BlockPool, NoFreeBlocksError
from strata.kvstore.block_table import BlockTable, chunk_working_set_blocks
from strata.kvstore.device_blocks import DeviceBlocks
from strata.kvstore.layout import KVLayout, dtype_name
from strata.kvstore.handle import HandleError, KVHandle
from strata.kvstore.lower_tiers import LowerTiers
from strata.kvstore.spilled_reads import SpilledBlocks, SpilledReader, bytes_view


@dataclass(frozen=True)
class PrefixMatch:
    """What ``match_prefix`` adopted: ``num_blocks`` leading blocks, the first ``num_spilled`` of
    them left in a lower tier, and where each hit came from."""

    num_blocks: int = 0
    num_spilled: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0  # the tokens those blocks hold (their KV need not be computed)


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
        self.staging_blocks = staging_blocks
        self.reader = SpilledReader(pool, lower, self.layout, staging_blocks)  # attention over spilled blocks
        self._host_block = torch.empty(self.layout.block_shape(), dtype=self.layout.dtype)  # promotion scratch
        self._live: dict[int, BlockTable] = {}  # tables holding blocks of this pool: spill candidates
        self._pins: dict[bytes, int] = {}  # tables of this process reading each spilled block
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = {"device": 0, **({t.name: 0 for t in lower.tiers} if lower else {})}
        self.spilled_blocks = 0  # blocks currently spilled by live tables (gauge)
        self.peak_spilled_blocks = 0

    @property
    def can_spill(self) -> bool:
        """Whether blocks can leave the device (a lower tier exists)."""
        return self.lower is not None

    @property
    def device_kv(self) -> torch.Tensor:
        """The block-major device tensor attention reads: [blocks, layers, 2, block_size, heads, dim]."""
        return self.pool.kv

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
        if not self._make_room(needed + keep_free, table):
            return False
        for _ in range(needed):
            table.block_ids.append(self.pool.allocate())
        self._live[id(table)] = table
        return True

    def _make_room(self, blocks: int, extra: BlockTable) -> bool:
        while self.pool.num_free() < blocks:
            if self.lower is None:
                return False
            want = blocks - self.pool.num_free()
            candidates = list(self._live.values()) + ([extra] if id(extra) not in self._live else [])
            plans = [(self._spill_plan(t, want), t) for t in candidates]
            (count, freed), best = max(plans, key=lambda p: p[0][1], default=((0, 0), None))
            if best is None or freed == 0 or self._spill(best, count) == 0:
                return False
        return True

    def _spill_plan(self, table: BlockTable, want: int) -> tuple[int, int]:
        """(blocks to spill, device blocks that frees): the shortest leading run of resident
        published blocks that frees ``want`` blocks, or all of them."""
        count = freed = 0
        for block_id in table.block_ids[: table.num_published - table.num_spilled]:
            count += 1
            freed += self.pool.ref_count(block_id) == 1
            if freed >= want:
                break
        return count, freed

    def _spill(self, table: BlockTable, n: int) -> int:
        """Drop the ``n`` oldest resident published blocks from the device; returns how many left."""
        done = 0
        while done < n and table.num_spilled < table.num_published and table.block_ids:
            h = table.hashes[table.num_spilled]
            if not self._ensure_lower(h):
                break
            self._pin([h])
            self.pool.free(table.block_ids.pop(0))
            table.num_spilled += 1
            done += 1
        self._count_spilled(done)
        return done

    # ------------------------------------------------------------ writes
    def commit(self, table: BlockTable, num_tokens: int, hashes: Sequence[bytes] = ()) -> None:
        """``num_tokens`` of the table now hold KV; publish the newly full blocks that ``hashes``
        names (hashes of the table's leading full blocks; empty: publish nothing)."""
        if num_tokens > table.capacity():
            raise ValueError(f"{num_tokens} tokens exceed the table's {table.capacity()} slots")
        table.num_tokens = num_tokens
        end = min(len(hashes), table.num_full_blocks())
        if end > table.num_published:
            self._publish(table, hashes, end)

    def _publish(self, table: BlockTable, hashes: Sequence[bytes], end: int) -> None:
        ids = table.block_ids
        written: list[tuple[bytes, memoryview]] = []
        for i in range(table.num_published, end):
            j = i - table.num_spilled
            canonical = self.pool.publish(ids[j], hashes[i])
            if canonical != ids[j]:  # same content already cached: share it, drop our copy
                self.pool.incref(canonical)
                self.pool.free(ids[j])
                ids[j] = canonical
            elif self.lower is not None and not self.lower.top.contains(hashes[i]):
                written.append((hashes[i], self._block_bytes(canonical)))
            table.hashes.append(hashes[i])
        if written:
            self.lower.store_behind(written)  # type: ignore[union-attr]

    def _block_bytes(self, block_id: int) -> memoryview:
        return memoryview(bytes_view(self.blocks.read(block_id)))

    def _ensure_lower(self, block_hash: bytes) -> bool:
        """Make sure a lower tier holds ``block_hash`` (writing it from the device if needed)."""
        if self.lower is None:
            return False
        if self.lower.ensure(block_hash):  # below already, or its queued write-through landed just now
            return True
        block_id = self.pool.lookup(block_hash)
        return block_id is not None and self.lower.store([(block_hash, self._block_bytes(block_id))])[0]

    # ------------------------------------------------------------ prefix match over tiers
    def matchable_blocks(self, num_tokens: int) -> int:
        """Full blocks of a ``num_tokens`` prompt the prefix cache may supply: never the one holding the
        last token, whose logits the step samples (so it is always computed)."""
        return (num_tokens - 1) // self.layout.block_size

    def chunk_working_set(self, chunk_tokens: int) -> int:
        """Device blocks one prefill chunk needs (see :func:`chunk_working_set_blocks`)."""
        return chunk_working_set_blocks(chunk_tokens, self.layout.block_size)

    def match_prefix(self, table: BlockTable, hashes: Sequence[bytes], keep_free: int) -> PrefixMatch:
        """Adopt the longest cached leading run of ``hashes`` into the empty ``table``.

        Device hits are referenced; lower-tier hits are promoted into device blocks while more than
        ``keep_free`` blocks stay allocatable, and the oldest blocks beyond that stay spilled
        (pinned below).
        """
        if not table.is_empty():
            raise ValueError("match_prefix needs an empty table")
        where = self._locate(hashes)
        room = max(0, self.pool.num_free() - keep_free)
        want_spilled = max(0, len(where) - room) if self.lower is not None else 0
        spilled = self._adopt_spilled(table, hashes, want_spilled)
        end = len(where) if spilled == want_spilled else spilled  # a block that cannot stay below ends it
        matched = self._adopt_resident(table, hashes, spilled, end)
        self.prefix_queried_blocks += len(hashes)
        by_tier: dict[str, int] = {}
        for name in where[:matched]:
            self.prefix_hit_blocks[name] += 1
            by_tier[name] = by_tier.get(name, 0) + 1
        table.num_tokens = matched * table.block_size
        if table.num_blocks:
            self._live[id(table)] = table
        return PrefixMatch(matched, spilled, by_tier, matched * self.layout.block_size)

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Read ahead the lower-tier blocks among the leading cached ``hashes`` of a prompt about to be
        admitted (the admission copies them to the device; their files are read while this step runs)."""
        if self.lower is None or self.lower.prefetcher is None:
            return
        wanted = []
        for h in hashes:
            if self.pool.lookup(h) is not None:
                continue
            if self.lower.find(h) is None:
                break
            wanted.append(h)
        self.lower.prefetch(wanted)

    def _locate(self, hashes: Sequence[bytes]) -> list[str]:
        """The tier of each leading hash that is cached somewhere, up to the first miss."""
        where: list[str] = []
        for h in hashes:
            if self.pool.lookup(h) is not None:
                where.append("device")
                continue
            tier = self.lower.find(h) if self.lower is not None else None
            if tier is None and self.lower is not None and self.lower.pending(h) and self.lower.ensure(h):
                tier = self.lower.find(h)  # its write-through was still queued: landed just now
            if tier is None:
                break
            where.append(tier.name)
        return where

    def _adopt_spilled(self, table: BlockTable, hashes: Sequence[bytes], k: int) -> int:
        """Pin the first ``k`` blocks below (copying device-only ones down); returns how many."""
        done = 0
        while done < k and self._ensure_lower(hashes[done]):
            done += 1
        if done:
            self._pin(hashes[:done])
            self.lower.touch(hashes[:done])  # type: ignore[union-attr]
        table.num_spilled = done
        table.hashes.extend(hashes[:done])
        self._count_spilled(done)
        return done

    def _adopt_resident(self, table: BlockTable, hashes: Sequence[bytes], first: int, end: int) -> int:
        """Reference (device hit) or promote (lower hit) blocks [first, end); returns the match length."""
        for i in range(first, end):
            block_id = self.pool.lookup(hashes[i])
            if block_id is not None:
                self.pool.incref(block_id)
            else:
                block_id = self._promote(hashes[i])
                if block_id is None:
                    return i
            table.block_ids.append(block_id)
            table.hashes.append(hashes[i])
        return end

    def _promote(self, block_hash: bytes) -> int | None:
        """Copy a lower-tier block into a fresh device block; None if no block or no good copy."""
        if self.lower is None:
            return None
        try:
            block_id = self.pool.allocate()
        except NoFreeBlocksError:
            return None
        if not self.lower.read_block(block_hash, bytes_view(self._host_block)):
            self.pool.free(block_id)
            return None
        self.blocks.write(block_id, self._host_block)
        self.pool.publish(block_id, block_hash)
        return block_id

    # ------------------------------------------------------------ hand-off between stages
    def make_handle(self, table: BlockTable, release: bool = False) -> KVHandle:
        """A handle to the table's KV. Ownership of the blocks passes to the handle (the table is no
        longer a spill candidate here), or with ``release`` the device references are dropped at
        once: the consumer is on another pool and adopts full blocks by hash from the lower tiers."""
        resident_full = table.num_full_blocks() - table.num_spilled
        tail = table.block_ids[resident_full] if len(table.block_ids) > resident_full else None
        handle = KVHandle(  # block_hashes: the published blocks (all full ones when prefix caching is on)
            fingerprint=self.fingerprint, num_tokens=table.num_tokens,
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
        self._live[id(table)] = table
        return table

    def export_tail(self, table: BlockTable) -> bytes:
        """The partial last block of a table (every layer, device layout) as bytes, or b"" when the
        table ends on a block boundary: what a hand-off to another pool ships so the receiver does not
        recompute it (a partial block is never published, so no tier holds it)."""
        if table.num_tokens % table.block_size == 0:
            return b""
        return bytes(self._block_bytes(table.block_ids[table.num_tokens // table.block_size - table.num_spilled]))

    def import_tail(self, table: BlockTable, data: bytes, num_tokens: int) -> bool:
        """Append an exported partial block to ``table`` (which must hold exactly the full blocks before
        it) so that it covers ``num_tokens``; False, with the table unchanged, if there is no room."""
        bs = table.block_size
        if table.num_blocks != num_tokens // bs or len(data) != self.layout.bytes_per_block():
            raise ValueError("the tail does not continue this table")
        if not self.reserve(table, num_tokens):
            return False
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.layout.dtype).view(self.layout.block_shape())
        self.blocks.write(table.block_ids[-1], block)
        table.num_tokens = num_tokens
        return True

    # ------------------------------------------------------------ release
    def free(self, table: BlockTable) -> None:
        """Drop every reference the table holds: device refs and lower-tier pins. Idempotent."""
        self._live.pop(id(table), None)
        for block_id in reversed(table.block_ids):
            self.pool.free(block_id)
        if table.num_spilled and self.lower is not None:
            self._unpin(table.hashes[: table.num_spilled])
        self.spilled_blocks -= table.num_spilled
        table.block_ids.clear()
        table.hashes.clear()
        table.num_spilled = 0
        table.num_tokens = 0

    def _pin(self, hashes: Sequence[bytes]) -> None:
        """Count this process's readers per block; the shared pin is taken by the first one."""
        first = [h for h in hashes if self._pins.get(h, 0) == 0]
        for h in hashes:
            self._pins[h] = self._pins.get(h, 0) + 1
        self.lower.pin(first)  # type: ignore[union-attr]

    def _unpin(self, hashes: Sequence[bytes]) -> None:
        last = []
        for h in hashes:
            n = self._pins[h] - 1
            if n:
                self._pins[h] = n
            else:
                del self._pins[h]
                last.append(h)
        self.lower.unpin(last)  # type: ignore[union-attr]

    def _count_spilled(self, n: int) -> None:
        self.spilled_blocks += n
        self.peak_spilled_blocks = max(self.peak_spilled_blocks, self.spilled_blocks)

    # ------------------------------------------------------------ streaming reads (``spilled_reads``)
    def spilled(self, table: BlockTable) -> "SpilledBlocks | None":
        """The table's spilled blocks as attention reads them, or None when all are on the device."""
        return SpilledBlocks(self.reader, table.hashes[: table.num_spilled]) if table.num_spilled else None

    def load_spilled(self, hashes: Sequence[bytes], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of spilled blocks (``SpilledReader.load``); KVBlockLostError if one is in no tier."""
        return self.reader.load(hashes, layer)

    def stats(self) -> dict[str, object]:
        bs, device = self.layout.block_size, self.pool.stats()
        pool_block = self.pool.kv[0].nbytes  # this rank's heads of a block under tp
        return {
            "dtype": dtype_name(self.layout.dtype),
            "block_bytes": self.layout.bytes_per_block(),  # a whole block as the tiers store it (every rank's heads)
            "device_bytes": device["total"] * pool_block,  # this process's pool
            "device_bytes_in_use": device["in_use"] * pool_block,
            "device": device,
            "tiers": self.lower.stats() if self.lower else {},
            "prefix_queried_tokens": self.prefix_queried_blocks * bs,
            "prefix_hit_tokens": {k: v * bs for k, v in self.prefix_hit_blocks.items()},
            "spilled_blocks": self.spilled_blocks,
            "peak_spilled_blocks": self.peak_spilled_blocks,
            "staging_bytes": self.staging_nbytes(),
        }
