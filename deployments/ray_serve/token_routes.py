"""The small routes vLLM users script against, besides the OpenAI ones: ``/tokenize``, ``/detokenize``,
``/version``, and ``/metrics`` on the API port. Request bodies are checked like the OpenAI ones (a 400
naming the field), and the work runs on the model's own tokenizer and chat template."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import httpx
from pydantic import Field, StrictBool, StrictInt, StrictStr

from strata.deployments.openai.protocol import APIError, ChatMessage, LenientModel, split_chat
from strata.pipeline.frontend.intake import PromptTooLongError, check_prompt_chars
from strata.pipeline.frontend.template_bounds import TemplateBoundError
from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.frontend.tools.request import tool_request

MAX_DETOKENIZE = 1_000_000


class TokenizeRequest(LenientModel):
    """vLLM's body: a raw ``prompt`` or chat ``messages`` (rendered with the model's template, with
    ``tools`` when given: what a chat completion with those tools would see)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # the template's variables, as a chat request's
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(LenientModel):
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(max_length=MAX_DETOKENIZE)


def tokenize(req: TokenizeRequest, tokenizer: PromptTokenizer, max_model_len: int, max_image_bytes: int) -> dict[str, Any]:
    """Token ids of a prompt as the server would see it (text only: an image's count is known once sent), under
    the completions' prompt limit, checked before rendering or tokenizing (a 10 MB prompt used to come back
    as 5 M tokens, and the replica kept the memory)."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    param = "prompt" if req.prompt is not None else "messages"
    try:
        if req.messages is not None:
            messages, images = split_chat(req.messages, max_image_bytes)
            if images:
                raise APIError(400, "tokenize counts text; send images to a completion to learn their tokens",
                               param="messages")
            limit = check_prompt_chars(max_model_len, messages=messages)
            tools = tool_request(req.tools, None, None)
            text = tokenizer.render_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                         tools=tools.template_tools() if tools is not None else None,
                                         max_chars=4 * limit, template_kwargs=req.chat_template_kwargs)
            check_prompt_chars(max_model_len, text)
            ids = tokenizer.encode(text, 0).token_ids  # exactly the ids a completion of these messages would see
        else:
            check_prompt_chars(max_model_len, req.prompt)
            ids = tokenizer.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    except (PromptTooLongError, TemplateBoundError) as exc:
        if isinstance(exc, TemplateBoundError) and exc.bound != "output":
            raise APIError(400, str(exc), param=param) from None
        raise APIError(400, str(exc), code="context_length_exceeded", param=param) from None
    except ValueError as exc:  # no chat template, bad tools, a template that cannot render these messages
        raise APIError(400, str(exc), param=param) from None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(req: DetokenizeRequest, tokenizer: PromptTokenizer, max_model_len: int) -> dict[str, Any]:
    """The text of token ids, at most ``max_model_len`` of them (no sequence here is longer)."""
    if len(req.tokens) > max_model_len:
        raise APIError(400, f"{len(req.tokens)} tokens; at most max_model_len ({max_model_len})",
                       code="context_length_exceeded", param="tokens")
    vocab = tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": tokenizer.tokenizer.decode(req.tokens)}


def tokenizer_info(tokenizer: PromptTokenizer) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's configuration as ``tokenizer_config.json`` holds it (special
    tokens as their text), its class, and the chat template this server renders with (an override
    included): what lm-eval's remote tokenizer reads. Where the server keeps its files is left out."""
    hf = tokenizer.tokenizer
    info: dict[str, Any] = {}
    for key, value in hf.init_kwargs.items():
        if key == "name_or_path" or key.endswith("_file") or key.endswith("_files"):
            continue  # a path on this machine
        value = _plain(value)
        if value is not _SKIP:
            info[key] = value
    info["tokenizer_class"] = type(hf).__name__
    template = getattr(hf, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


_SKIP = object()


def _plain(value: Any) -> Any:
    """A JSON value for a tokenizer setting: an AddedToken as its text; what JSON cannot hold is left out."""
    if hasattr(value, "content") and isinstance(getattr(value, "content"), str):
        return value.content
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return [v for v in items if v is not _SKIP]
    if isinstance(value, dict):
        pairs = {str(k): _plain(v) for k, v in value.items()}
        return {k: v for k, v in pairs.items() if v is not _SKIP}
    return _SKIP


def server_version() -> dict[str, str]:
    try:
        return {"version": version("strata")}
    except PackageNotFoundError:  # a source tree run without installing
        return {"version": "unknown"}


async def node_metrics() -> str:
    """This node's Prometheus text, as its metrics agent exports it on the metrics port (every Strata and
    Ray family of the node's processes): what vLLM users scrape at the API port's /metrics."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    nodes = await asyncio.to_thread(ray.nodes)  # a GCS call: never on the event loop
    node = next((n for n in nodes if n.get("NodeID") == node_id and n.get("Alive")), None)
    port = (node or {}).get("MetricsExportPort")
    if not port:
        raise APIError(503, "this node exports no metrics", type_="server_error")
    address = node.get("NodeManagerAddress", "127.0.0.1")  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(f"http://{address}:{port}/metrics")
    except httpx.HTTPError:
        raise APIError(503, "the node's metrics agent did not answer", type_="server_error") from None
    if response.status_code != 200:
        raise APIError(503, "the node's metrics agent did not answer", type_="server_error")
    return response.text
