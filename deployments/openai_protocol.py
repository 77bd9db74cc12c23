"""The OpenAI API surface Strata serves: request schemas, response shapes, error bodies.

Requests are validated with pydantic; anything the schema or our engine cannot honour is an
:class:`APIError` that the ingress turns into an OpenAI-style error body with a 4xx status.
Unknown fields are accepted and ignored, as the OpenAI API does.
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strata.pipeline.sampling_params import SamplingParams


class APIError(Exception):
    """A request the server refuses: HTTP status plus an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str
    detail: str | None = None


class ContentPart(_Lenient):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: keep generating past EOS (benchmarks, load tests)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, "exactly one prompt per request is supported", param="prompt")
            return self.prompt[0]
        return self.prompt


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a schema error becomes a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from exc


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL. Remote URLs are refused: the server does not fetch."""
    if not url.startswith("data:"):
        raise APIError(400, "image_url must be a data: URL (base64); the server does not fetch remote images",
                       param="image_url")
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise APIError(400, "image_url data: URL must be base64-encoded", param="image_url")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise APIError(400, f"image is larger than {max_bytes} bytes", param="image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"image_url is not valid base64: {exc}", param="image_url") from exc


def split_chat(messages: list[ChatMessage], max_image_bytes: int) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Chat-template messages (image parts become ``{"type": "image"}``) and the image bytes in order."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for msg in messages:
        if msg.content is None or isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for part in msg.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            else:
                if part.image_url is None:
                    raise APIError(400, "image_url part without image_url", param="messages")
                images.append(decode_data_url(part.image_url.url, max_image_bytes))
                parts.append({"type": "image"})
        out.append({"role": msg.role, "content": parts})
    return out, images


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
