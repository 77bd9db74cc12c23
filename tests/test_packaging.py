"""Both install paths give one import package, ``strata``: the wheel (into a fresh venv) and the
editable install the Makefile makes. Nothing generic (``kernels``, ``pipeline``...) lands in
site-packages, and Ray workers of a separately started cluster import the same package."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

from helpers import REPO, run_python

pytestmark = pytest.mark.slow
ROOM_NAMES = ("kernels", "kvstore", "pipeline", "stages", "deployments", "loadtest")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy of the files git knows (setuptools leaves a build/ folder behind, and a stale
    # one would put deleted modules into the wheel); no build isolation: nothing is downloaded.
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(out), "-q"], capture_output=True, text=True, timeout=300,
                         cwd=out)
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = out.glob("strata-*.whl")
    return path


def test_the_wheel_holds_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"strata", next(t for t in tops if t.endswith(".dist-info"))}
    assert "strata/kernels/attention_torch.py" in names and "strata/pipeline/core/engine.py" in names
    assert "strata/deployments/ray_serve/grafana/strata_dashboard.json" in names
    assert not any(n.startswith("strata/tests/") or "/tests/" in n for n in names)


def test_load_test_and_plot_packages_are_extras_not_runtime_dependencies(wheel: Path) -> None:
    """A plain `pip install strata` stays lean: locust, matplotlib, the openai client and psutil come only
    with the `bench` (or `test`) extra."""
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    for package in ("locust", "matplotlib", "openai", "psutil"):
        lines = [r for r in requires if r.split(">")[0].split("=")[0].split(";")[0].strip() == package]
        assert lines and all("extra ==" in r for r in lines), (package, lines)
    assert any(r.startswith("ray[serve]") and "extra" not in r for r in requires)


def test_a_command_missing_its_extra_says_what_to_install(monkeypatch, capsys, tmp_path: Path) -> None:
    """`strata bench serve --sweep` without matplotlib: one line naming the extra, exit 2."""
    import sys as _sys

    from strata.cli import main

    monkeypatch.setitem(_sys.modules, "matplotlib", None)  # as if it were not installed
    from strata.loadtest.bench import plot_sweep

    def sweep(args):
        plot_sweep([], tmp_path)
        return 0

    monkeypatch.setattr("strata.loadtest.bench.run", sweep)  # the sweep's plotting step, without a server
    code = main(["bench", "serve", "--sweep", "1", "--result-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "strata: error: this command needs the optional package matplotlib: pip install 'strata[bench]'"


def test_the_wheel_installs_and_runs_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # The fresh venv sees the main venv's packages (torch, ray, ...) through a .pth line: nothing is downloaded.
    (site / "main-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--ignore-installed", str(wheel)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not any((site / name).exists() for name in ROOM_NAMES), sorted(p.name for p in site.iterdir())
    help_ = subprocess.run([str(venv / "bin" / "strata"), "--help"], capture_output=True, text=True, timeout=120,
                           env=env, cwd=tmp_path)
    assert help_.returncode == 0 and "serve" in help_.stdout, help_.stderr
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import strata.pipeline, strata.kernels; print(strata.pipeline.__file__)"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(site)
    # The serving path needs none of the bench extra: with those packages made unimportable, the
    # server's modules load and `strata serve --help` answers.
    lean = subprocess.run([str(venv / "bin" / "python"), "-c", _WITHOUT_BENCH_EXTRA], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert lean.returncode == 0, lean.stderr[-3000:]
    assert "--config" in lean.stdout


_WITHOUT_BENCH_EXTRA = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("locust", "matplotlib", "openai"):  # (psutil comes with Ray itself)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
import strata.deployments.ray_serve.app, strata.deployments.ray_serve.ingress, strata.stages.factory
from strata.cli import main
try:
    main(["serve", "--help"])
except SystemExit as exc:
    sys.exit(exc.code)
"""


def test_the_editable_install_maps_the_rooms_into_strata() -> None:
    res = run_python("-c", "import json, strata.pipeline, strata.kernels; "
                     "print(json.dumps([strata.pipeline.__file__, strata.kernels.__file__]))")
    assert res.returncode == 0, res.stderr
    assert [Path(p) for p in json.loads(res.stdout)] == [REPO / "pipeline" / "__init__.py", REPO / "kernels" / "__init__.py"]
    # A room's name may belong to someone else's distribution there (transformers >= 5.25 brings Hugging
    # Face's `kernels`), never to ours.
    site = Path(sysconfig.get_paths()["purelib"])
    owners = importlib.metadata.packages_distributions()
    assert [name for name in ROOM_NAMES if (site / name).exists() and "strata" in owners.get(name, ["strata"])] == []
    res = subprocess.run([str(Path(sys.executable).with_name("strata")), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "generate" in res.stdout


def test_a_checkout_on_sys_path_leaves_the_name_kernels_to_hugging_face(tmp_path: Path) -> None:
    """`python -m` in a checkout puts its root first on sys.path, where the room `kernels/` would take the
    name of Hugging Face's `kernels`, which transformers >= 5.25 imports: every model import then failed."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'from-hugging-face'\n")
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    probe = "import kernels, strata.kernels; print(kernels.CUDAProperties, strata.kernels.rms_norm.__module__)"
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["from-hugging-face", "strata.kernels.norm"]
    # The real thing, with whatever transformers (and `kernels`) is installed.
    res = subprocess.run([sys.executable, "-c", "import transformers.activations, transformers.models.llama"],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


_WORKER_PROBE = """
import json, ray, sys
from ray.cluster_utils import Cluster

# A head node started apart from the driver (what `ray start --head` gives), joined by address.
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "temp_dir": sys.argv[1]})
try:
    ray.init(address=cluster.address, logging_level="ERROR")

    @ray.remote
    def probe():
        import sys
        import strata.stages.factory, strata.pipeline
        bare = sorted(m for m in sys.modules if m.split(".")[0] in %r)
        return strata.pipeline.__file__, bare

    print(json.dumps(ray.get(probe.remote())))
finally:
    ray.shutdown()
    cluster.shutdown()
""" % (ROOM_NAMES,)


def test_ray_workers_of_a_cluster_joined_by_address_import_the_same_package() -> None:
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        res = run_python("-c", _WORKER_PROBE, ray_temp, env=env, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        worker_file, bare = json.loads(res.stdout.strip().splitlines()[-1])
        assert Path(worker_file) == REPO / "pipeline" / "__init__.py" and bare == []
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
