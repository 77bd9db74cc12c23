"""The identity of a model as its KV cache sees it: the root of every block hash.

A KV block means something only for the exact weights, configuration, image preprocessing, dtype
and block geometry that computed it. The host and disk tiers are shared by every model a user
runs, and they outlive the process, so the fingerprint covers all of it:

* the weights' content (SHA-256 of every shard, cached per file version by ``file_digest``), not
  their names and sizes, which two fine-tunes of one base share;
* ``config.json`` (an edited ``rope_theta`` changes every K), canonicalised so key order and
  whitespace do not matter;
* the processor configuration (``preprocessor_config.json``, ``processor_config.json``): image
  normalisation changes the image tokens' KV;
* dtype and the block layout (layers, KV heads, head dim, block size).

Tensor parallelism is deliberately not part of it: tiers only ever hold whole blocks (a group
gathers its ranks' heads before writing), so a block written by tp=2 means the same to tp=1.
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from strata.kvstore import KVLayout, model_fingerprint
from strata.pipeline.models.file_digest import file_sha256
from strata.pipeline.models.weights import shard_files

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "preprocessor_config.json", "processor_config.json")
_HASH_THREADS = 4  # hashlib releases the GIL: shards hash in parallel at disk speed


def weights_content_digest(model_dir: str | Path) -> str:
    """SHA-256 over (shard name, shard content SHA-256) of every weight file the checkpoint uses."""
    model_dir = Path(model_dir)
    shards = shard_files(model_dir)
    paths = [model_dir / s for s in shards]
    total = sum(p.stat().st_size for p in paths if p.is_file())
    if total > (1 << 30):
        log.warning("hashing %.1f GB of weights for the KV cache identity (once per checkpoint version; cached)",
                    total / 1e9)
    with ThreadPoolExecutor(min(_HASH_THREADS, max(1, len(paths)))) as pool:
        digests = list(pool.map(file_sha256, paths))
    h = hashlib.sha256(b"strata.weights.v2")
    for name, digest in zip(shards, digests):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def config_digest(model_dir: str | Path) -> str:
    """SHA-256 of the configuration files that change what a KV block holds (absent files count too)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(b"strata.config.v1")
    for name in CONFIG_FILES:
        path = model_dir / name
        if not path.is_file():
            h.update(f"{name}\0absent\n".encode())
            continue
        raw = path.read_bytes()
        try:
            canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
        except ValueError:
            canonical = raw  # not JSON: the loader refuses it anyway; any change still changes the digest
        h.update(f"{name}\0".encode() + hashlib.sha256(canonical).digest())
    return h.hexdigest()


def kv_fingerprint(model_dir: str | Path, model_type: str, dtype: str, layout: KVLayout,
                   kv_scales: list[tuple[float, float]] | None = None) -> bytes:
    """The root of every block hash of this model, as served with this dtype and block layout (and, for an
    FP8 cache, the per-layer scales its blocks were written with)."""
    described = {**layout.to_dict(), **({"kv_scales": [list(s) for s in kv_scales]} if kv_scales is not None else {})}
    return model_fingerprint(model_type, weights_content_digest(model_dir), dtype, layout.block_size,
                             config_digest=config_digest(model_dir), layout=json.dumps(described, sort_keys=True))
