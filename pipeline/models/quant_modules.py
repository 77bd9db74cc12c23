"""The modules that hold quantized weights: a linear layer and a stack of experts, in place of ours.

Built on the meta device like every module, they are swapped in for the dense ones the checkpoint
stores quantized (:func:`install`), before any weight is read; the loader then fills their
:class:`kernels.quant_weight.QuantWeight` from the format's tensors. Everything that multiplies by a
weight goes through :func:`kernels.linear`, which takes either kind, so the decoder's code is the same.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels import linear
from strata.kernels.quant_weight import QuantWeight
from strata.pipeline.models.weight_formats import WeightFormat


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept in its stored format (``weight``: a QuantWeight once loaded)."""

    def __init__(self, fmt: WeightFormat, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.weight: QuantWeight | None = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None, "a quantized linear used before its weights were loaded"
        return linear(x, self.weight, self.bias)

    def dense(self, dtype: torch.dtype) -> nn.Linear:
        """An ordinary linear of the dequantized weight (MLA's ``kv_b_proj``, split per head for absorption)."""
        assert self.weight is not None
        with torch.device(self.weight.device):
            out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype)
        out.weight = nn.Parameter(self.weight.dequantize(dtype), requires_grad=False)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)
        return out


class QuantEmbedding(nn.Module):
    """An embedding table kept in its stored format (a GGUF's ``q8_0`` token embeddings): a lookup widens
    only the rows it takes. Tied, the same weight is the LM head's (:func:`tie_lm_head`)."""

    def __init__(self, fmt: WeightFormat, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.fmt, self.num_embeddings, self.embedding_dim = fmt, num_embeddings, embedding_dim
        self.weight: QuantWeight | None = None
        self.dtype = torch.float32  # the model's compute dtype, set when the load finishes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None, "a quantized embedding used before its weights were loaded"
        flat = ids.reshape(-1)
        rows = self.weight.take_rows(flat).tile(0, flat.numel(), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)


def tie_lm_head(model: nn.Module) -> None:
    """``model.lm_head`` becomes a quantized linear over ``model.embed_tokens``' quantized weight."""
    embed = model.embed_tokens
    head = QuantLinear(embed.fmt, embed.embedding_dim, embed.num_embeddings, bias=False)
    head.weight = embed.weight
    model.lm_head = head


class QuantExperts(nn.Module):
    """Routed experts stacked like :class:`models.moe.MoEExperts` (gate_up [E, 2I, H], down [E, H, I]),
    each a QuantWeight of the stack."""

    def __init__(self, fmt: WeightFormat, num_experts: int, hidden: int, intermediate: int,
                 biases: tuple[nn.Parameter | None, nn.Parameter | None] = (None, None)) -> None:
        super().__init__()
        self.fmt, self.num_experts, self.hidden, self.intermediate = fmt, num_experts, hidden, intermediate
        self.gate_up_proj: QuantWeight | None = None
        self.down_proj: QuantWeight | None = None
        # gpt-oss's expert biases stay dense: the dense stack's own (meta) parameters, filled by name
        self.gate_up_proj_bias, self.down_proj_bias = biases


def quant_weights(model: nn.Module) -> dict[str, QuantWeight | None]:
    """Every quantized weight of ``model`` by name (None: not loaded yet)."""
    out: dict[str, QuantWeight | None] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            out[f"{name}.weight"] = module.weight
        elif isinstance(module, QuantExperts):
            out[f"{name}.gate_up_proj"], out[f"{name}.down_proj"] = module.gate_up_proj, module.down_proj
    return out


def install(model: nn.Module, formats: dict[str, WeightFormat]) -> None:
    """Swap the modules named in ``formats`` (our names: ``layers.3.self_attn.q_proj``,
    ``layers.3.mlp.experts``) for their quantized forms."""
    for name, fmt in formats.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        current = getattr(parent, leaf)
        if isinstance(current, nn.Linear):
            replacement: nn.Module = QuantLinear(fmt, current.in_features, current.out_features, current.bias is not None)
        elif isinstance(current, nn.Embedding):
            replacement = QuantEmbedding(fmt, current.num_embeddings, current.embedding_dim)
        elif isinstance(getattr(current, "gate_up_proj", None), torch.Tensor):  # a stack of experts (models.moe)
            e, two_i, h = current.gate_up_proj.shape
            biases = (getattr(current, "gate_up_proj_bias", None), getattr(current, "down_proj_bias", None))
            replacement = QuantExperts(fmt, e, h, two_i // 2, biases)
        else:
            raise ValueError(f"{name} is a {type(current).__name__}, which has no quantized form")
        setattr(parent, leaf, replacement)
