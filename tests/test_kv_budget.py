"""``kv_cache_memory``: a KV budget as a size or a share of free memory becomes the device pool's block
count (per tensor-parallel rank, so tp=2 over a GQA model holds twice the blocks); the budget is spent
once (the count crosses processes, not the budget); budgets that hold no block, or are not budgets, are
refused by name; an engine built with one allocates exactly that pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sizes import parse_budget
from strata.pipeline.models.model_config import load_model_config
from strata.stages.kv_budget import checkpoint_elements, free_memory, kv_layout, with_kv_budget


@pytest.mark.parametrize("text, expected", [("4GiB", (4 * 2**30, None)), ("512MiB", (512 * 2**20, None)),
                                            ("1073741824", (2**30, None)), ("40%", (None, 0.4)), ("100%", (None, 1.0))])
def test_a_budget_is_a_size_or_a_share(text: str, expected: tuple) -> None:
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["0", "0%", "150%", "lots", "-1GiB", "4 GiBs"])
def test_what_is_not_a_budget_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        parse_budget(text)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig.from_dict({"kv_cache_memory": text})


def test_a_size_sets_the_block_count_per_rank(text_models: dict[str, Path]) -> None:
    model = text_models["qwen2"]  # 2 KV heads: tp=2 gives each rank one, half the bytes per block
    text = load_model_config(model).text
    per_block = kv_layout(text, 16, torch.float32).bytes_per_block()
    sized = with_kv_budget(EngineConfig(kv_cache_memory="1MiB"), model, text)
    assert sized.num_kv_blocks == 2**20 // per_block and sized.kv_cache_memory is None
    assert with_kv_budget(EngineConfig(kv_cache_memory="1MiB", tp=2), model, text).num_kv_blocks == \
        2 * sized.num_kv_blocks
    bf16 = with_kv_budget(EngineConfig(kv_cache_memory="1MiB", dtype="bfloat16"), model, text)
    assert bf16.num_kv_blocks == 2 * sized.num_kv_blocks
    with pytest.raises(ValueError, match=f"holds no KV block: a block of 16 tokens takes {per_block} bytes"):
        with_kv_budget(EngineConfig(kv_cache_memory=str(per_block - 1)), model, text)
    assert with_kv_budget(EngineConfig(num_kv_blocks=7), model, text).num_kv_blocks == 7  # no budget: as given


def test_a_share_is_of_the_memory_the_weights_leave(text_models: dict[str, Path]) -> None:
    model = text_models["qwen2"]
    text = load_model_config(model).text
    per_block = kv_layout(text, 16, torch.float32).bytes_per_block()
    weights = checkpoint_elements(model) * 4
    assert weights == 4 * sum(p.numel() for p in _reference_params(model))
    before = free_memory("cpu")
    blocks = with_kv_budget(EngineConfig(kv_cache_memory="1%"), model, text).num_kv_blocks
    after = free_memory("cpu")
    low, high = sorted((before, after))
    assert int((low - weights) * 0.01) // per_block - 64 <= blocks <= int((high - weights) * 0.01) // per_block + 64


def _reference_params(model: Path):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict().values())


def test_an_engine_allocates_the_budgeted_pool(text_models: dict[str, Path]) -> None:
    model = text_models["llama"]
    engine = build(model, kv_cache_memory="256KiB")
    per_block = kv_layout(load_model_config(model).text, 16, torch.float32).bytes_per_block()
    assert engine.kv.pool.stats()["total"] == 256 * 1024 // per_block
    out = engine.generate([{"prompt": "Hello", "params": None}])[0]
    assert out.error is None and out.output_token_ids
