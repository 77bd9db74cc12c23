"""A 20-turn agent loop on the real SmolLM2 (the seeds' "numerical differences amplified through multi-turn
interactions"): each turn a user asks, a get_weather call and its result join the conversation, and the model
answers, so the context grows to well over a thousand tokens. At every turn the answer of ``strata serve``
(prefix reuse on), of the in-process engine over a device pool smaller than the conversation (its KV spilled
to the host tier between turns and reused from there), and of transformers are the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from helpers import MODEL_NAME, SMOLLM2_KEY, build, greedy

pytestmark = pytest.mark.serve  # the session's real SmolLM2 server (conftest's ``keyed_server``)

TURNS, ANSWER_TOKENS = 20, 5
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Perth"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _keep_prefix(cache, cached_ids: list[int], ids: list[int]):
    """transformers' cache cut to the tokens ``ids`` starts with (a turn repeats the conversation before it)."""
    if cache is None:
        return None, []
    n = next((i for i, (a, b) in enumerate(zip(cached_ids, ids)) if a != b), min(len(cached_ids), len(ids)))
    n = min(n, len(ids) - 1)  # at least the last prompt token is computed: its logits give the first answer token
    if n < cache.get_seq_length():
        cache.crop(n - cache.get_seq_length())  # (a negative count: the tokens to remove)
    return cache, cached_ids[:n]


def test_twenty_turns_of_tool_calls_stay_equal_served_spilled_and_in_transformers(keyed_server, smollm2: Path,
                                                                                  tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    headers = {"Authorization": f"Bearer {SMOLLM2_KEY}"}
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    engine = build(smollm2, num_kv_blocks=64, host_kv_blocks=1024, host_kv_dir=str(tmp_path / "host"),
                   prefill_chunk_tokens=256, max_model_len=2048)  # 1,024 device tokens: the loop outgrows them
    messages: list[dict] = []
    served_cached = spilled_cached = 0
    cache, cached_ids = None, []  # transformers' own KV of the conversation so far (as a chat client's server keeps it)
    for turn in range(TURNS):
        city = CITIES[turn % len(CITIES)]
        messages += [{"role": "user", "content": f"Step {turn}: how is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": f"call_{turn}", "type": "function",
                          "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                     {"role": "tool", "tool_call_id": f"call_{turn}",
                      "content": json.dumps({"city": city, "temperature_c": 10 + turn, "sky": "clear"})}]
        ask = {"model": MODEL_NAME, "messages": messages, "tools": [WEATHER_TOOL], "tool_choice": "none"}
        ids = httpx.post(keyed_server.base_url + "/tokenize", json=ask, headers=headers, timeout=60).json()["tokens"]
        served = httpx.post(keyed_server.base_url + "/v1/chat/completions", headers=headers, timeout=120,
                            json={**ask, "max_tokens": ANSWER_TOKENS, "temperature": 0}).json()
        ours = engine.generate([{"prompt_token_ids": ids, "params": greedy(ANSWER_TOKENS)}])[0]
        cache, cached_ids = _keep_prefix(cache, cached_ids, ids)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                     cache=cache, return_dict_in_generate=True)
        theirs = out.sequences[0, len(ids):].tolist()
        cache, cached_ids = out.past_key_values, out.sequences[0, :-1].tolist()  # the last token has no KV yet
        assert ours.output_token_ids == theirs, turn
        assert served["choices"][0]["message"]["content"] == ours.text, turn
        assert served["usage"]["prompt_tokens"] == len(ids)
        served_cached = max(served_cached, served["usage"]["prompt_tokens_details"]["cached_tokens"])
        spilled_cached = max(spilled_cached, ours.num_cached_tokens)
        messages.append({"role": "assistant", "content": ours.text})
    assert len(ids) > 1500  # the conversation grew past the engine's 1,024 device tokens
    assert engine.kv.spills.peak > 0 and spilled_cached > 64 * 16  # reused from the host tier, past the device
    assert served_cached > 0
