"""Image preprocessing that reproduces transformers 5's CLIPImageProcessor (torchvision backend) bit for bit.

The model was trained on pixels produced by that processor, so any drift here (another resize kernel,
another crop rounding, another normalisation order) silently changes model outputs. Every step below
mirrors `transformers.image_processing_backends.TorchvisionBackend` for a single PIL input.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from strata.stages.pixel_budget import PixelBudget

logger = logging.getLogger(__name__)

# CLIPImageProcessor class defaults; transformers uses them for keys that are missing or null.
_CLIP_DEFAULTS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"shortest_edge": 224},
    "default_to_square": False,
    "resample": 3,  # PIL BICUBIC
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
}

# transformers' pil_torch_interpolation_mapping (note NEAREST -> NEAREST_EXACT). PIL BOX (4) and HAMMING (5)
# are left out: torchvision's tensor resize rejects them, so the HF processor cannot run with them either.
_INTERPOLATION = {0: "NEAREST_EXACT", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC"}


def _tvF() -> Any:
    """torchvision's functional transforms, imported at first use: importing torchvision imports its models
    and torch._dynamo (2 s of CPU), which every process importing this module (the CLI, each replica, an
    engine's child) would pay though only the one that resizes images needs it."""
    from torchvision.transforms.v2 import functional

    return functional


MAX_RESIZED_PIXELS = 4096 * 4096  # what resizing may produce (a CLIP input is ~336 x 336)


class ImageError(ValueError):
    """Undecodable, oversized or otherwise unusable image; message is safe to show a user."""


@dataclass(frozen=True)
class PreprocessedImage:
    pixel_values: np.ndarray  # float32 [3, H, W], or [patches, 3, p, p] at native resolution (numpy: zero-copy in Ray)
    content_hash: bytes  # blake2b(digest_size=16) of the raw image bytes
    grid_thw: tuple[int, int, int] | None = None  # native resolution: (frames, patch rows, patch columns)
    num_tokens: int = 0  # native resolution: the language-model tokens this image becomes (0: the model's fixed count)
    image_size: tuple[int, int] | None = None  # anyres (LLaVA-OneVision): the image's (height, width) before tiling


@dataclass(frozen=True)
class ImageCost:
    """What an image will cost, from its header and the processor's settings alone (nothing decoded): the
    tokens it becomes, so a prompt too long for its images is refused before any pixel exists, and the most
    pixels preprocessing holds for it at once (decoded or resized, whichever is more: a 64x48 PNG resized
    to 16.7 M pixels costs the latter), which it reserves in the replica's pixel budget."""

    num_tokens: int
    pixels: int


class Preprocessor:
    """Turns raw image bytes into model pixel values exactly as the checkpoint's processor config says."""

    def __init__(self, processor_config: dict, max_pixels: int = 4096 * 4096,
                 pixel_budget: PixelBudget | None = None) -> None:
        """``pixel_budget``: shared by the threads that call :meth:`process` (a serving replica), it
        bounds the decoded pixels they hold at once; None decodes without waiting (one caller)."""
        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
        if pixel_budget is not None and pixel_budget.capacity < max_pixels:
            raise ValueError(f"the pixel budget ({pixel_budget.capacity}) must hold one image at the pixel cap "
                             f"({max_pixels}), or such an image could never be decoded")
        self.max_pixels = max_pixels
        self.pixel_budget = pixel_budget
        cfg = {key: processor_config.get(key) for key in _CLIP_DEFAULTS}
        cfg = {key: _CLIP_DEFAULTS[key] if value is None else value for key, value in cfg.items()}
        kind = processor_config.get("image_processor_type", "")
        if kind and not kind.startswith("CLIPImageProcessor"):
            logger.warning("processor type %s: applying CLIPImageProcessor semantics and defaults", kind)
        if processor_config.get("do_pad"):
            raise ValueError("do_pad is not supported by this preprocessor")
        if processor_config.get("use_square_size"):  # KOSMOS-2 compat: CLIP squares its *class default* edge
            cfg["size"] = {"height": 224, "width": 224}

        self.do_convert_rgb = bool(cfg["do_convert_rgb"])
        self.do_resize = bool(cfg["do_resize"])
        self.size = _size_dict(cfg["size"], default_to_square=bool(cfg["default_to_square"]))
        self.interpolation = _interpolation(cfg["resample"])
        self.do_center_crop = bool(cfg["do_center_crop"])
        crop = _size_dict(cfg["crop_size"], default_to_square=True)
        if set(crop) != {"height", "width"}:
            raise ValueError(f"crop_size must have height and width, got {crop}")
        self.crop_size = (int(crop["height"]), int(crop["width"]))
        self.do_rescale = bool(cfg["do_rescale"])
        self.rescale_factor = float(cfg["rescale_factor"])
        self.do_normalize = bool(cfg["do_normalize"])
        self.mean, self.std = _normalisation(cfg, self.do_rescale, self.rescale_factor)
        logger.info("image preprocessor: %s", {k: v for k, v in vars(self).items() if k not in ("mean", "std")})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, max_pixels: int = 4096 * 4096,
                       pixel_budget: PixelBudget | None = None) -> Preprocessor:
        """Load the image-processor config the way transformers 5 does: nested processor_config.json first."""
        model_dir = Path(model_dir)
        nested = model_dir / "processor_config.json"
        if nested.is_file():
            image_config = _read_json(nested).get("image_processor")
            if isinstance(image_config, dict):
                return cls(image_config, max_pixels=max_pixels, pixel_budget=pixel_budget)
        flat = model_dir / "preprocessor_config.json"
        if flat.is_file():
            return cls(_read_json(flat), max_pixels=max_pixels, pixel_budget=pixel_budget)
        raise FileNotFoundError(f"no image processor config in {model_dir} (processor_config.json or preprocessor_config.json)")

    def process(self, image_bytes: bytes, deadline: float | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> PreprocessedImage:
        """Decode, convert, resize, crop and normalise one image; raises ImageError for unusable input
        (and for ``mm_processor_kwargs``: a fixed-size model's images take no per-request settings).

        With a pixel budget the image's pixels (known from its header) are reserved before it is
        decoded and given back once its pixel values are made: every full-size copy lives inside
        that window. ``deadline`` (``time.monotonic()``) bounds the wait for room; past it,
        :class:`~strata.stages.pixel_budget.PixelBudgetTimeout`."""
        if mm_processor_kwargs:
            raise ImageError(f"mm_processor_kwargs: this model's image processor takes none, got {sorted(mm_processor_kwargs)}")
        content_hash = hashlib.blake2b(image_bytes, digest_size=16).digest()
        header = _open(image_bytes, self.max_pixels)
        width, height = header.size
        reserve = nullcontext() if self.pixel_budget is None else self.pixel_budget.hold(width * height, deadline)
        with reserve:  # full-size buffers are dropped (del) before the reservation is given back
            image = _to_chw_uint8(_load(header), self.do_convert_rgb)
            del header
            if self.do_resize:
                height, width = image.shape[-2:]
                size = self._output_size(height, width)
                if size[0] * size[1] > MAX_RESIZED_PIXELS or min(size) < 1:  # e.g. 1 x 16M px: it would not fit
                    raise ImageError(f"image is {width}x{height}: its aspect ratio is too extreme to resize "
                                     "for this model")
                image = _tvF().resize(image, list(size), interpolation=self.interpolation, antialias=True)
            if self.do_center_crop:
                image = _center_crop(image, *self.crop_size)
            pixels = self._rescale_and_normalize(image)
            del image
            return PreprocessedImage(pixel_values=np.ascontiguousarray(pixels.numpy()), content_hash=content_hash)

    def _output_size(self, height: int, width: int) -> tuple[int, int]:
        """Target (height, width), using the same integer truncation as transformers."""
        size = self.size
        if "shortest_edge" in size and "longest_edge" in size:
            return _size_with_max(height, width, size["shortest_edge"], size["longest_edge"])
        if "shortest_edge" in size:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        return size["height"], size["width"]

    def _rescale_and_normalize(self, image: torch.Tensor) -> torch.Tensor:
        """transformers fuses rescale into normalize (mean/std pre-divided by the factor), all in fp32."""
        if self.do_normalize:
            return _tvF().normalize(image.to(torch.float32), self.mean, self.std)
        if self.do_rescale:
            return image * self.rescale_factor
        return image.to(torch.float32)


def _open(image_bytes: bytes, max_pixels: int) -> Image.Image:
    """Read the header with Pillow (lazy: nothing decoded yet), rejecting oversized images from it
    alone, before pixels are allocated."""
    if not image_bytes:
        raise ImageError("image is empty")
    try:
        image = Image.open(io.BytesIO(image_bytes))
    except Image.DecompressionBombError as exc:
        raise ImageError("image has too many pixels") from exc
    except Exception as exc:  # Pillow plugins raise many exception types on hostile input
        logger.debug("image open failed", exc_info=True)
        raise ImageError("could not decode image: unsupported or corrupt format") from exc
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}")
    return image


def _load(image: Image.Image) -> Image.Image:
    """Decode the pixels of an image :func:`_open` accepted."""
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise ImageError("image has too many pixels") from exc
    except Exception as exc:
        logger.debug("image decode failed", exc_info=True)
        raise ImageError("could not decode image: data is truncated or corrupt") from exc
    return image


def _to_chw_uint8(image: Image.Image, do_convert_rgb: bool) -> torch.Tensor:
    """RGB uint8 [3, H, W]; transparency is composited onto white, as transformers' convert_to_rgb does."""
    if do_convert_rgb:
        try:
            image = _convert_rgb(image)
        except Exception as exc:
            raise ImageError(f"could not convert image mode {image.mode} to RGB") from exc
    elif image.mode != "RGB":
        raise ImageError(f"image mode {image.mode} is not RGB and the model's processor does not convert it")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


def _convert_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(image: torch.Tensor, crop_height: int, crop_width: int) -> torch.Tensor:
    """Zero-pad (extra pixel on the right/bottom) when smaller than the crop, then crop at int((d - c) / 2.0)."""
    height, width = image.shape[-2:]
    if crop_width > width or crop_height > height:
        pad_w, pad_h = max(crop_width - width, 0), max(crop_height - height, 0)
        image = _tvF().pad(image, [pad_w // 2, pad_h // 2, (pad_w + 1) // 2, (pad_h + 1) // 2], fill=0)
        height, width = image.shape[-2:]
        if (height, width) == (crop_height, crop_width):
            return image
    top = int((height - crop_height) / 2.0)
    left = int((width - crop_width) / 2.0)
    return _tvF().crop(image, top, left, crop_height, crop_width)


def _size_with_max(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' get_size_with_aspect_ratio: shortest edge to `size` unless the long edge would exceed max."""
    raw_size = None
    short, long = float(min(height, width)), float(max(height, width))
    if long / short * size > max_size:
        raw_size = max_size * short / long
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    scale = raw_size if raw_size is not None else size
    if width < height:
        return int(scale * height / width), size
    return size, int(scale * width / height)


def _size_dict(value: Any, default_to_square: bool) -> dict[str, int]:
    """Legacy int / (h, w) sizes become dicts, as transformers' get_size_dict does."""
    if isinstance(value, int):
        return {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict):
        keys = set(value)
        if keys in ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}):
            return {key: int(v) for key, v in value.items()}
    raise ValueError(f"unsupported size in processor config: {value!r}")


def _interpolation(resample: Any) -> Any:
    """torchvision's InterpolationMode for a processor config's PIL resample code (or a mode given as one)."""
    modes = _tvF().InterpolationMode
    if isinstance(resample, modes):
        return resample
    if isinstance(resample, int) and resample in _INTERPOLATION:
        return modes[_INTERPOLATION[resample]]
    raise ValueError(f"unsupported resample in processor config: {resample!r}")


def _normalisation(cfg: dict[str, Any], do_rescale: bool, factor: float) -> tuple[Any, Any]:
    """Mean/std for tvF.normalize; when rescaling too they are scaled by 1/factor in fp32, like transformers."""
    mean = tuple(cfg["image_mean"]) if isinstance(cfg["image_mean"], (list, tuple)) else cfg["image_mean"]
    std = tuple(cfg["image_std"]) if isinstance(cfg["image_std"], (list, tuple)) else cfg["image_std"]
    if do_rescale:
        return torch.tensor(mean) * (1.0 / factor), torch.tensor(std) * (1.0 / factor)
    return mean, std


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not contain a JSON object")
    return data
