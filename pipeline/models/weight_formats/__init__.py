"""Weight formats as component kinds: FP8 blocks, FP8 per channel or tensor, INT4 groups, MXFP4, GGUF's
blocks (``format``, one module per format), and the ``quantization_config`` that says which a checkpoint
uses (``scheme``)."""

from strata.pipeline.models.weight_formats.format import WeightFormat, WeightFormatError
from strata.pipeline.models.weight_formats.fp8_block import FP8Block
from strata.pipeline.models.weight_formats.fp8_row import FP8Row
from strata.pipeline.models.weight_formats.ggml_block import GGMLBlock
from strata.pipeline.models.weight_formats.int4_group import Int4Group
from strata.pipeline.models.weight_formats.mxfp4 import MXFP4, MXFP4Experts
from strata.pipeline.models.weight_formats.scheme import QUANT_SUFFIXES, QuantScheme, is_quant_tensor, parse_quantization

__all__ = ["FP8Block", "FP8Row", "GGMLBlock", "Int4Group", "MXFP4", "MXFP4Experts", "QUANT_SUFFIXES", "QuantScheme", "WeightFormat",
           "WeightFormatError", "is_quant_tensor", "parse_quantization"]
