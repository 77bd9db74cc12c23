"""Locust users for a running `strata serve` (OpenAI API over HTTP only).

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --host http://127.0.0.1:8000 --csv out/strata

Environment knobs: STRATA_MAX_TOKENS (default 32), STRATA_LONG_PROMPT_WORDS (default 300), STRATA_API_KEY
(the Bearer token of a server started with --api-key).

Four kinds of users: short text chats, chats with an image (of mixed sizes), multi-turn chats whose turns share
a growing prefix, and long prompts. Every request streams, and is one row of Locust's table per kind, timed
to its ``[DONE]`` (not to the response headers, Locust's default for a stream), its length the tokens it
streamed: so the Aggregated row's requests/s is true. Time to first token, inter-token latency (each gap
between streamed chunks, per token, as ``vllm bench serve`` defines ITL) and output tokens/s are collected
beside the table and printed when the run ends (and written to ``<csv prefix>_strata.csv`` with ``--csv``).
On a model that takes no images the image users step aside with a note, instead of failing every request.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task


def _sibling(name: str) -> Any:
    """A module beside this file, loaded by its path: the load test imports none of Strata's packages, so it
    runs wherever Locust does."""
    spec = importlib.util.spec_from_file_location(f"_strata_loadtest_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STATS = _sibling("stream_stats").STATS

MAX_TOKENS = int(os.environ.get("STRATA_MAX_TOKENS", "32"))
API_KEY = os.environ.get("STRATA_API_KEY")
LONG_PROMPT_WORDS = int(os.environ.get("STRATA_LONG_PROMPT_WORDS", "300"))  # ~8 tokens each with the demo tokenizer


def _demo_png(seed: int, size: tuple[int, int] = (64, 64)) -> str:
    from PIL import Image

    rng = random.Random(seed)
    w, h = size
    img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(12):
        x, y = rng.randrange(w - 8), rng.randrange(h - 8)
        img.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, x + w // 8, y + h // 8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# Mixed sizes: a native-resolution model (Qwen-VL, Kimi-K2.5) makes each its own number of prompt tokens
IMAGES = [_demo_png(i, size) for i, size in enumerate([(64, 64), (448, 336), (1024, 768), (336, 896)])]
TOPICS = ["the sea", "lighthouses", "storms", "harbours", "the tides", "old ships", "the stars"]


class StrataUser(HttpUser):
    abstract = True
    wait_time = between(0.1, 0.5)
    model = "strata"

    def on_start(self) -> None:
        if API_KEY:  # a server started with --api-key
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"
        r = self.client.get("/v1/models", name="/v1/models")
        if r.ok:
            self.model = r.json()["data"][0]["id"]

    def chat(self, messages: list[dict[str, Any]], name: str) -> str:
        """Stream one chat completion: Locust's row times it to ``[DONE]``; its TTFT, gaps and tokens go to
        ``stream_stats``."""
        body = {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.7,
                "stream": True}
        t0 = time.perf_counter()
        stamps: list[float] = []
        text = []
        done = False
        with self.client.post("/v1/chat/completions", json=body, stream=True, name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return ""
            for raw in r.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or done:
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.failure(chunk["error"]["message"])
                    return ""
                delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta:
                    stamps.append(time.perf_counter())
                    text.append(delta)
            if not done:
                r.failure("stream ended without [DONE]")
                return ""
            e2e = time.perf_counter() - t0
            r.request_meta["response_time"] = e2e * 1e3  # the whole stream, not its headers
            r.request_meta["response_length"] = len(stamps)  # chunks streamed: tokens, one a chunk
            r.success()
        STATS.record(name, t0, stamps, e2e)
        return "".join(text)


class TextChatUser(StrataUser):
    weight = 4

    @task
    def short_chat(self) -> None:
        self.chat([{"role": "user", "content": f"Tell me something about {random.choice(TOPICS)}."}], "text chat")


class ImageChatUser(StrataUser):
    weight = 2
    takes_images: bool | None = None  # found once per process: does the served model take images?

    def on_start(self) -> None:
        super().on_start()
        if ImageChatUser.takes_images is None:
            ImageChatUser.takes_images = STATS.probe_images(self.host, self.model, API_KEY, IMAGES[0])

    @task
    def image_chat(self) -> None:
        if not ImageChatUser.takes_images:  # stepped aside with a note (``stream_stats``): no request
            time.sleep(1.0)
            return
        content = [{"type": "image_url", "image_url": {"url": random.choice(IMAGES)}},
                   {"type": "text", "text": "What is in this picture?"}]
        self.chat([{"role": "user", "content": content}], "image chat")


class MultiTurnUser(StrataUser):
    """Each turn resends the whole chat: the server should serve the shared prefix from its cache."""

    weight = 2

    def on_start(self) -> None:
        super().on_start()
        self.history: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a ship's log. " + " ".join(f"Entry {i}: calm." for i in range(20))}
        ]

    @task
    def next_turn(self) -> None:
        self.history.append({"role": "user", "content": f"And what about {random.choice(TOPICS)}?"})
        reply = self.chat(self.history, "multi-turn chat")
        self.history.append({"role": "assistant", "content": reply})
        if len(self.history) > 12:
            self.history = self.history[:1]


class LongPromptUser(StrataUser):
    weight = 1

    @task
    def long_prompt(self) -> None:
        words = " ".join(f"{random.choice(TOPICS)} {i}" for i in range(LONG_PROMPT_WORDS))
        self.chat([{"role": "user", "content": f"Summarize: {words}"}], "long prompt")


@events.test_stop.add_listener
def _report_streaming(environment: Any, **_: Any) -> None:
    """The TTFT, ITL and token rates of the run, beside Locust's table (``stream_stats``)."""
    options = getattr(environment, "parsed_options", None)
    STATS.report(getattr(options, "csv_prefix", None))
