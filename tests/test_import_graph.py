"""The rooms import one way (strata entry -> deployments -> stages -> pipeline -> kvstore -> kernels),
with no cycles, and every module is importable under exactly one name: ``strata.<room>...``."""

from __future__ import annotations

import ast
import json

from helpers import REPO, run_python
from import_graph import (DEPLOYMENT_ROOMS, PIPELINE_ROOMS, ROOMS, cycles, inner_room_of, inner_upward_imports,
                          pipeline_upward_imports, read_graph, room_of, upward_imports)


def test_no_room_imports_a_room_above_it() -> None:
    bad = upward_imports(read_graph(REPO))
    assert not bad, "upward imports:\n" + "\n".join(f"{i.source}:{i.line} -> {i.target} ({i.how})" for i in bad)


def test_the_rooms_inside_pipeline_import_one_way() -> None:
    """core -> frontend -> models -> parallel -> contract; every module of pipeline/ lives in one of them."""
    graph = read_graph(REPO)
    bad = pipeline_upward_imports(graph)
    assert not bad, "upward imports inside pipeline/:\n" + "\n".join(
        f"{i.source}:{i.line} -> {i.target} ({i.how})" for i in bad)
    loose = [m for m in graph.modules if m.startswith("strata.pipeline.") and m.split(".")[2] not in PIPELINE_ROOMS]
    assert not loose, f"modules of pipeline/ outside its rooms: {loose}"


def test_the_rooms_inside_deployments_import_one_way_and_the_openai_surface_imports_no_ray() -> None:
    """ray_serve -> openai, never back; every module of deployments/ lives in one of them; and the OpenAI
    surface imports no ``ray`` (so it is tested, and could be served, with no cluster)."""
    graph = read_graph(REPO)
    bad = inner_upward_imports(graph, "deployments", DEPLOYMENT_ROOMS)
    assert not bad, "\n".join(f"{i.source}:{i.line} -> {i.target} ({i.how})" for i in bad)
    loose = [m for m in graph.modules if room_of(m) == "deployments" and m != "strata.deployments"
             and inner_room_of(m, "deployments") not in DEPLOYMENT_ROOMS]
    assert not loose, f"modules of deployments/ outside its rooms: {loose}"
    surface = [m for m in graph.modules if inner_room_of(m, "deployments") == "openai"]
    offenders = [f"{m}:{node.lineno}" for m in surface for node in ast.walk(ast.parse(graph.modules[m].read_text()))
                 if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names))
                 or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray")]
    assert len(surface) >= 10 and not offenders, offenders


def test_the_openai_surface_imports_and_answers_with_no_ray_in_the_process() -> None:
    """Importing every module of the surface loads no ``ray`` at all (through pipeline/ and stages/ too)."""
    code = ("import sys, pkgutil, importlib, strata.deployments.openai as o\n"
            "for i in pkgutil.walk_packages(o.__path__, 'strata.deployments.openai.'): importlib.import_module(i.name)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_pipeline_checker_can_fail(tmp_path) -> None:
    for room, body in (("contract", "from strata.pipeline.core import engine\n"), ("core", "")):
        (tmp_path / "pipeline" / room).mkdir(parents=True)
        (tmp_path / "pipeline" / room / "__init__.py").write_text("")
        (tmp_path / "pipeline" / room / ("request.py" if room == "contract" else "engine.py")).write_text(body)
    (tmp_path / "pipeline" / "__init__.py").write_text("")
    bad = {(i.source, i.target) for i in pipeline_upward_imports(read_graph(tmp_path))}
    assert ("strata.pipeline.contract.request", "strata.pipeline.core.engine") in bad


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(read_graph(REPO)) == []


def test_the_reader_sees_function_level_and_importlib_imports(tmp_path) -> None:
    """The checker itself can fail: an upward import hidden in a function or a string is found."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "a.py").write_text(
        "import importlib\n\ndef f():\n    from strata.pipeline import engine\n    return importlib.import_module('stages.factory')\n")
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "engine.py").write_text("from strata.kernels import a\n")
    graph = read_graph(tmp_path)
    targets = {(i.target, i.how) for i in upward_imports(graph)}
    assert ("strata.pipeline", "from") in targets and ("strata.stages.factory", "importlib") in targets
    assert cycles(graph) == [["strata.kernels.a", "strata.pipeline.engine"]]


def test_ray_is_imported_only_in_deployments() -> None:
    graph = read_graph(REPO)
    offenders = []
    for module, path in graph.modules.items():
        if room_of(module) == "deployments":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{module}:{node.lineno}" for n in names if n.split(".")[0] == "ray"]
    assert not offenders, offenders


_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import strata
names = []
for info in pkgutil.walk_packages(strata.__path__, "strata."):
    names.append(info.name)
for name in ("strata.kernels", "strata.kvstore", "strata.pipeline", "strata.stages", "strata.deployments", "strata.loadtest"):
    pkg = importlib.import_module(name)
    names.append(name)
    names += [i.name for i in pkgutil.walk_packages(pkg.__path__, name + ".")]
for name in names:
    if name.endswith("locustfile") or name.endswith("__main__"):
        continue  # a locust script (gevent monkey-patching) and the CLI's `python -m` entry
    importlib.import_module(name)
bare = sorted(m for m in sys.modules if m.split(".")[0] in ("kernels", "kvstore", "pipeline", "stages", "deployments", "loadtest"))
files = {m: getattr(sys.modules[m], "__file__", None) for m in sys.modules if m.startswith("strata")}
print(json.dumps({"imported": len(set(names)), "bare": bare, "files": files}))
"""


def test_every_module_imports_under_the_strata_name_only() -> None:
    res = run_python("-c", _IMPORT_ALL)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bare"] == []
    assert out["imported"] >= 60
    # One file, one name: no source file is loaded twice under different module names.
    paths = [p for p in out["files"].values() if p]
    assert len(paths) == len(set(paths))
    assert set(ROOMS) - {"strata"} <= {m.split(".")[1] for m in out["files"] if m.count(".") >= 1}
