"""vLLM's ``/tokenizer_info`` body, in-process: the tokenizer's settings as JSON (special tokens as their text),
its class and the chat template in use, never a path of the server's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken

from strata.deployments.ray_serve.token_routes import tokenizer_info
from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.models.model_config import load_model_config

pytestmark = pytest.mark.unit


def test_the_info_is_json_with_the_template_in_use_and_no_path(llama_dir: Path) -> None:
    tok = PromptTokenizer(llama_dir, load_model_config(llama_dir), "{{ messages[0]['content'] }}")
    tok.tokenizer.init_kwargs.update({"extra_special": AddedToken("<x>"), "opaque": object(),
                                      "nested": {"tokens": [AddedToken("<y>"), object()]}})
    info = tokenizer_info(tok)
    json.dumps(info)  # every value is JSON
    assert info["chat_template"] == "{{ messages[0]['content'] }}"  # the override, not the checkpoint's
    assert info["extra_special"] == "<x>" and info["nested"] == {"tokens": ["<y>"]} and "opaque" not in info
    assert info["tokenizer_class"] == type(tok.tokenizer).__name__
    assert str(llama_dir) not in json.dumps(info) and not any(k.endswith("_file") for k in info)


def test_the_route_is_a_404_saying_how_to_turn_it_on_when_off() -> None:
    """Off by default, as vLLM's: an OpenAI-style 404 naming the flag, the tokenizer never touched."""
    import asyncio

    from test_output_limit_params import FakeFlow, _ingress

    response = asyncio.run(_ingress(FakeFlow()).tokenizer_info_route())  # no tokenizer: it must not be read
    body = json.loads(response.body)
    assert response.status_code == 404 and "--enable-tokenizer-info-endpoint" in body["error"]["message"]
