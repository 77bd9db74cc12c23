"""The SSE bytes the ingress writes: the fast per-token path equals the plain formatting, for any text."""

from __future__ import annotations

import json

import pytest

from strata.deployments.openai.responses import ContentChunks, chat_chunk, completion_chunk, sse


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_content_chunks_are_the_same_bytes_as_sse_of_the_chunk(chat: bool) -> None:
    rid, model = "chatcmpl-abc", 'model "with" quotes\\'
    chunks = ContentChunks(rid, model, 1700000000, chat)
    for text in ["hi", "ü \"q\" \\ \n\t", "日本語 🙂", "\x00\x1f", ""]:
        expected = sse(chat_chunk(rid, model, 1700000000, {"content": text}, None) if chat
                       else completion_chunk(rid, model, 1700000000, text, None))
        line = chunks(text)
        assert line == expected
        body = json.loads(line[len("data: "):])
        got = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
        assert got == text
