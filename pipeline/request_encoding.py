"""Turn one request (a prompt, a chat, raw text or token ids, plus images) into checked prompt ids.

Shared by the in-process engine and the HTTP ingress, so both accept and refuse exactly the
same requests with the same messages.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer import EncodedPrompt, PromptTokenizer


class PromptTooLongError(ValueError):
    """Prompt plus requested output exceed the context limit (an HTTP 400 for API callers)."""


def encode_request(
    tokenizer: PromptTokenizer,
    config: EngineConfig,
    params: SamplingParams,
    num_images: int = 0,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    raw_prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
) -> EncodedPrompt:
    """Validate and tokenize; exactly one of prompt / messages / raw_prompt / prompt_token_ids."""
    params.validate()
    if sum(x is not None for x in (prompt, messages, raw_prompt, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages, raw_prompt or prompt_token_ids")
    if num_images > config.max_images_per_request:
        raise ValueError(f"at most {config.max_images_per_request} images per request, got {num_images}")
    if prompt_token_ids is not None:
        encoded = tokenizer.expand_ids(list(prompt_token_ids), num_images)
    else:
        if prompt is not None:
            if not prompt.strip() and not num_images:
                raise ValueError("prompt is empty")
            text = tokenizer.render_user_prompt(prompt, num_images)
        elif messages is not None:
            text = tokenizer.render_chat(messages)
        else:
            assert raw_prompt is not None
            text = raw_prompt
        encoded = tokenizer.encode(text, num_images)
    check_length(config, len(encoded.token_ids), params)
    return encoded


def check_length(config: EngineConfig, num_prompt: int, params: SamplingParams) -> None:
    if num_prompt == 0:
        raise ValueError("prompt is empty after tokenization")
    total = num_prompt + params.max_tokens
    if total > config.max_model_len:
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len {config.max_model_len}"
        )
    blocks = -(-total // config.block_size)
    if config.has_lower_tiers and config.enable_prefix_caching:
        # Older blocks can be spilled; the device only needs one chunk's working set.
        blocks = -(-config.prefill_chunk_tokens // config.block_size) + 1
    if blocks > config.num_kv_blocks:
        raise ValueError(f"request needs {blocks} KV blocks but the device pool holds {config.num_kv_blocks}")
