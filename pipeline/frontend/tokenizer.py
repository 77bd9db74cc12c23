"""The checkpoint's own tokenizer and chat template, plus image-placeholder expansion."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from strata.pipeline.models.model_config import ModelConfig


NO_IMAGES = "this model takes no images: it is a text-only LLM (send text content only)"


@dataclass
class EncodedPrompt:
    token_ids: list[int]
    image_offsets: list[int]  # first placeholder position of each image, in order


class PromptTokenizer:
    """Renders chats with the model's template and tokenizes them exactly as its processor would."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, chat_template: str | None = None) -> None:
        """``chat_template``: a Jinja template replacing the checkpoint's (``strata serve --chat-template``)."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
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
                    tools: list[dict[str, Any]] | None = None) -> str:
        """Apply the checkpoint's chat template (with ``tools``, OpenAI function tools, for it to render);
        image parts are placed where the template puts them."""
        from jinja2 import TemplateError
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass a raw prompt instead")
        if not self.takes_images:
            messages = [_flatten_text(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except (TemplateError, TypeError) as exc:  # a template that raises (raise_exception) or cannot render these
            raise ValueError(f"the chat template cannot render these messages: {str(exc).splitlines()[0]}") from None

    def render_user_prompt(self, text: str, num_images: int = 0) -> str:
        if not self.takes_images:
            return self.render_chat([{"role": "user", "content": text}])
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        content.append({"type": "text", "text": text})
        return self.render_chat([{"role": "user", "content": content}])

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
