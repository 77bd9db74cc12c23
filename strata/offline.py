"""The offline API: ``strata.LLM(model, **engine_args).generate(prompts, sampling_params)``, in the shape vLLM's
users already write, over the in-process engine (``load_engine`` is the lower level it stands on).

As in vLLM, ``generate`` takes prompts as they are (a string is tokenized without the chat template; a dict
may carry ``prompt_token_ids`` or, with ``multi_modal_data``, images for the placeholders the prompt holds)
and ``chat`` renders conversations with the model's chat template. A batch is checked whole before it runs:
a prompt that cannot run (too long, an image the model cannot take) is a ``ValueError`` naming its index,
and no other prompt of that batch is left queued in the engine.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams

Prompt = str | dict[str, Any]
Conversation = list[dict[str, Any]]


def load_engine(model_dir: str | Path, config: EngineConfig | None = None) -> Any:
    """Build the in-process engine: the four stages composed in this process."""
    from strata.stages.factory import build_engine

    return build_engine(model_dir, config)


@dataclass
class CompletionOutput:
    """One answer to a prompt (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop, length, abort, or error (then the request's ``error`` says why)


@dataclass
class RequestOutput:
    """What one prompt produced (vLLM's ``RequestOutput``: ``outputs[0].text`` is the answer)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    error: str | None = None
    finished: bool = field(default=True)


class LLM:
    """A model loaded in this process. ``engine_args`` are :class:`EngineConfig` fields (``dtype``,
    ``max_model_len``, ``tp``, ...); a misspelled one is a ``ValueError`` that names it."""

    def __init__(self, model: str | Path, **engine_args: Any) -> None:
        try:
            config = EngineConfig(**engine_args)
        except ValueError as exc:  # pydantic's error, one line per key
            raise ValueError(_first_error(exc)) from None
        self.engine = load_engine(model, config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt as it is (no chat template); outputs in the prompts' order."""
        batch = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run([_request(p) for p in batch], sampling_params)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer each conversation (OpenAI-style messages; image parts as ``image_url`` data URLs), rendered
        with the model's chat template."""
        batch = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[arg-type]
        return self._run([{"messages": list(m)} for m in batch], sampling_params)

    def close(self) -> None:
        """Release what the engine started besides this process (tensor-parallel workers)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, requests: list[dict[str, Any]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        params = _params_for(len(requests), sampling_params)
        ids: list[str] = []
        try:
            for i, (request, p) in enumerate(zip(requests, params)):
                try:
                    ids.append(self.engine.add_request(params=replace(p), **request))  # intake may adjust its copy
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from None
        except BaseException:
            for rid in ids:  # nothing of a refused batch stays queued
                self.engine.abort(rid)
            raise
        seqs = [self.engine._requests[rid] for rid in ids]
        errors = {ev.request_id: ev.error for ev in self.engine.run() if ev.finish_reason == "error"}
        return [RequestOutput(seq.request_id, request.get("raw_prompt"), list(seq.token_ids[: seq.num_prompt_tokens]),
                              [CompletionOutput(0, seq.text, list(seq.output_token_ids),
                                                {"eos": "stop"}.get(seq.finish_reason, seq.finish_reason))],
                              seq.num_cached_tokens, errors.get(seq.request_id))
                for seq, request in zip(seqs, requests)]


def _request(prompt: Prompt) -> dict[str, Any]:
    """vLLM's prompt forms as the engine's request arguments."""
    if isinstance(prompt, str):
        return {"raw_prompt": prompt}
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt is a string or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"unknown prompt key {sorted(unknown)[0]!r} (prompt, prompt_token_ids, multi_modal_data)")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict holds exactly one of prompt and prompt_token_ids")
    request: dict[str, Any] = ({"raw_prompt": prompt["prompt"]} if "prompt" in prompt
                               else {"prompt_token_ids": list(prompt["prompt_token_ids"])})
    media = prompt.get("multi_modal_data") or {}
    if set(media) - {"image"}:
        raise ValueError(f"multi_modal_data takes images only, got {sorted(set(media) - {'image'})[0]!r}")
    if "image" in media:
        images = media["image"] if isinstance(media["image"], (list, tuple)) else [media["image"]]
        request["images"] = [_image_bytes(im) for im in images]
    return request


def _image_bytes(image: Any) -> bytes:
    """An image as the engine takes it: encoded bytes as they are, a PIL image as PNG."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if hasattr(image, "save"):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise ValueError(f"an image is encoded bytes or a PIL image, got {type(image).__name__}")


def _params_for(n: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            return f"unknown engine argument {where}"
        return f"engine argument {where}: {first.get('msg')}"
    return str(exc).splitlines()[0]
