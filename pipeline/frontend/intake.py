"""Request intake, shared by the in-process engine and the HTTP ingress: a prompt (one user
message, a whole chat, raw text or token ids) plus image count in, a checked :class:`Request`
and the positions its image embeddings go to out. Both front doors accept and refuse exactly
the same requests with the same messages; only how they embed images differs (in this process,
or through the encoder deployments).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from typing import Sequence as Seq

import numpy as np

from strata.kvstore import blocks_for_tokens, chunk_working_set_blocks
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.request import ImageEmbedding, Request
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.grammar_sandbox import GrammarSandbox, sandbox_for
from strata.pipeline.parallel.fault_points import stall_point
from strata.pipeline.frontend.structured import check_limits, tokenizer_spec
from strata.pipeline.frontend.template_bounds import TemplateBoundError
from strata.pipeline.frontend.tokenizer import NO_IMAGES, EncodedPrompt, PromptTokenizer

log = logging.getLogger(__name__)
MAX_CHARS_PER_TOKEN = 32  # no tokenizer packs more than this into one token; longer texts cannot fit


class PromptTooLongError(ValueError):
    """Prompt plus requested output exceed the context limit (an HTTP 400 for API callers)."""


@dataclass
class Intake:
    tokenizer: PromptTokenizer
    config: EngineConfig
    default_max_tokens: int | None = None  # a checkpoint's max_new_tokens (``generation_defaults``), within the room

    def make_request(
        self,
        request_id: str,
        params: SamplingParams,
        num_images: int = 0,
        *,
        image_tokens: Seq[int] | None = None,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        raw_prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[Request, list[int]]:
        """Validate and tokenize exactly one of prompt / messages / raw_prompt / prompt_token_ids.

        ``tools`` (OpenAI function tools) are rendered by the chat template with ``messages``, and
        ``template_kwargs`` (the request's ``chat_template_kwargs``) are its variables.
        Returns the request (images not attached yet) and each image's placeholder offset. A request
        whose ``max_tokens`` is None may generate whatever room the context leaves (the OpenAI default
        when ``max_tokens`` is absent): it is set here, where the prompt's length is known.
        """
        params.validate()
        self.check_grammar(params)
        stall_point("tokenize")
        encoded = self._encode(params, num_images, image_tokens, prompt, messages, raw_prompt, prompt_token_ids, tools,
                               template_kwargs)
        in_images = sum(image_tokens) if image_tokens is not None else num_images * self.tokenizer.num_image_tokens
        check_length(self.config, len(encoded.token_ids), params, in_images)
        if params.max_tokens is None:
            room = max(1, self.config.max_model_len - len(encoded.token_ids))
            params.max_tokens = room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        if params.min_tokens > params.max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})")
        vocab = self.tokenizer.vocab_size
        trigger = [params.structured_trigger] if params.structured_trigger is not None else []
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                          ("structured_trigger", trigger)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{name} names token id {outside[0]}, outside the vocabulary (0..{vocab - 1})")
        return Request(request_id, encoded.token_ids, params), encoded.image_offsets

    def check_grammar(self, params: SamplingParams) -> None:
        """A structured-output spec measured here (``grammar_limits``), then compiled in the grammar sandbox
        against the vocabulary, once per spec: a ValueError (400) for one that is bad, too big, or crashes
        or outlasts ``grammar_timeout_s`` there. The first sight of a spec may take that long; the server
        calls this before it takes a tokenizing slot, so other requests are not held up behind it."""
        if params.structured is None:
            return
        stall_point("grammar")
        check_limits(*params.structured)
        self._sandbox().check(*params.structured)

    def warm_grammars(self) -> None:
        """Start the grammar sandbox now (a server's front door does, on a thread of its own, at start)."""
        try:
            self._sandbox().start()
        except Exception:  # noqa: BLE001 - the first constrained request reports it
            log.warning("the grammar sandbox did not start ahead; structured output will try again", exc_info=True)

    def _sandbox(self) -> GrammarSandbox:
        tok = self.tokenizer
        return sandbox_for(tok.model_dir, tok.vocab_size, self.config.grammar_timeout_s,
                           lambda: tokenizer_spec(tok.tokenizer))

    def grammar_stats(self) -> dict[str, int]:
        """What the grammar sandbox has done (``/strata/stats``): specs compiled and refused, its crashes
        and deadlines missed."""
        box = self._sandbox()
        return {"compiled": box.compiled, "refused": box.refused, "crashes": box.crashes, "timeouts": box.timeouts}

    def _encode(self, params: SamplingParams, num_images: int, image_tokens: Seq[int] | None, prompt: str | None,
                messages: list[dict[str, Any]] | None, raw_prompt: str | None,
                prompt_token_ids: list[int] | None, tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> EncodedPrompt:
        if sum(x is not None for x in (prompt, messages, raw_prompt, prompt_token_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages, raw_prompt or prompt_token_ids")
        if num_images and not self.tokenizer.takes_images:
            raise ValueError(NO_IMAGES)
        if num_images > self.config.max_images_per_request:
            raise ValueError(f"at most {self.config.max_images_per_request} images per request, got {num_images}")
        tok = self.tokenizer
        if prompt_token_ids is not None:
            return tok.expand_ids(list(prompt_token_ids), num_images, image_tokens)
        limit = check_prompt_chars(self.config.max_model_len, prompt if prompt is not None else raw_prompt, messages)
        # a render may write a few times the prompt limit before it is stopped (the length check below names
        # an over-long prompt as such; the bound stops a template that runs away)
        bounds = {"timeout_s": self.config.chat_template_timeout_s, "max_chars": 4 * limit}
        try:
            if prompt is not None:
                if not prompt.strip() and not num_images:
                    raise ValueError("prompt is empty")
                text = tok.render_user_prompt(prompt, num_images, **bounds)
            elif messages is not None:
                text = tok.render_chat(messages, tools=tools, template_kwargs=template_kwargs, **bounds)
        except TemplateBoundError as exc:
            if exc.bound == "output":  # what it wrote is already longer than any prompt may be
                raise PromptTooLongError(f"the rendered prompt is longer than {limit} characters ({MAX_CHARS_PER_TOKEN} "
                                         f"per token of max_model_len {self.config.max_model_len})") from None
            raise
        if prompt is None and messages is None:
            assert raw_prompt is not None
            text = raw_prompt
        if len(text) > limit:  # refused before tokenizing: a huge prompt costs nothing
            raise PromptTooLongError(f"prompt has {len(text)} characters; the limit is {limit} "
                                     f"({MAX_CHARS_PER_TOKEN} per token of max_model_len {self.config.max_model_len})")
        return tok.encode(text, num_images, image_tokens)


def check_prompt_chars(max_model_len: int, text: str | None = None, messages: list[dict[str, Any]] | None = None) -> int:
    """The prompt's character limit (``max_model_len`` x :data:`MAX_CHARS_PER_TOKEN`), and a PromptTooLongError
    when ``text``, or the text of ``messages`` (what any template renders at least), is over it: checked
    before rendering or tokenizing, so a huge prompt costs nothing."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    size = len(text) if text is not None else sum(_text_chars(m.get("content")) for m in messages or ())
    if size > limit:
        raise PromptTooLongError(f"prompt has {size} characters; the limit is {limit} "
                                 f"({MAX_CHARS_PER_TOKEN} per token of max_model_len {max_model_len})")
    return limit


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def attach_images(request: Request, offsets: list[int], features: Seq[np.ndarray], hashes: Seq[bytes],
                  grids: Seq[tuple[int, int, int] | None] | None = None) -> Request:
    """Put each image's embeddings (float32 [tokens, hidden]; with DeepStack [1 + levels, tokens, hidden], the
    input embeddings first) at its placeholder span, with its patch grid (native resolution: M-RoPE places
    the image's tokens by it)."""
    grids = list(grids) if grids is not None else [None] * len(offsets)
    images = []
    for off, f, h, g in zip(offsets, features, hashes, grids):
        f = np.asarray(f, dtype=np.float32)
        embeds, deep = (f[0], f[1:]) if f.ndim == 3 else (f, None)
        images.append(ImageEmbedding(off, embeds, h, tuple(g) if g is not None else None, deep))
    request.images = images
    return request


def check_length(config: EngineConfig, num_prompt: int, params: SamplingParams, image_tokens: int = 0) -> None:
    """``image_tokens``: how many of the prompt's tokens its images take (named in the refusal: an image
    at native resolution may cost thousands)."""
    if num_prompt == 0:
        raise ValueError("prompt is empty after tokenization")
    wanted = 1 if params.max_tokens is None else params.max_tokens  # None: at least one token of room
    total = num_prompt + wanted
    if total > config.max_model_len:
        of_images = f", {image_tokens} of them for images" if image_tokens else ""
        raise PromptTooLongError(f"prompt ({num_prompt} tokens{of_images}) + max_tokens ({wanted}) exceeds "
                                 f"max_model_len {config.max_model_len}")
    blocks = blocks_for_tokens(total, config.block_size)
    if config.has_lower_tiers and config.enable_prefix_caching:
        # Older blocks can be spilled; the device only needs one chunk's working set.
        blocks = chunk_working_set_blocks(config.prefill_chunk_tokens, config.block_size)
    if blocks > config.num_kv_blocks:
        raise ValueError(f"request needs {blocks} KV blocks but the device pool holds {config.num_kv_blocks}")
