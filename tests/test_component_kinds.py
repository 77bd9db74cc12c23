"""Components are kinds, not strings: no code outside a kind's own module compares a component's name
(``family.attention == "mla"``, ``arch.vision in (...)``), so a new kind is one object and the families
that use it, never a hunt through the loader, the shard plan and ``strata ops``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

# attributes that hold a component; comparing one with a string literal is what the kinds replaced
COMPONENT_FIELDS = {"attention", "positions", "router", "vision", "projector", "experts", "expert_kind", "activation"}
ROOMS = ("pipeline", "stages", "strata", "deployments", "kernels", "kvstore")


def _is_text(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(map(_is_text, node.elts))


def name_comparisons(paths: list[Path]) -> list[str]:
    """``file:line`` of every comparison of a component attribute with a string (or strings)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            fields = [s for s in sides if isinstance(s, ast.Attribute) and s.attr in COMPONENT_FIELDS]
            if fields and any(_is_text(s) for s in sides):
                found.append(f"{path.relative_to(path.parents[1])}:{node.lineno}")
    return found


def _sources() -> list[Path]:
    return [p for room in ROOMS for p in sorted((REPO / room).rglob("*.py"))
            if not p.name.endswith("_kinds.py") and ".venv" not in p.parts]


def test_no_component_is_compared_by_name_outside_its_kind() -> None:
    assert name_comparisons(_sources()) == []


def test_kinds_never_import_the_registry_nor_torch() -> None:
    """A kind is read by bring-up, the shard plan and the planner without building a model or a registry."""
    kinds = sorted((REPO / "pipeline" / "models").glob("*_kinds.py"))
    assert {p.stem for p in kinds} >= {"attention_kinds", "expert_kinds", "position_kinds", "router_kinds",
                                       "vision_kinds"}
    for path in kinds:
        imported = {alias.name if isinstance(node, ast.Import) else node.module or ""
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        assert not any(name.startswith("torch") or name.endswith("architectures") for name in imported), path.name


def test_the_name_check_finds_a_comparison(tmp_path: Path) -> None:
    room = tmp_path / "room"
    room.mkdir()
    (room / "loader.py").write_text('def f(family, arch):\n    if family.attention == "mla":\n        return 1\n'
                                    '    return arch.vision in ("clip", "moonvit") or family.router is None\n')
    assert name_comparisons([room / "loader.py"]) == ["room/loader.py:2", "room/loader.py:4"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "glm4_moe", "gpt_oss", "minimax_m2", "deepseek_v3"])
def test_each_attention_kind_counts_the_parameters_its_module_holds(family: str) -> None:
    """The kind's count (what the planner sizes) equals the torch module the decoder builds for it, and its
    tensor-parallel split gives each rank of two exactly its local module's shapes."""
    from strata.pipeline.models.decoder import ATTENTION_MODULES
    from strata.pipeline.parallel.shard_plan import ShardPlan
    from strata.pipeline.models.text_config import parse_text_config

    tc = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256, "attention_bias": True,
          "use_qk_norm": True, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 16}
    if family == "deepseek_v3":
        tc["attention_bias"] = False
    cfg = parse_text_config(tc, family)
    for plan in [ShardPlan(cfg, 0, 1), *(ShardPlan(cfg, r, 2) for r in range(2))]:
        local = plan.local_config()
        module = ATTENTION_MODULES[cfg.attention.module](local, 0)
        proj, kv_b, other = cfg.attention.params(cfg, plan.heads[1] - plan.heads[0], plan.kv_heads[1] - plan.kv_heads[0])
        assert sum(p.numel() for p in module.parameters()) == proj + kv_b + other
        for name, param in module.named_parameters():
            full = ATTENTION_MODULES[cfg.attention.module](cfg, 0).get_parameter(name)
            cut = plan.slice_for(f"layers.0.self_attn.{name}")
            shape = list(full.shape)
            if cut is not None:
                dim, lo, hi = cut
                shape[dim] = hi - lo
            assert shape == list(param.shape), (family, plan.rank, name)
