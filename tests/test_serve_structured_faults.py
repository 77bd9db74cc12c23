"""Structured output beside other users, against the session's real `strata serve` of real weights (SmolLM2,
49,152 tokens: a cold vocabulary costs llguidance ~2 s): while the first grammar of a fresh server compiles,
a running plain stream keeps its tokens coming (no gap of 1 s); a grammar that kills its compiler (a real
SIGSEGV in the front door's sandbox, at the fault point ``grammar_crash``) is a 400 for its request alone:
the plain stream beside it finishes, and the engine and its replica keep their pids; n = 8 sampled answers
to a JSON schema that end with ``stop`` all validate.

This module runs before test_serve_surface (file order), so its first test meets the server's grammars cold,
which it checks first."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import jsonschema
import psutil
import pytest

from helpers import MODEL_NAME, SMOLLM2_KEY

pytestmark = pytest.mark.serve
HEADERS = {"Authorization": f"Bearer {SMOLLM2_KEY}"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "population_millions"], "additionalProperties": False}


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def _post(server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=120)


class PlainStream(threading.Thread):
    """A plain streamed completion in the background: when each chunk arrived, and how it ended."""

    def __init__(self, server, max_tokens: int = 160) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.arrivals: list[float] = []
        self.finish: str | None = None
        self.errors: list[str] = []

    def run(self) -> None:
        body = _chat("Tell me a long story about the harbour.", max_tokens=self.max_tokens, ignore_eos=True, stream=True)
        with httpx.stream("POST", self.server.base_url + "/v1/chat/completions", json=body, headers=HEADERS,
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    self.errors.append(event["error"]["message"])
                    continue
                self.arrivals.append(time.monotonic())
                self.finish = event["choices"][0].get("finish_reason") or self.finish

    def started(self, tokens: int = 5, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < tokens and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(self.arrivals) >= tokens, "the plain stream never started"

    @property
    def largest_gap(self) -> float:
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:]))


def _stats(server) -> dict[str, Any]:
    return httpx.get(server.base_url + "/strata/stats", headers=HEADERS, timeout=30).json()


def _processes(server) -> dict[str, int]:
    """The LLM replica's pid, its engine child's and its grammar sandbox's (if started)."""
    apps = httpx.get(server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    (replica,) = [r["pid"] for r in apps["strata"]["deployments"]["LLM"]["replicas"] if r["state"] == "RUNNING"]
    found = {"replica": replica}
    for child in psutil.Process(replica).children(recursive=True):
        line = " ".join(child.cmdline())
        for name, module in (("engine", "strata.stages.engine_process"), ("sandbox", "grammar_worker")):
            if module in line:
                found[name] = child.pid
    return found


def test_the_first_grammar_of_a_cold_server_never_stalls_a_running_stream(keyed_server) -> None:
    assert _stats(keyed_server)["ingress"]["grammars"]["compiled"] == 0, "run this module before other grammars"
    stream = PlainStream(keyed_server)
    stream.start()
    stream.started()
    answer = _post(keyed_server, _chat("Paris in JSON", max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}))
    stream.join(120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), SCHEMA)
    assert stream.finish == "length" and not stream.errors
    # Compiling in the step loop would stall it for the sandbox's start (a fresh interpreter importing torch
    # and the tokenizer: 5 s and more here); a loaded 2-core host alone makes gaps of a second.
    assert stream.largest_gap < 2.0, f"a {stream.largest_gap:.2f} s gap while the grammar compiled"


def test_a_grammar_that_kills_its_compiler_costs_only_its_request(keyed_server) -> None:
    before = _processes(keyed_server)
    assert "sandbox" in before  # the previous test started it
    stream = PlainStream(keyed_server)
    stream.start()
    stream.started()
    (keyed_server.faults / "grammar_crash.rank0").write_text("1")
    crashed = _post(keyed_server, _chat("hi", max_tokens=8, guided_regex="[a-z]{3}-[0-9]{2}"))
    stream.join(120)
    assert crashed.status_code == 400, crashed.text
    assert "too large or too deep to compile" in crashed.json()["error"]["message"]
    assert stream.finish == "length" and not stream.errors and stream.largest_gap < 2.0
    after = _processes(keyed_server)
    assert (after["replica"], after["engine"]) == (before["replica"], before["engine"])
    assert _stats(keyed_server)["ingress"]["grammars"]["crashes"] == 1
    again = _post(keyed_server, _chat("hi", max_tokens=8, guided_regex="[a-z]{3}-[0-9]{2}"))
    assert again.status_code == 400  # remembered: no second crash
    fine = _post(keyed_server, _chat("hi", max_tokens=8, guided_regex="[a-z]{2}-[0-9]{2}"))
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "stop"
    assert _processes(keyed_server)["sandbox"] != before["sandbox"]  # a fresh child compiled it


def test_n_sampled_answers_that_stop_all_validate(keyed_server) -> None:
    r = _post(keyed_server, _chat("A city in JSON", max_tokens=48, n=8, temperature=1.0, seed=7,
                                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 8 and {c["finish_reason"] for c in choices} <= {"stop", "length"}
    stops = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert stops
    for text in stops:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_request_whose_constraints_leave_no_token_ends_alone(keyed_server) -> None:
    """Beside three plain streams: a regex whose only token is also a stop token with min_tokens 3 at
    temperature 1, and a named tool call with min_tokens past its length and a stop token inside its
    syntax. Each is a clean finish in its own language; the three streams end as they would have."""
    ids = httpx.post(keyed_server.base_url + "/tokenize", headers=HEADERS, timeout=30,
                     json={"prompt": "a}", "add_special_tokens": False}).json()["tokens"]
    a, brace = ids
    streams = [PlainStream(keyed_server, 80) for _ in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        s.started()
    only = _post(keyed_server, _chat("Say a", max_tokens=8, temperature=1.0, seed=3, min_tokens=3,
                                     stop_token_ids=[a], guided_regex="a"))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    call = _post(keyed_server, _chat("Weather in Paris?", max_tokens=80, min_tokens=60, stop_token_ids=[brace],
                                     tools=[weather], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    for s in streams:
        s.join(120)
    assert only.status_code == 200, only.text
    assert (only.json()["choices"][0]["finish_reason"], only.json()["choices"][0]["message"]["content"]) == ("stop", "a")
    assert call.status_code == 200, call.text
    choice = call.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (made,) = choice["message"]["tool_calls"]
    assert made["function"]["name"] == "get_weather" and isinstance(json.loads(made["function"]["arguments"])["city"], str)
    for s in streams:
        assert s.finish == "length" and not s.errors and len(s.arrivals) >= 80
