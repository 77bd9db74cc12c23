"""The checkpoint's own tokenizer and chat template, plus image-placeholder expansion."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from strata.pipeline.frontend.template_bounds import TemplateBoundError, render_bounded
from strata.pipeline.models.model_config import ModelConfig, ModelConfigError


NO_IMAGES = "this model takes no images: it is a text-only LLM (send text content only)"
RENDER_TIMEOUT_S = 5.0  # a chat template's render, at most (``EngineConfig.chat_template_timeout_s``)
RENDER_MAX_CHARS = 64 * 1024 * 1024  # and its output (the front door passes its prompt limit)
PROBE_CHAT = [{"role": "user", "content": "Hello!"}]  # what every chat template must render


@dataclass
class EncodedPrompt:
    token_ids: list[int]
    image_offsets: list[int]  # first placeholder position of each image, in order


class PromptTokenizer:
    """Renders chats with the model's template and tokenizes them exactly as its processor would."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, chat_template: str | None = None) -> None:
        """``chat_template``: a Jinja template replacing the checkpoint's (``strata serve --chat-template``)."""
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)  # where the tokenizer's files are (the grammar sandbox loads them too)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:  # transformers raises TypeError, ValueError, OSError ... for a bad tokenizer
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelConfigError(f"the tokenizer cannot be loaded (tokenizer.json, tokenizer_config.json): {first}") from None
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.image_token_id = cfg.image_token_id  # None for a text-only model
        self.num_image_tokens = cfg.num_image_tokens
        self.takes_images = cfg.takes_images
        self.vocab_size = cfg.text.vocab_size
        self.eos_token_ids = self._eos_ids(Path(model_dir), cfg)
        self._backend = self._plain_backend()

    def _plain_backend(self) -> Any:
        """The Rust tokenizer, when decoding through it equals ``tokenizer.decode`` (no text clean-up
        step applies): the incremental detokenizer decodes twice per generated token, and the Python
        wrapper around the Rust call costs four times the call itself."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "decode"):
            return None
        cleanup = bool(getattr(self.tokenizer, "clean_up_tokenization_spaces", False))
        bpe = type(getattr(backend, "model", None)).__name__ == "BPE"
        forced = bool(getattr(self.tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        return backend if not cleanup or (bpe and not forced) else None

    def _eos_ids(self, model_dir: Path, cfg: ModelConfig) -> tuple[int, ...]:
        ids: list[int] = list(cfg.eos_token_ids)
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, *, timeout_s: float = RENDER_TIMEOUT_S,
                    max_chars: int = RENDER_MAX_CHARS, template_kwargs: dict[str, Any] | None = None) -> str:
        """Apply the checkpoint's chat template (with ``tools``, OpenAI function tools, for it to render, and
        ``template_kwargs``, the request's own variables such as Qwen3's ``enable_thinking``: checked by
        ``check_template_kwargs``); image parts are placed where the template puts them. The render is
        bounded (``template_bounds``):
        past ``timeout_s`` or ``max_chars``, or if the template raises, recurses or runs out of memory, a
        ValueError (a 400 for this request alone)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass a raw prompt instead")
        if not self.takes_images:
            messages = [_flatten_text(m) for m in messages]
        variables = check_template_kwargs(template_kwargs)
        try:
            return render_bounded(lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
                **variables), timeout_s, max_chars)
        except TemplateBoundError:
            raise
        except Exception as exc:  # raise_exception, a sandbox refusal, a type it cannot render: these messages'
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"the chat template cannot render these messages: {first}") from None

    def check_template(self, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        """Render a one-message conversation, as a server does before it starts: a template that cannot (or
        not within its bounds) is refused once, by name, instead of failing every request. No template: fine."""
        if getattr(self.tokenizer, "chat_template", None):
            try:
                self.render_chat(PROBE_CHAT, timeout_s=timeout_s)
            except ValueError as exc:
                raise ValueError(f"the chat template fails on a one-message conversation: {exc}") from None

    def render_user_prompt(self, text: str, num_images: int = 0, **bounds: Any) -> str:
        """One user message (text after its images), rendered as :meth:`render_chat` renders (``bounds``: its)."""
        if not self.takes_images:
            return self.render_chat([{"role": "user", "content": text}], **bounds)
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        content.append({"type": "text", "text": text})
        return self.render_chat([{"role": "user", "content": content}], **bounds)

    def encode(self, text: str, num_images: int, image_tokens: Sequence[int] | None = None) -> EncodedPrompt:
        """Tokenize and expand each image token into the span the vision features fill."""
        return self.expand_ids(self.tokenizer(text)["input_ids"], num_images, image_tokens)

    def expand_ids(self, ids: list[int], num_images: int, image_tokens: Sequence[int] | None = None) -> EncodedPrompt:
        """Expand each image token of already-tokenized ids into its placeholder span: the model's fixed
        count, or ``image_tokens[i]`` for image i (native resolution: each image its own count)."""
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if num_images and not self.takes_images:
            raise ValueError(NO_IMAGES)
        if image_tokens is None:
            if num_images and not self.num_image_tokens:
                raise ValueError("this model's image token counts depend on each image: preprocess the images first")
            image_tokens = [self.num_image_tokens] * num_images
        elif len(image_tokens) != num_images:
            raise ValueError(f"{len(image_tokens)} image token counts for {num_images} image(s)")
        found = sum(1 for t in ids if t == self.image_token_id) if self.image_token_id is not None else 0
        if found != num_images:
            raise ValueError(f"prompt has {found} image placeholder(s) but {num_images} image(s) were given")
        out: list[int] = []
        offsets: list[int] = []
        for t in ids:
            if t == self.image_token_id:
                span = image_tokens[len(offsets)]
                offsets.append(len(out))
                out.extend([self.image_token_id] * span)
            else:
                out.append(t)
        return EncodedPrompt(out, offsets)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _flatten_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of text parts, as one string (joined by newlines, as vLLM does):
    text-only models' chat templates read ``content`` as a string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = [p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {**message, "content": "\n".join(texts)}


# apply_chat_template's own parameters: a request's template variables never set them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (vLLM's extension), as the template's variables: names only, none of
    ``apply_chat_template``'s own parameters; a ValueError (a 400) names the first bad one."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs: {key!r} is not a template variable name")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs: {key!r} is set by the request itself, not as a template variable")
    return kwargs
