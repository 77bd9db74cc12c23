"""Preprocessor must match transformers' CLIPImageProcessor output exactly, and reject unusable images."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from strata.stages.preprocessor import ImageError, PreprocessedImage, Preprocessor

TOLERANCE = 1e-5


def _encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _noise(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "P":
        palette_image = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), mode="L")
        image = palette_image.convert("P")
        image.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tolist())
        return image
    channels = {"RGB": 3, "RGBA": 4, "LA": 2, "CMYK": 4}.get(mode)
    shape = (height, width) if channels is None else (height, width, channels)
    array = rng.integers(0, 256, shape, dtype=np.uint8)
    if mode == "LA":
        return Image.fromarray(array[..., 0], mode="L").convert("LA")
    return Image.frombytes(mode, (width, height), array.tobytes())


def _palette_with_transparency() -> Image.Image:
    image = _noise(40, 30, "P", seed=9)
    image.info["transparency"] = 5
    return image


SMALL_CASES = {
    "landscape_rgb": (_noise(57, 31, "RGB", 1), "PNG"),
    "portrait_rgb": (_noise(33, 80, "RGB", 2), "PNG"),
    "square_rgb": (_noise(64, 64, "RGB", 3), "PNG"),
    "smaller_than_crop": (_noise(13, 21, "RGB", 4), "PNG"),
    "rgba": (_noise(45, 50, "RGBA", 5), "PNG"),
    "grayscale": (_noise(70, 40, "L", 6), "PNG"),
    "gray_alpha": (_noise(39, 47, "LA", 7), "PNG"),
    "palette": (_noise(50, 36, "P", 8), "PNG"),
    "palette_transparency": (_palette_with_transparency(), "PNG"),
    "cmyk_jpeg": (_noise(48, 37, "CMYK", 10), "JPEG"),
    "jpeg": (_noise(61, 45, "RGB", 11), "JPEG"),
    "odd_aspect": (_noise(101, 33, "RGB", 12), "PNG"),
}


def _save_hf(tmp_path: Path, processor: transformers.CLIPImageProcessor) -> Path:
    processor.save_pretrained(tmp_path)
    return tmp_path


def _hf_pixels(processor: transformers.CLIPImageProcessor, data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        pixel_values = processor(images=image, return_tensors="pt")["pixel_values"]
    assert pixel_values.dtype == torch.float32
    return pixel_values[0].numpy()


def _assert_matches(ours: PreprocessedImage, expected: np.ndarray) -> None:
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == expected.shape
    assert float(np.abs(ours.pixel_values - expected).max()) <= TOLERANCE


@pytest.fixture(scope="module")
def small_processor() -> transformers.CLIPImageProcessor:
    return transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


@pytest.mark.parametrize("case", sorted(SMALL_CASES))
def test_matches_hf_small(case: str, small_processor, tmp_path: Path) -> None:
    image, fmt = SMALL_CASES[case]
    data = _encode(image, fmt)
    ours = Preprocessor.from_model_dir(_save_hf(tmp_path, small_processor)).process(data)
    _assert_matches(ours, _hf_pixels(small_processor, data))
    assert ours.pixel_values.shape == (3, 32, 32)


@pytest.mark.parametrize("case", ["landscape_rgb", "portrait_rgb", "rgba", "grayscale"])
def test_matches_hf_default_224(case: str, tmp_path: Path) -> None:
    processor = transformers.CLIPImageProcessor()
    image, fmt = SMALL_CASES[case]
    data = _encode(image.resize((image.width * 5, image.height * 5)), fmt)
    ours = Preprocessor.from_model_dir(_save_hf(tmp_path, processor)).process(data)
    _assert_matches(ours, _hf_pixels(processor, data))
    assert ours.pixel_values.shape == (3, 224, 224)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": {"height": 24, "width": 40}, "do_center_crop": False, "resample": 2},
        {"size": {"shortest_edge": 20}, "crop_size": {"height": 28, "width": 16}, "resample": 0},
        {"size": {"shortest_edge": 24}, "crop_size": {"height": 24, "width": 24}, "resample": 1},
        {"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30}, "do_normalize": False},
        {"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30}, "do_rescale": False},
        {"do_resize": False, "crop_size": {"height": 40, "width": 40}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
        {"size": {"shortest_edge": 20, "longest_edge": 30}, "do_center_crop": False},
    ],
)
def test_matches_hf_config_variants(kwargs: dict, tmp_path: Path) -> None:
    processor = transformers.CLIPImageProcessor(**kwargs)
    data = _encode(SMALL_CASES["odd_aspect"][0])
    ours = Preprocessor.from_model_dir(_save_hf(tmp_path, processor)).process(data)
    _assert_matches(ours, _hf_pixels(processor, data))


def test_reads_nested_processor_config(small_processor, tmp_path: Path) -> None:
    nested = {"image_processor": small_processor.to_dict(), "processor_class": "CLIPProcessor"}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    data = _encode(SMALL_CASES["portrait_rgb"][0])
    ours = Preprocessor.from_model_dir(tmp_path).process(data)
    _assert_matches(ours, _hf_pixels(small_processor, data))


def test_legacy_int_sizes() -> None:
    config = {"size": 32, "crop_size": 32}
    ours = Preprocessor(config).process(_encode(SMALL_CASES["landscape_rgb"][0]))
    assert ours.pixel_values.shape == (3, 32, 32)


def test_missing_config_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Preprocessor.from_model_dir(tmp_path)


def test_content_hash_stable_and_distinct() -> None:
    preprocessor = Preprocessor({"size": {"shortest_edge": 16}, "crop_size": {"height": 16, "width": 16}})
    first = _encode(SMALL_CASES["square_rgb"][0])
    second = _encode(SMALL_CASES["landscape_rgb"][0])
    assert preprocessor.process(first).content_hash == preprocessor.process(first).content_hash
    assert preprocessor.process(first).content_hash != preprocessor.process(second).content_hash
    assert len(preprocessor.process(first).content_hash) == 16


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"definitely not an image" * 10, "decode"),
        (_encode(_noise(40, 40, "RGB", 0))[:60], "decode"),  # truncated PNG
    ],
)
def test_bad_bytes_raise_image_error(data: bytes, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        Preprocessor({}).process(data)


def test_too_many_pixels_rejected() -> None:
    data = _encode(_noise(64, 64, "RGB", 0))
    with pytest.raises(ImageError, match="limit"):
        Preprocessor({}, max_pixels=64 * 64 - 1).process(data)
    Preprocessor({}, max_pixels=64 * 64).process(data)


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR (with a fixed CRC) claims width x height; its pixel data is absent."""
    data = bytearray(_encode(Image.new("L", (1, 1))))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


@pytest.mark.parametrize(("side", "message"), [(5_000, "limit"), (100_000, "too many pixels")])
def test_oversized_header_rejected_before_decode(side: int, message: str) -> None:
    """A header claiming a huge image is refused from the header alone (the data could never fill it)."""
    with pytest.raises(ImageError, match=message):
        Preprocessor({}).process(_png_claiming(side, side))


def test_invalid_config_rejected() -> None:
    with pytest.raises(ValueError, match="resample"):
        Preprocessor({"resample": 4})
    with pytest.raises(ValueError, match="size"):
        Preprocessor({"size": {"max_height": 10, "max_width": 10}})
