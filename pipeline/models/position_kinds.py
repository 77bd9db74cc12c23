"""Position kinds: what a token's position is to RoPE, one object per kind.

1-D RoPE rotates by a token's index; NoPE (Kimi-Linear's MLA) rotates nothing. M-RoPE (Qwen-VL) gives image tokens their place in the image: three
axes (temporal, height, width), each with its own share of the frequencies, in runs (Qwen2.5-VL) or taking
turns frequency by frequency (Qwen3-VL). The rope *type* (default, linear, llama3, yarn) is the config's
and ``kernels.rope``'s business; a kind says which axes there are and reads their split (``resolve``).
Torch-free, like the other kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError


@dataclass(frozen=True)
class PositionKind:
    name: str
    axes: int = 1  # 1: a token's index; 3: (t, h, w), M-RoPE; 0: none (attention is blind to order but for the mask)
    interleaved: bool = False  # M-RoPE axes take turns frequency by frequency (else the config's ``mrope_interleaved``)

    def resolve(self, tc: dict[str, Any], rope_dim: int) -> dict[str, Any]:
        """``TextConfig``'s M-RoPE fields from a text config, checked against the rotated head: {} for 1-D."""
        if self.axes == 1:
            return {}
        if self.axes == 0:
            return {"rope": False}
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        section = tuple(int(s) for s in rope.get("mrope_section") or ())
        if len(section) != self.axes or sum(section) != rope_dim // 2:
            raise ModelConfigError(f"mrope_section {list(section)} must be {self.axes} counts summing to head_dim / 2 "
                                   f"= {rope_dim // 2}")
        return {"mrope_section": section, "mrope_interleaved": self.interleaved or bool(rope.get("mrope_interleaved", False))}


ROPE = PositionKind("RoPE")
MROPE = PositionKind("M-RoPE", axes=3)  # Qwen2.5-VL: t/h/w in runs
MROPE_INTERLEAVED = PositionKind("M-RoPE", axes=3, interleaved=True)  # Qwen3-VL
NOPE = PositionKind("none (NoPE)", axes=0)  # Kimi-Linear: its MLA layers rotate nothing, the linear layers carry order
