"""The bad-input corpus (``tests/data/bad_inputs.json``) against the real server, in both serving
modes: every case is an OpenAI-style 4xx JSON error, and a normal request right after it works.

The corpus is data so that a new hostile input found in the field is one entry, not a new test."""

from __future__ import annotations

import base64
import io
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from helpers import MODEL_NAME

CORPUS = json.loads((Path(__file__).parent / "data" / "bad_inputs.json").read_text())["cases"]


def _image(kind: str) -> bytes:
    if kind == "not-an-image":
        return b"definitely not an image"
    buf = io.BytesIO()
    if kind.startswith("noise-"):  # incompressible: larger than the test server's max_image_bytes
        side = int(kind.split("-")[1])
        Image.effect_noise((side, side), 64).convert("RGB").save(buf, format="PNG")
    else:  # "WxH": a tiny file with an absurd shape
        w, h = (int(x) for x in kind.split("x"))
        Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _fill_images(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("$IMAGE:"):
        return "data:image/png;base64," + base64.b64encode(_image(value[len("$IMAGE:"):])).decode()
    if isinstance(value, dict):
        return {k: _fill_images(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_images(v) for v in value]
    return value


def request_bytes(case: dict[str, Any]) -> bytes:
    """The exact bytes a case sends (see the corpus's ``_about``)."""
    if "raw" in case:
        return case["raw"].encode("utf-8", "surrogatepass")
    if "raw_hex" in case:
        return bytes.fromhex(case["raw_hex"])
    if "nested" in case:
        return b"[" * case["nested"] + b"]" * case["nested"]
    if "padded_to_bytes" in case:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        body["padding"] = "x" * case["padded_to_bytes"]
        return json.dumps(body).encode()
    body = _fill_images(case["json"])
    if "guided" in case:
        kind, n = case["guided"]
        body.update(_guided(kind, n))
    if "deepen" in case:
        field, levels = case["deepen"]
        value: Any = "x"
        for _ in range(levels):
            value = [value]
        body[field] = value
    return json.dumps(body).encode()


def _guided(kind: str, n: int) -> dict[str, Any]:
    """A structured-output spec too large to write out in the corpus (see its ``_about``)."""
    if kind == "ref_chain":
        defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return {"guided_json": {"$defs": defs, "$ref": "#/$defs/d0"}}
    if kind == "rule_chain":
        rules = "\n".join(f"r{i}: r{i + 1}" for i in range(n))
        return {"guided_grammar": f'start: r0\n{rules}\nr{n}: "x"\n'}
    if kind == "choices":
        return {"guided_choice": [f"choice {i}" for i in range(n)]}
    assert kind == "deep_json", kind
    return {"guided_json": "[" * n + "]" * n}


def _raw_post(base_url: str, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    """POST over a plain socket, headers exactly as given; the server must answer before the body ends."""
    host, port = base_url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in {"host": host, "connection": "close", **headers}.items())
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + content)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                header_part, body = data.split(b"\r\n\r\n", 1)
                length = next((int(line.split(b":")[1]) for line in header_part.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(body) >= length:
                    break
    status_line, *header_lines = header_part.decode().split("\r\n")
    parsed = dict(line.split(": ", 1) for line in header_lines)
    return httpx.Response(int(status_line.split()[1]), headers=parsed, content=body[:length])


def test_the_corpus_has_at_least_forty_kinds() -> None:
    assert len({c["id"] for c in CORPUS}) == len(CORPUS) >= 40


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_bad_input_is_a_4xx_json_error_and_the_server_keeps_serving(any_server, case: dict[str, Any]) -> None:
    headers = {"content-type": "application/json", **case.get("headers", {})}
    content = request_bytes(case)
    if "content-length" in headers:  # a lying header: no HTTP client sends one, so write it by hand
        r = _raw_post(any_server.base_url, case["path"], content, headers)
    else:
        r = httpx.post(any_server.base_url + case["path"], content=content, headers=headers, timeout=60)
    assert r.status_code == case["status"], r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert "Traceback" not in err["message"] and "/work/" not in err["message"]
    if "code" in case:
        assert err["code"] == case["code"]
    if "message" in case:
        assert case["message"] in err["message"], err["message"]
    ok = httpx.post(any_server.base_url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
