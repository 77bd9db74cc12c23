"""Speculative decoding with the checkpoint's own MTP layer (DeepSeek-V3, GLM-4.5): the drafter equals
transformers' layers, answers are exact through every mode, and what it cannot run is refused in a line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import build, greedy, tokens_through_handoff
from strata.checkpoints.mtp_layer import add_mtp_layer
from strata.checkpoints.tiny_text_models import build_tiny_text_model
from strata.pipeline.contract.config import EngineConfig, SpeculativeConfig
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.decoder import LanguageModel

MTP = {"method": "mtp", "num_speculative_tokens": 1}
PROMPTS = ("the cat sat on the mat. the cat sat on the mat. the cat", "one two three one two three one",
           "hello there, how are you", "a b a b a b a b a b")


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {arch: add_mtp_layer(build_tiny_text_model(arch, root / arch)) for arch in ("deepseek_v3", "glm4_moe")}


def _outputs(engine, requests: list[dict]) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(requests)]


def _reference_mtp_logits(model_dir: Path, ids: list[int], next_token: int) -> torch.Tensor:
    """The MTP layer at every position, from transformers' modules: the model's final hidden states, the
    family's decoder layer at index num_hidden_layers loaded from the checkpoint, the model's rotary and head."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    layers = hf.config.num_hidden_layers
    prefix = f"model.layers.{layers}."
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, shard in index.items():
        if name.startswith(prefix):
            with safe_open(model_dir / shard, "pt") as f:
                tensors[name[len(prefix):]] = f.get_tensor(name)
    layer = type(hf.model.layers[0])(hf.config, layers).eval()
    own = layer.state_dict()
    missing, _ = layer.load_state_dict({k: v for k, v in tensors.items() if k in own}, strict=False)
    assert not missing

    def norm(name: str):
        n = type(hf.model.norm)(hf.config.hidden_size, hf.config.rms_norm_eps)
        n.weight.data.copy_(tensors[f"{name}.weight"])
        return n

    with torch.no_grad():
        x = torch.tensor([ids])
        hidden = hf.model(x).last_hidden_state[0]
        embeds = hf.model.embed_tokens(torch.tensor(ids[1:] + [next_token]))
        embeds[0] = 0.0  # position 0: no prediction behind it
        joined = torch.cat([norm("enorm")(embeds), norm("hnorm")(hidden)], dim=-1) @ tensors["eh_proj.weight"].T
        positions = torch.arange(len(ids))[None]
        out = layer(joined[None], attention_mask=None, position_ids=positions,
                    position_embeddings=hf.model.rotary_emb(joined[None], positions))
        out = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(norm("shared_head.norm")(out[0]))


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_the_mtp_layer_predicts_as_transformers_layers_do(arch: str, mtp_models: dict[str, Path], monkeypatch) -> None:
    """Prefilled in 8-token chunks, the drafter's logits at every prompt position (its KV read back across
    chunks) equal the same layer in transformers' modules, to fp32 rounding."""
    rows: dict[int, torch.Tensor] = {}
    original = LanguageModel.draft

    def recording(self, token_ids, hidden, positions, kv, meta, backend):
        out = original(self, token_ids, hidden, positions, kv, meta, backend)
        for p, row in zip(positions.tolist(), self.logits(out)):
            rows.setdefault(p, row)
        return out

    monkeypatch.setattr(LanguageModel, "draft", recording)
    engine = build(mtp_models[arch], speculative=MTP, prefill_chunk_tokens=8, max_num_batched_tokens=8,
                   max_num_seqs=8)
    prompt = PROMPTS[0] + " " + PROMPTS[1]
    request = engine.generate([{"prompt": prompt, "params": greedy(1)}])[0]
    ids = engine.intake.make_request("r", greedy(1), prompt=prompt)[0].prompt_token_ids
    assert len(ids) > 16  # three chunks at least
    ours = torch.stack([rows[p] for p in range(len(ids))])
    want = _reference_mtp_logits(mtp_models[arch], list(ids), request.output_token_ids[0])
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_accepted_and_rejected_drafts_keep_the_mtp_cache_exact(mtp_models: dict[str, Path], monkeypatch) -> None:
    """With drafts that hold two steps in three (an oracle stands in for a trained MTP layer), the answer is
    plain decoding's, and the MTP layer's output at every position of prompt and answer, written as decode
    accepted and rejected, equals transformers' layers over the whole sequence."""
    from strata.pipeline.core.mtp_drafts import MTPProposer

    model = mtp_models["deepseek_v3"]
    params = greedy(20, ignore_eos=True)
    plain = build(model)
    answer = plain.generate([{"prompt": PROMPTS[2], "params": params}])[0].output_token_ids
    prompt_ids = plain.intake.make_request("r", params, prompt=PROMPTS[2])[0].prompt_token_ids
    whole = list(prompt_ids) + answer
    rows: dict[int, torch.Tensor] = {}
    original_draft, original_propose = LanguageModel.draft, MTPProposer.propose

    def recording(self, token_ids, hidden, positions, kv, meta, backend):
        out = original_draft(self, token_ids, hidden, positions, kv, meta, backend)
        rows.update(zip(positions.tolist(), self.logits(out)))
        return out

    def oracle(self, seq, limit):
        drafted = original_propose(self, seq, limit)  # the layer's own draft was made; an oracle replaces it
        n = seq.num_tokens
        if not drafted or n >= len(whole):
            return drafted
        return [whole[n] if n % 3 else (whole[n] + 1) % 512]

    monkeypatch.setattr(LanguageModel, "draft", recording)
    monkeypatch.setattr(MTPProposer, "propose", oracle)
    spec = build(model, speculative=MTP)
    assert _outputs(spec, [{"prompt": PROMPTS[2], "params": params}]) == [answer]
    stats = spec.core.speculation.to_dict()
    assert 0 < stats["accepted"] < stats["drafted"]
    ours = torch.stack([rows[p] for p in range(len(whole) - 1)])
    want = _reference_mtp_logits(model, whole[:-1], whole[-1])
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", ["plain", "chunked", "preempting", "spilling", "prefix_hit"])
def test_greedy_answers_are_the_same_with_mtp_on_and_off(make: str, mtp_models: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """Drafts accepted or not, the answers are plain decoding's: in chunks, preempted and recomputed, with
    older KV in the host tier, and from a prefix the cache already holds (its MTP KV adopted with the rest)."""
    model = mtp_models["deepseek_v3"]
    requests = [{"prompt": p, "params": greedy(24, ignore_eos=True)} for p in PROMPTS]
    config: dict = {}
    if make == "chunked":
        config = dict(prefill_chunk_tokens=8, max_num_batched_tokens=16, max_num_seqs=4)
    elif make == "preempting":
        requests = [{"prompt": r["prompt"] * 3, "params": greedy(40)} for r in requests]
        config = dict(num_kv_blocks=14, max_num_batched_tokens=64, prefill_chunk_tokens=32, enable_prefix_caching=False)
    elif make == "spilling":
        requests = [{"prompt": " ".join(["the harbour light"] * 60), "params": greedy(24)}]
        config = dict(num_kv_blocks=10, prefill_chunk_tokens=32, host_kv_blocks=200, host_kv_dir=str(tmp_path / "h"))
    plain, spec = build(model), build(model, speculative=MTP, **config)
    want = _outputs(plain, requests)
    assert _outputs(spec, requests) == want
    if make == "prefix_hit":
        longer = [{"prompt": r["prompt"] * 2, "params": r["params"]} for r in requests]
        assert _outputs(spec, longer) == _outputs(plain, longer)
        again = spec.generate(longer)
        assert [o.output_token_ids for o in again] == _outputs(plain, longer)
        assert all(o.num_cached_tokens > 0 for o in again)
    stats = spec.core.speculation.to_dict()
    assert stats["verifications"] > 0 and stats["drafted"] == stats["verifications"]
    if make == "preempting":
        assert spec.scheduler.num_preemptions > 0
    if make == "spilling":
        assert spec.kv.spills.peak > 4
    spec.kv.pool.check_invariants()


def test_mtp_drafts_through_the_hand_off(mtp_models: dict[str, Path], tmp_path: Path) -> None:
    """Prefilled in one service (the MTP layer's KV computed there, to the first sampled token), decoded
    with MTP drafts in another over the host tier: the plain engine's answer."""
    model = mtp_models["deepseek_v3"]
    plain = build(model)
    want = plain.generate([{"prompt": PROMPTS[0], "params": greedy(20, ignore_eos=True)}])[0].output_token_ids
    config = EngineConfig(speculative=MTP, host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(model, config, plain, [], PROMPTS[0], greedy(20, ignore_eos=True)) == want


def test_the_mtp_cache_is_another_cache(mtp_models: dict[str, Path]) -> None:
    """The drafter's layer is one more layer of every block, so its fingerprint is another model's: a tier
    filled with MTP on is never read with it off."""
    model = mtp_models["deepseek_v3"]
    plain, spec = build(model), build(model, speculative=MTP)
    assert spec.kv.layout.num_layers == plain.kv.layout.num_layers + 1
    assert spec.kv.fingerprint != plain.kv.fingerprint


def test_what_mtp_cannot_run_is_refused_in_one_line(mtp_models: dict[str, Path], llama_dir: Path,
                                                    tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers.*none: use ngram"):
        build(llama_dir, speculative=MTP)
    no_layer = tmp_path / "no_layer"  # the config promises the layer, the weights do not hold it
    shutil.copytree(mtp_models["deepseek_v3"], no_layer)
    (no_layer / "model-mtp.safetensors").unlink()
    index = json.loads((no_layer / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "model-mtp.safetensors"}
    (no_layer / "model.safetensors.index.json").write_text(json.dumps(index))
    (no_layer / "SHA256SUMS").write_text("".join(line for line in (no_layer / "SHA256SUMS").read_text().splitlines(True)
                                                 if "model-mtp" not in line))
    with pytest.raises(ModelConfigError, match="no layer 3 .its multi-token-prediction layer."):
        build(no_layer, speculative=MTP)
    with pytest.raises(ModelConfigError, match="tp=1 only"):
        build(mtp_models["deepseek_v3"], speculative=MTP, tp=2)
    with pytest.raises(ValueError, match="one token a step"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="ngram settings"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=1, prompt_lookup_max=3)


def test_a_failing_drafter_costs_drafts_never_an_answer(mtp_models: dict[str, Path], monkeypatch) -> None:
    """The MTP layer raising on every step (a bug, a bad row): each step logs it and verifies no draft, and
    every request still gets plain decoding's answer, with no block left held."""
    model = mtp_models["deepseek_v3"]
    requests = [{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS]
    want = _outputs(build(model), requests)

    def broken(self, *args, **kwargs):
        raise RuntimeError("the drafter broke")

    monkeypatch.setattr(LanguageModel, "draft", broken)
    spec = build(model, speculative=MTP)
    outs = spec.generate(requests)
    assert [o.output_token_ids for o in outs] == want and all(o.error is None for o in outs)
    assert spec.core.speculation.verifications == 0 and spec.kv.pool.stats()["in_use"] == 0
