"""An image's cost is read off its header before any pixel is decoded (``ImageCost``): its token count
equals what preprocessing makes of it, for every native-resolution and anyres model, size and pixel range;
a prompt too long for its images is refused without a pixel decoded; and the pixel budget reserves what the
processor will hold, so an image upscaled to millions of pixels counts at its resized size."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
from PIL import Image

from helpers import build
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.intake import PromptTooLongError
from strata.pipeline.models.model_config import load_model_config
from strata.stages.image_preprocessing import image_preprocessor
from strata.stages.pixel_budget import PixelBudget

SIZES = [(64, 48), (640, 480), (333, 1000), (1024, 1024), (4032, 3024), (17, 2900)]


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (30, 90, 150)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from strata.checkpoints.tiny_kimi import build_tiny_kimi_k25
    from strata.checkpoints.tiny_llava_onevision import build_tiny_llava_onevision
    from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen2_5_vl

    root = tmp_path_factory.mktemp("image-cost")
    return {"qwen2_5_vl": build_tiny_qwen2_5_vl(root / "qwen"), "kimi_k25": build_tiny_kimi_k25(root / "kimi"),
            "llava_onevision": build_tiny_llava_onevision(root / "ov")}


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "kimi_k25", "llava_onevision"])
def test_the_header_count_is_the_preprocessed_count(models: dict[str, Path], arch: str) -> None:
    pre = image_preprocessor(models[arch], load_model_config(models[arch]), max_pixels=4096 * 4096)
    ranges = [None, {"max_pixels": 1 << 20}, {"min_pixels": 200_000, "max_pixels": 400_000}] if arch == "qwen2_5_vl" else [None]
    for width, height in SIZES:
        image = _png(width, height)
        for kwargs in ranges:
            cost = pre.cost(image, kwargs)
            assert cost.num_tokens == pre.process(image, None, kwargs).num_tokens, (arch, width, height, kwargs)
            assert cost.pixels >= width * height


def test_a_prompt_too_long_for_its_images_decodes_no_pixel(models: dict[str, Path], monkeypatch) -> None:
    """Two 64x48 PNGs asked to become 16.7 M pixels each (21,000 tokens apiece): refused by the header count,
    and preprocessing never ran (it used to grow the process by 1-2 GiB first)."""
    engine = build(models["qwen2_5_vl"], max_model_len=4096)
    ran: list[int] = []
    original = engine.preprocessor.process
    monkeypatch.setattr(engine.preprocessor, "process", lambda *a, **k: (ran.append(1), original(*a, **k))[1])
    huge = {"min_pixels": 4096 * 4096, "max_pixels": 4096 * 4096}
    with pytest.raises(PromptTooLongError, match="of them for images"):
        engine.add_request("What is it?", images=[_png(64, 48), _png(64, 48)], params=SamplingParams(max_tokens=4),
                           mm_processor_kwargs=huge)
    assert ran == []


def test_the_budget_holds_an_upscaled_image_at_its_resized_size(models: dict[str, Path]) -> None:
    """A 64x48 PNG resized to 1 M pixels reserves 1 M pixels (not its 3,072 decoded ones): four at once under a
    budget of two such images run at most two at a time."""
    budget = PixelBudget(2 * (1 << 20), timeout_s=60)
    pre = image_preprocessor(models["qwen2_5_vl"], load_model_config(models["qwen2_5_vl"]), max_pixels=1 << 20,
                             pixel_budget=budget)
    kwargs = {"min_pixels": 1 << 20, "max_pixels": 1 << 20}
    resized = pre.cost(_png(64, 48), kwargs).pixels
    assert resized > 900_000
    threads = [threading.Thread(target=pre.process, args=(_png(64, 48), None, kwargs)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert resized <= budget.peak <= budget.capacity and budget.in_use == 0
