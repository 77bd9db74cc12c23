"""Prefix reuse over every tier: find the longest cached leading run of a prompt's block hashes and adopt
it into an empty table, referencing device hits, promoting lower-tier hits while the device has room,
and leaving the oldest blocks spilled (pinned below) beyond that."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from strata.kvstore.block_copies import BlockCopies
from strata.kvstore.block_pool import BlockPool
from strata.kvstore.block_table import BlockTable
from strata.kvstore.spill_ledger import SpillLedger
from strata.kvstore.window_claims import WindowClaims


@dataclass(frozen=True)
class PrefixMatch:
    """What ``match_prefix`` adopted: ``num_blocks`` leading blocks, the first ``num_spilled`` of
    them left in a lower tier, and where each hit came from."""

    num_blocks: int = 0
    num_spilled: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0  # the tokens those blocks hold (their KV need not be computed)


class PrefixMatcher:
    """Looks hashes up device first, then down the tier chain, and adopts what it found."""

    def __init__(self, pool: BlockPool, copies: BlockCopies, spills: SpillLedger, claims: WindowClaims) -> None:
        self.pool = pool
        self.claims = claims
        self.copies = copies
        self.lower = copies.lower
        self.spills = spills
        self.queried_blocks = 0
        self.hit_blocks = {"device": 0, **({t.name: 0 for t in self.lower.tiers} if self.lower else {})}

    def match(self, table: BlockTable, hashes: Sequence[bytes], keep_free: int) -> PrefixMatch:
        """Adopt the longest cached leading run of ``hashes`` into the empty ``table``, keeping more than
        ``keep_free`` device blocks allocatable."""
        if not table.is_empty():
            raise ValueError("match_prefix needs an empty table")
        where = self.locate(hashes)
        room = max(0, self.pool.num_free() - keep_free)
        want_spilled = max(0, len(where) - room) if self.lower is not None else 0
        if self.pool.windows:  # a windowed layer reads only the device: its window's blocks are adopted there
            want_spilled = min(want_spilled, self.claims.floor_at(len(where), table.block_size))
        spilled = self._adopt_spilled(table, hashes, want_spilled)
        end = len(where) if spilled == want_spilled else spilled  # a block that cannot stay below ends it
        matched = self._adopt_resident(table, hashes, spilled, end)
        if self.pool.windows:
            matched = self._fit_windows(table, matched)
        self.queried_blocks += len(hashes)
        by_tier: dict[str, int] = {}
        for name in where[:matched]:
            self.hit_blocks[name] += 1
            by_tier[name] = by_tier.get(name, 0) + 1
        table.num_tokens = matched * table.block_size
        return PrefixMatch(matched, table.num_spilled, by_tier, matched * table.block_size)

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

    def locate(self, hashes: Sequence[bytes]) -> list[str]:
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
        while done < k and self.copies.ensure_below(hashes[done]):
            done += 1
        if done:
            self.spills.pin(hashes[:done])
            self.lower.touch(hashes[:done])  # type: ignore[union-attr]
        table.num_spilled = done
        table.hashes.extend(hashes[:done])
        self.spills.count(done)
        return done

    def _fit_windows(self, table: BlockTable, matched: int) -> int:
        """Shorten the match to where every window at its end is whole on the device, and claim it. When no
        length keeps the spilled blocks outside every window (a promotion failed in the window), nothing
        is adopted."""
        fit = self.claims.fit_match(table, matched)
        keep = max(fit, table.num_spilled) - table.num_spilled  # resident blocks that stay
        for block_id in reversed(table.block_ids[keep:]):
            self.pool.free(block_id)
        del table.block_ids[keep:], table.hashes[table.num_spilled + keep :]
        if fit < 0:
            self.spills.unpin(table.hashes)
            self.spills.count(-table.num_spilled)
            table.hashes.clear()
            table.num_spilled = 0
            return 0
        self.claims.claim_match(table, fit)
        return fit

    def _adopt_resident(self, table: BlockTable, hashes: Sequence[bytes], first: int, end: int) -> int:
        """Reference (device hit) or promote (lower hit) blocks [first, end); returns the match length."""
        for i in range(first, end):
            block_id = self.pool.lookup(hashes[i])
            if block_id is not None:
                self.pool.incref(block_id)
            else:
                block_id = self.copies.promote(hashes[i])
                if block_id is None:
                    return i
            table.block_ids.append(block_id)
            table.hashes.append(hashes[i])
        return end
