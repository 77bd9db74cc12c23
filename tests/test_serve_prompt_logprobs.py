"""Prompt logprobs through `strata serve` on real weights (the session's SmolLM2 server): the request lm-eval's
``local-completions`` sends for a loglikelihood task (token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``)
gets transformers' numbers for every prompt token, cold and with the prompt cached; ``max_tokens: 0`` echoes
alone; a stream echoes first; vLLM's ``prompt_logprobs`` on both endpoints; bad values are 400s."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import MODEL_NAME, SMOLLM2_KEY

pytestmark = pytest.mark.serve  # the session's real SmolLM2 server, started with an API key

HEADERS = {"Authorization": f"Bearer {SMOLLM2_KEY}"}
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris is the capital of France."


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, headers=HEADERS, timeout=120)


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> tuple[list[int], torch.Tensor]:
    """The context + continuation's token ids and transformers' logprob of each token after the first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2)(CONTEXT + CONTINUATION)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    return ids, lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_lm_evals_loglikelihood_request_gets_transformers_numbers(keyed_server, reference) -> None:
    """lm-eval's request, through the openai client: one value per prompt token (None first) then the
    generated token's; the continuation's sum is transformers'; is_greedy reads the top map. The same
    request again, its prompt now cached, gives the same numbers."""
    ids, expected = reference
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=SMOLLM2_KEY)
    answers = [client.completions.create(model=MODEL_NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                         temperature=0, seed=1234) for _ in range(2)]
    for answer in answers:
        lp = answer.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1 : len(ids)]), expected, rtol=0, atol=1e-4)
        for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert value in top.values() and max(top.values()) >= value  # lm-eval's is_greedy test reads this
        assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 1
    assert answers[0].choices[0].logprobs.token_logprobs[:-1] == answers[1].choices[0].logprobs.token_logprobs[:-1]


def test_max_tokens_zero_echoes_the_prompt_alone(keyed_server, reference) -> None:
    ids, expected = reference
    body = _post(keyed_server, "/v1/completions", {"prompt": CONTEXT + CONTINUATION, "echo": True, "logprobs": 0,
                                                   "max_tokens": 0, "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == CONTEXT + CONTINUATION and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(ids)
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"][1:]), expected, rtol=0, atol=1e-4)
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_a_streamed_echo_sends_the_prompt_first_then_the_answer(keyed_server) -> None:
    body = {"prompt": CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0}
    whole = _post(keyed_server, "/v1/completions", body).json()["choices"][0]
    with httpx.stream("POST", keyed_server.base_url + "/v1/completions", headers=HEADERS, timeout=120,
                      json={"model": MODEL_NAME, **body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == CONTEXT and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    streamed = [v for e in events for v in (e["choices"][0].get("logprobs") or {}).get("token_logprobs", [])]
    assert streamed == whole["logprobs"]["token_logprobs"]


def test_vllms_prompt_logprobs_on_both_endpoints(keyed_server, reference) -> None:
    ids, expected = reference
    completion = _post(keyed_server, "/v1/completions", {"prompt": ids, "prompt_logprobs": 2, "max_tokens": 1,
                                                         "temperature": 0}).json()["choices"][0]
    plp = completion["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) and completion["text"] and completion["logprobs"] is None
    for token, entry, value in zip(ids[1:], plp[1:], expected.tolist()):
        assert abs(entry[str(token)]["logprob"] - value) < 1e-4 and entry[str(token)]["rank"] >= 1
        assert len({k for k, v in entry.items() if v["rank"] <= 2}) >= 2
    chat = _post(keyed_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # the prompt token alone at k = 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": "Hi", "echo": True, "n": 2}, "n"),
    ({"prompt": [[1, 2], [3, 4]], "echo": True}, "prompt"),
    ({"prompt": [], "echo": True}, "prompt"),
    ({"prompt": [10**9]}, None),
])
def test_bad_values_are_400s_naming_them(keyed_server, body: dict, param: str | None) -> None:
    response = _post(keyed_server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and (param is None or error["param"] == param), error


def test_echo_on_a_chat_is_a_400_not_ignored(keyed_server) -> None:
    response = _post(keyed_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                            "echo": True})
    assert response.status_code == 400 and "echo" in response.json()["error"]["message"]
