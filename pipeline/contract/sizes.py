"""Memory sizes as people write them: "80GiB", "512MiB", "1073741824", and a memory budget that is either
a size or a share of what is free ("40%"). Shared by ``strata plan`` and the engine's ``kv_cache_memory``."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(I?B)?\s*$", re.IGNORECASE)
_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_size(text: str) -> int:
    """Bytes for "80GiB", "80G", "80GB", "512MiB", "1.5TiB", "0" or "123".

    Units are always binary, because device and host memory are sold and reported in
    powers of two: K, KB and KiB all mean 2^10, G/GB/GiB 2^30, and so on up to P.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit, e.g. 80GiB, 512MiB, 1.5TiB, 0")
    value = Fraction(match.group(1)) * 1024 ** _UNITS[match.group(2).upper()]
    if value.denominator != 1:
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """(bytes, None) for a size, (None, share in (0, 1]) for a percentage such as "40%"."""
    match = _SHARE_RE.match(str(text))
    if match:
        share = float(match.group(1)) / 100
        if not 0 < share <= 1:
            raise ValueError(f"invalid share {text!r}: expected a percentage in (0, 100]")
        return None, share
    try:
        size = parse_size(text)
    except ValueError:
        raise ValueError(f"invalid memory budget {text!r}: expected a size (4GiB, 512MiB, 1073741824) or a share "
                         "of the free memory (40%)") from None
    if size <= 0:
        raise ValueError(f"invalid memory budget {text!r}: it must be more than 0 bytes")
    return size, None
