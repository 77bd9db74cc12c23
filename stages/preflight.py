"""What a server checks about a checkpoint before it starts anything (no cluster, no weights read).

Each stage would find these faults too, but only once a cluster is up and a replica is loading, where a bad
``config.json`` used to surface as a start-up timeout. Here they are one line each, before Ray starts:
the config's sizes (``models.config_values``), the layers the weights hold, a tokenizer that loads, a chat
template that renders a one-message conversation within its bounds, and an image processor whose patch
geometry is the vision tower's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.models.model_loader import check_layers_in_weights
from strata.stages.native_preprocessor import check_processor


def check_checkpoint(model_dir: str | Path, chat_template: str | None = None, template_timeout_s: float = 5.0) -> None:
    """ValueError (a ModelConfigError, one line) for the first fault of the checkpoint in ``model_dir``."""
    cfg = load_model_config(model_dir)
    check_layers_in_weights(model_dir, cfg)
    PromptTokenizer(model_dir, cfg, chat_template).check_template(template_timeout_s)
    if cfg.native_resolution:
        check_processor(_image_processor(model_dir), cfg.vision)


def check_model_engine(text: Any, engine: Any) -> None:
    """Everything a decoder's own layers refuse to run with, in one line, before it loads: ``text`` is the
    parsed ``TextConfig``, ``engine`` the engine settings (one stage's, with its tp)."""
    if text.linear is not None:
        check_linear_attention(engine)
    if text.dsa is not None:
        check_sparse_attention(engine)
    if text.compressed is not None:
        check_compressed_attention(engine)


def check_compressed_attention(engine: Any) -> None:
    """What DeepSeek-V4 does not run with yet, refused in one line before it loads."""
    from strata.pipeline.models.config_errors import ModelConfigError

    if engine.compile:
        raise ModelConfigError("DeepSeek-V4 runs eager (compile: false)")


def check_sparse_attention(engine: Any) -> None:
    """What DSA (DeepSeek-V3.2) does not run with yet: the MTP layer's own indexer is not wired."""
    from strata.pipeline.models.config_errors import ModelConfigError

    if engine.speculative is not None and engine.speculative.method == "mtp":
        raise ModelConfigError("a model with sparse attention (DSA) drafts with ngram only, not its MTP layer yet")


def check_linear_attention(engine: Any) -> None:
    """What a model with linear-attention layers (Qwen3-Next) does not run with yet, refused in one line
    before it loads: a recurrence cannot take back a rejected draft. (An FP8 KV cache is fine: only the
    attention layers' blocks are e4m3.)"""
    from strata.pipeline.models.config_errors import ModelConfigError

    if engine.compile:
        raise ModelConfigError("a model with linear-attention layers runs eager (compile: false)")
    if engine.speculative is not None:
        raise ModelConfigError("a model with linear-attention layers decodes without speculation: a rejected "
                               "draft would stay in its recurrent state")


def _image_processor(model_dir: str | Path) -> Any:
    from transformers import AutoImageProcessor

    from strata.pipeline.models.config_errors import ModelConfigError

    try:
        return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers' many ways of saying the processor config is unusable
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelConfigError(f"the image processor cannot be loaded: {first}") from None
