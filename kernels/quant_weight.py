"""Weights kept in their checkpoint's quantized encoding, and their exact dequantization, tile by tile.

A :class:`QuantWeight` is what a linear layer holds in place of a dense matrix when its checkpoint was
released quantized: the stored tensors as they were read (FP8 bytes and block scales, packed INT4
words and group scales), never expanded to the compute dtype as a whole. :meth:`QuantWeight.tile`
dequantizes a range of output rows, exactly (the float product of the stored code and its scale, as
the format defines it), which is what :func:`kernels.quant_linear.quant_linear` multiplies by, one
tile at a time, so a 1T-parameter FP8 model needs its FP8 bytes plus one tile, not 2 TB.

A weight may be a stack of experts (leading dim E): ``weight[e]`` is expert ``e``'s weight, sharing
the stack's storage. Rows from several weights concatenate (:func:`cat_rows`: q/k/v, gate/up), with
each row keeping its own scale row, so a fused weight dequantizes exactly as its parts did.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

@dataclass(frozen=True)
class QuantWeight:
    """Base of the encodings: the logical shape is ``(rows, cols)`` (a linear's out x in features), with
    ``experts`` in front when the weight is a stack. An encoding names its tensors and the dim their rows
    lie on (:meth:`row_dims`), which is all that indexing an expert, slicing rows, stacking experts and
    fusing rows need."""

    rows: int
    cols: int

    def row_dims(self) -> dict[str, int]:
        """Each tensor field that holds per-row data (None allowed) and the dim of its rows, from the end."""
        raise NotImplementedError

    def stored(self) -> torch.Tensor:
        """The tensor of codes (its leading dims are the weight's)."""
        return getattr(self, next(iter(self.row_dims())))

    def tile(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``r0 .. r1`` dequantized to ``dtype``: [r1 - r0, cols] (a 2-D weight only)."""
        raise NotImplementedError

    def _present(self) -> dict[str, int]:
        return {f: d for f, d in self.row_dims().items() if getattr(self, f) is not None}

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead(), self.rows, self.cols)

    def lead(self) -> tuple[int, ...]:
        return tuple(self.stored().shape[:-2])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor this weight holds in memory (its resident bytes)."""
        return tuple(getattr(self, f) for f in self._present())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.stored().device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight (tests and one-off uses only: the point of the class is never to need it)."""
        if self.lead():
            return torch.stack([self[e].dequantize(dtype) for e in range(self.lead()[0])])
        return self.tile(0, self.rows, dtype)

    def __getitem__(self, expert: int) -> "QuantWeight":
        return replace(self, **{f: getattr(self, f)[expert] for f in self._present()})

    def take_rows(self, rows: torch.Tensor) -> "QuantWeight":
        """The rows at indices ``rows`` as a weight of their own (an embedding lookup of a quantized table)."""
        return replace(self, rows=rows.numel(), **{f: getattr(self, f).index_select(getattr(self, f).dim() + d, rows)
                                                   for f, d in self._present().items()})

    def row_range(self, r0: int, r1: int) -> "QuantWeight":
        """Rows ``r0 .. r1`` as a weight of their own, sharing this one's storage (a fused part's view)."""
        return replace(self, rows=r1 - r0, **{f: getattr(self, f).narrow(d, r0, r1 - r0)
                                              for f, d in self._present().items()})

    def cat_rows(self, others: list["QuantWeight"]) -> "QuantWeight":
        """This weight's rows, then ``others``' (same encoding and width): a fused q/k/v or gate/up."""
        parts = [self, *others]
        if any(type(w) is not type(self) or w.cols != self.cols or w._present().keys() != self._present().keys()
               or w._settings() != self._settings() for w in parts):
            raise ValueError("cannot fuse weights of different encodings, widths or settings")
        return replace(self, rows=sum(w.rows for w in parts),
                       **{f: torch.cat([getattr(w, f) for w in parts], dim=d) for f, d in self._present().items()})

    def _settings(self) -> tuple:
        """What must agree between weights that are fused or stacked (a group size, a block width)."""
        return ()


@dataclass(frozen=True)
class FP8BlockWeight(QuantWeight):
    """e4m3 codes with one float32 scale per ``block_rows x block_cols`` block (DeepSeek-V3, Kimi-K2):
    ``w[i, j] = code[i, j] * scale[i // block_rows, j // block_cols]``. The last block of a row or a column
    may be partial. Rows fused from matrices whose row counts are not whole blocks (q/k/v of 40 + 20 rows)
    keep their own blocks through ``row_block``, each row's scale row; it is None (no memory, no lookup)
    whenever the plain rule holds, which is every unfused matrix and every fusion of whole blocks."""

    codes: torch.Tensor  # float8_e4m3fn [..., rows, cols]
    scale: torch.Tensor  # float32 [..., scale_rows, ceil(cols / block_cols)]
    block_rows: int
    block_cols: int
    row_block: torch.Tensor | None = None  # int64 [rows], shared by every expert of a stack

    def row_dims(self) -> dict[str, int]:
        return {"codes": -2}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scale) + (() if self.row_block is None else (self.row_block,))

    def _settings(self) -> tuple:
        return self.block_rows, self.block_cols

    def scale_rows(self, r0: int, r1: int) -> torch.Tensor:
        """The scale row of each of rows ``r0 .. r1``."""
        if self.row_block is not None:
            return self.row_block[r0:r1]
        return torch.arange(r0, r1, device=self.scale.device) // self.block_rows

    def tile(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        scale = self.scale[self.scale_rows(r0, r1)].repeat_interleave(self.block_cols, dim=-1)[:, : self.cols]
        return (self.codes[r0:r1].float() * scale).to(dtype)

    def __getitem__(self, expert: int) -> "FP8BlockWeight":
        return replace(self, codes=self.codes[expert], scale=self.scale[expert])

    def take_rows(self, rows: torch.Tensor) -> "FP8BlockWeight":
        return replace(self, rows=rows.numel(), codes=self.codes.index_select(-2, rows),
                       row_block=self.scale_rows(0, self.rows)[rows])

    def row_range(self, r0: int, r1: int) -> "FP8BlockWeight":
        if self.row_block is None and r0 % self.block_rows == 0:
            b0, b1 = r0 // self.block_rows, -(-r1 // self.block_rows)
            return replace(self, rows=r1 - r0, codes=self.codes[..., r0:r1, :], scale=self.scale[..., b0:b1, :])
        return replace(self, rows=r1 - r0, codes=self.codes[..., r0:r1, :], row_block=self.scale_rows(r0, r1))

    def cat_rows(self, others: list[QuantWeight]) -> "FP8BlockWeight":
        """Scales concatenate by their rows; a part that ends mid-block (not the last) makes a ``row_block`` map
        with each part's rows pointing past the earlier parts' scale rows."""
        parts: list[FP8BlockWeight] = [self, *others]  # type: ignore[list-item]
        fused = super().cat_rows(others)
        scale = torch.cat([w.scale for w in parts], dim=-2)
        if all(w.row_block is None for w in parts) and all(w.rows % self.block_rows == 0 for w in parts[:-1]):
            return replace(fused, scale=scale, row_block=None)
        maps, total = [], 0
        for w in parts:
            maps.append(w.scale_rows(0, w.rows) + total)
            total += w.scale.shape[-2]
        return replace(fused, scale=scale, row_block=torch.cat(maps))


@dataclass(frozen=True)
class FP8RowWeight(QuantWeight):
    """e4m3 codes with one float32 scale per output row (per-channel), or one for the whole tensor
    expanded to every row (per-tensor): compressed-tensors' ``float-quantized`` FP8."""

    codes: torch.Tensor  # float8_e4m3fn [..., rows, cols]
    scale: torch.Tensor  # float32 [..., rows]

    def row_dims(self) -> dict[str, int]:
        return {"codes": -2, "scale": -1}

    def tile(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes[r0:r1].float() * self.scale[r0:r1, None]).to(dtype)


@dataclass(frozen=True)
class Int4GroupWeight(QuantWeight):
    """4-bit integers, eight per int32 word along the input dim (element ``i`` of a word at bits
    ``4i .. 4i+3``, stored as ``q + 8``), one scale per ``group`` inputs of a row and, when
    asymmetric, one zero point there: ``w = (q - zero) * scale`` (compressed-tensors ``pack-quantized``,
    Kimi-K2-Thinking and K2.5's experts)."""

    packed: torch.Tensor  # int32 [..., rows, ceil(cols / 8)]
    scale: torch.Tensor  # [..., rows, cols / group] in the checkpoint's dtype (bf16 for Kimi)
    zero: torch.Tensor | None  # int8 [..., rows, cols / group], or None (symmetric)
    group: int

    def row_dims(self) -> dict[str, int]:
        return {"packed": -2, "scale": -2, "zero": -2}

    def _settings(self) -> tuple:
        return (self.group,)

    def tile(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int4(self.packed[r0:r1], self.cols).float()
        if self.zero is not None:
            q = q - self.zero[r0:r1].float().repeat_interleave(self.group, dim=-1)[:, : self.cols]
        scale = self.scale[r0:r1].float().repeat_interleave(self.group, dim=-1)[:, : self.cols]
        return (q * scale).to(dtype)


@dataclass(frozen=True)
class MXFP4Weight(QuantWeight):
    """OCP MXFP4: e2m1 codes, two a byte (element ``2i`` in the low nibble), and one E8M0 scale byte per 32
    inputs: ``w = e2m1(code) * 2^(scale - 127)`` (compressed-tensors ``mxfp4-pack-quantized``; gpt-oss's
    ``_blocks``/``_scales`` hold the same bytes with the 16 bytes of a group on a dim of their own)."""

    packed: torch.Tensor  # uint8 [..., rows, cols / 2]
    scale: torch.Tensor  # uint8 [..., rows, cols / 32]

    GROUP = 32

    def row_dims(self) -> dict[str, int]:
        return {"packed": -2, "scale": -2}

    def tile(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        b = self.packed[r0:r1]
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(r1 - r0, -1)
        values = E2M1_VALUES.to(b.device)[codes.long()]
        scale = torch.exp2(self.scale[r0:r1].float() - 127.0).repeat_interleave(self.GROUP, dim=-1)
        return (values * scale).to(dtype)


GGML_KINDS = ("q4_0", "q4_1", "q8_0")  # in the C++ kernel's numbering


@dataclass(frozen=True)
class GGMLBlockWeight(QuantWeight):
    """A GGUF tensor's rows as llama.cpp stores them: each row a run of blocks of 32 weights, a block an fp16
    scale ``d`` (and for ``q4_1`` an fp16 minimum ``m``) before its codes. ``q8_0``: 32 int8 ``q``,
    ``w = d * q``; ``q4_0``: 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31,
    ``w = d * (q - 8)``; ``q4_1``: the same nibbles, ``w = d * q + m`` (ggml's ``dequantize_row_*``)."""

    data: torch.Tensor  # uint8 [..., rows, cols / 32 * block_bytes]
    kind: str  # "q4_0", "q4_1" or "q8_0"

    GROUP = 32
    BLOCK_BYTES = dict(zip(GGML_KINDS, (18, 20, 34)))

    def row_dims(self) -> dict[str, int]:
        return {"data": -2}

    def _settings(self) -> tuple:
        return (self.kind,)

    def tile(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        n = r1 - r0
        blocks = self.data[r0:r1].reshape(n, self.cols // self.GROUP, self.BLOCK_BYTES[self.kind])
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.kind == "q8_0":
            w = d * blocks[..., 2:].contiguous().view(torch.int8).float()
        else:
            qs = blocks[..., 4:] if self.kind == "q4_1" else blocks[..., 2:]
            q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()
            if self.kind == "q4_0":
                w = d * (q - 8.0)
            else:
                w = d * q + blocks[..., 2:4].contiguous().view(torch.float16).float()
        return w.reshape(n, self.cols).to(dtype)


# e2m1: sign, two exponent bits, one mantissa bit (code 8 is -0)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 words of eight nibbles (little end first, each ``q + 8``) -> int8 ``q`` in [-8, 7]: [rows, cols]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(*packed.shape[:-1], -1)[..., :cols] - 8).to(torch.int8)


def unpack_int4_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The same packing along dim 0 (compressed-tensors packs zero points so): [ceil(rows/8), n] -> [rows, n]."""
    return unpack_int4(packed.transpose(0, 1).contiguous(), rows).transpose(0, 1).contiguous()


def cat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """One weight holding the rows of ``weights`` in order (same encoding, same columns): a fused q/k/v or
    gate/up, each row keeping its own scales."""
    return weights[0].cat_rows(weights[1:])


def stack_experts(weights: list[QuantWeight]) -> QuantWeight:
    """Per-expert weights of one shape and encoding stacked into one [E, rows, cols] weight."""
    first = weights[0]
    if any(type(w) is not type(first) or w.shape != first.shape or w._settings() != first._settings() for w in weights):
        raise ValueError("cannot stack experts of different encodings, shapes or settings")
    fields = {f: torch.stack([getattr(w, f) for w in weights]) for f in first._present()}
    if isinstance(first, FP8BlockWeight):  # the block scales are per expert too; a row_block map is shared
        fields["scale"] = torch.stack([w.scale for w in weights])  # type: ignore[attr-defined]
    return replace(first, **fields)
