"""The OpenAI API surface Strata serves: request schemas, response shapes, error bodies.

Requests are validated with pydantic in strict mode for numbers (``max_tokens: true`` or ``4.0``
is an error, not a 1 or a 4); anything the schema or our engine cannot honour is an
:class:`APIError` that the ingress turns into an OpenAI-style error body with a 4xx status.
OpenAI parameters this server does not implement (``audio``, ``functions``, ...) are refused with a
400 naming them; other unknown fields are ignored, as the OpenAI API does.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from strata.pipeline.contract.sampling_params import MAX_LOGPROBS, MAX_TOKENS, SEED_MAX, SEED_MIN, SamplingParams
from strata.pipeline.frontend.generation_defaults import GenerationDefaults
from strata.pipeline.frontend.intake import PromptTooLongError, check_prompt_chars
from strata.pipeline.frontend.structured import spec_from_openai
from strata.pipeline.frontend.tokenizer import check_template_kwargs
from strata.pipeline.frontend.tools.request import ToolRequest, tool_request

# OpenAI parameters this server does not implement: a request that sets one gets a 400 naming it
# instead of a silently different answer. (Defaults such as `presence_penalty: 0` are accepted.)
UNSUPPORTED = {
    "functions": None, "function_call": None,  # the deprecated form of tools
    "best_of": 1, "suffix": None, "audio": None, "modalities": None, "prediction": None,
    "web_search_options": None, "reasoning_effort": None,
}

NO_DEFAULTS = GenerationDefaults()


def _first(*values: Any) -> Any:
    """The first value that is set (a request's own, then the checkpoint's default, then OpenAI's)."""
    return next(v for v in values if v is not None)


class APIError(Exception):
    """A request the server refuses: HTTP status plus an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s  # sent as a Retry-After header (429, 503)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class LenientModel(BaseModel):
    """A request body: unknown fields are allowed (clients send vendor extras), the unsupported OpenAI
    parameters above are refused by name."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "LenientModel":
        for name, default in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name, default)
            if value is not None and value != default:
                raise ValueError(f"the parameter {name!r} is not supported by this server")
        return self


class ImageURL(LenientModel):
    url: StrictStr
    detail: StrictStr | None = None


class ContentPart(LenientModel):
    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: ImageURL | None = None


class FunctionCall(LenientModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(LenientModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(LenientModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result: the call it answers
    name: StrictStr | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class StreamOptions(LenientModel):
    include_usage: StrictBool = False


class _SamplingFields(LenientModel):
    model: StrictStr
    # Range-checked here, as a field, so a bad value is a 400 naming it whichever limit ends up used.
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)  # 1 and 1.0 both; never "1" or true
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = Field(default=None)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=16)  # parallel_sampling.MAX_N
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM extension: keep generating past EOS (benchmarks, load tests)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, StrictFloat] | None = None  # token id (as a string, OpenAI's JSON) -> [-100, 100]
    # vLLM extensions
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=10.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # -1 or 0: disabled
    min_tokens: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS)
    stop_token_ids: list[StrictInt] | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[StrictStr, Any] | None = None
    guided_json: dict[StrictStr, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict[StrictStr, Any] | None = None
    skip_special_tokens: StrictBool = True  # vLLM extension

    def sampling_params(self, defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        """The request's sampling; ``max_tokens`` None when absent (intake gives it the room the context leaves).
        A field the request leaves out takes ``defaults`` (the checkpoint's ``generation_config.json``), then
        OpenAI's default."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 16:
            raise APIError(400, "at most 16 stop strings are supported", param="stop")
        params = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=float(_first(self.temperature, defaults.temperature, 1.0)),
            top_p=float(_first(self.top_p, defaults.top_p, 1.0)),
            top_k=max(0, _first(self.top_k, defaults.top_k, 0)),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=float(_first(self.repetition_penalty, defaults.repetition_penalty, 1.0)),
            logit_bias=_token_bias(self.logit_bias),
            min_tokens=self.min_tokens,
            structured=self._structured(),
            skip_special_tokens=self.skip_special_tokens,
        )
        try:
            params.validate()
        except ValueError as exc:  # its message starts with the field's name
            name = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=name if name in type(self).model_fields else None) from exc
        return params

    def requested_logprobs(self) -> int | None:
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``: each prompt token's logprob and this many most likely at its place."""
        asked = (self.model_extra or {}).get("prompt_logprobs")
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int)
                                  or not 0 <= asked <= MAX_LOGPROBS):
            raise APIError(400, f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {asked!r}",
                           param="prompt_logprobs")
        if asked is not None and self.n > 1:
            raise APIError(400, "prompt logprobs are given for n = 1 only", param="n")
        return asked

    def _structured(self) -> tuple[str, str] | None:
        fields = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")
        try:
            return spec_from_openai({name: getattr(self, name) for name in fields})
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = float(value)
    return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM extension: the image processor's per-request settings (Qwen-VL: min_pixels, max_pixels); the
    # Preprocess stage checks them against the model's processor
    mm_processor_kwargs: dict[StrictStr, Any] | None = None
    # vLLM extension: the chat template's own variables (Qwen3's enable_thinking, DeepSeek-V3.1's thinking)
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    # tool calling; their contents are checked by tool_request (a 400 naming what is wrong)
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    def tool_request(self) -> ToolRequest | None:
        try:
            return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice" if str(exc).startswith("tool_choice") else "tools") \
                from None

    @model_validator(mode="after")
    def _template_variables(self) -> "ChatCompletionRequest":
        try:
            check_template_kwargs(self.chat_template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from None
        return self

    @model_validator(mode="after")
    def _no_echo(self) -> "ChatCompletionRequest":
        if (self.model_extra or {}).get("echo") not in (None, False):
            raise ValueError("the parameter 'echo' is supported on /v1/completions only")
        return self

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _one_output_limit(self) -> "ChatCompletionRequest":
        """``max_completion_tokens`` is OpenAI's current name for the chat output limit and
        ``max_tokens`` the deprecated one; a request may send either or both. Both were range-checked
        as fields above; when both are given the new one wins (as in vLLM: ``max_completion_tokens or
        max_tokens``), and ``max_tokens`` then holds the limit in force, so code that asks whether
        the client set a limit (``max_tokens is None``) sees either field."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_SamplingFields):
    # text, or token ids (what lm-eval sends by default); or a list of either (one choice each, as vLLM)
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool = False  # the prompt before the answer, its tokens' logprobs before the answer's
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_TOKENS)  # 0: only the echoed prompt

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        asked = super().requested_prompt_logprobs()
        if self.echo and self.logprobs is not None:  # OpenAI's echo: the prompt's logprobs as the answer's
            if self.n > 1:
                raise APIError(400, "echo with logprobs is given for n = 1 only", param="n")
            return max(asked or 0, self.logprobs)
        return asked

    def sampling_params(self, defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        """``max_tokens: 0`` echoes the prompt and generates nothing: one token is computed (the prompt's
        forward gives it anyway) and left out of the answer (``generates``)."""
        if self.echo and self.n > 1:
            raise APIError(400, "echo is given for n = 1 only", param="n")
        if self.max_tokens == 0:
            if not self.echo:
                raise APIError(400, "max_tokens 0 needs echo: true (there is nothing else to return)",
                               param="max_tokens")
            return self.model_copy(update={"max_tokens": 1}).sampling_params(defaults)
        return super().sampling_params(defaults)

    @property
    def generates(self) -> bool:
        """Whether the answer holds generated tokens (not with ``max_tokens: 0``)."""
        return self.max_tokens != 0

    def prompt_inputs(self) -> list[dict[str, Any]]:
        """What intake takes for each prompt: ``raw_prompt`` text, or ``prompt_token_ids``. Several prompts
        (a list of texts or of id lists) give ``n`` choices each, at most ``MAX_CHOICES`` in all; echo and
        prompt logprobs take one prompt."""
        prompt = self.prompt
        many = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(many) * self.n > MAX_CHOICES:
            raise APIError(400, f"{len(many)} prompts x n = {self.n} is more than {MAX_CHOICES} choices",
                           param="prompt")
        if len(many) > 1 and (self.echo or self.requested_prompt_logprobs() is not None):
            raise APIError(400, "echo and prompt logprobs take one prompt per request", param="prompt")
        out = []
        for one in many:
            if isinstance(one, str):
                out.append({"raw_prompt": one})
            elif not one:
                raise APIError(400, "the prompt is empty", param="prompt")
            else:
                out.append({"prompt_token_ids": list(one)})
        return out

    def prompt_input(self) -> dict[str, Any]:
        """The one prompt of a request that has one (echo reads it)."""
        return self.prompt_inputs()[0]


MAX_CHOICES = 16  # prompts x n in one request: each is an engine request the admission counts once


def check_prompt_size(body: Any, max_model_len: int) -> None:
    """Before the schema check (which costs ~10 us a message): a chat of more messages than ``max_model_len``
    (every template spends a token on each) or more text than the prompt limit, or a longer prompt string,
    is a 400 naming the context limit. A 9.5 MB chat of 250,000 messages took 12-26 s of the front door's
    time to refuse, four at once starving ``/health``; refused here it costs one walk over the body."""
    if not isinstance(body, dict):
        return
    messages, prompt = body.get("messages"), body.get("prompt")
    try:
        if isinstance(messages, list):
            if len(messages) > max_model_len:
                raise PromptTooLongError(f"{len(messages)} messages can never fit max_model_len {max_model_len} "
                                         "(each takes a token or more)")
            check_prompt_chars(max_model_len, messages=[m for m in messages if isinstance(m, dict)])
        elif isinstance(prompt, str):
            check_prompt_chars(max_model_len, prompt)
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), code="context_length_exceeded",
                       param="messages" if isinstance(messages, list) else "prompt") from None


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a schema error becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        param = where or next((name for name in UNSUPPORTED if name in body and f"'{name}'" in msg), None)
        raise APIError(400, f"{where}: {msg}" if where else msg, param=param) from exc


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
            out.append(_tool_fields(msg, {"role": msg.role, "content": msg.content or ""}))
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
        out.append(_tool_fields(msg, {"role": msg.role, "content": parts}))
    return out, images


def _tool_fields(msg: ChatMessage, out: dict[str, Any]) -> dict[str, Any]:
    """A message's tool fields as chat templates read them: an earlier call's arguments as an object
    (Hugging Face's convention; the API carries them as JSON text), a tool result's call id and name."""
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in msg.tool_calls]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(400, "messages: a tool call's arguments must be JSON text", param="messages") from None


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
