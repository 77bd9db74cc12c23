"""Build tiny, real Hugging Face LLaVA checkpoints locally, deterministically and offline.

Tests and demos need genuine HF checkpoints (config, sharded safetensors, tokenizer,
processor, chat template) without any network access, so everything here is built
from fixed seeds and an embedded corpus.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llava-llama", "llava-mistral", "llava-qwen2", "llava-mixtral")

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>", "<image>")
BOS, EOS, UNK, PAD, IMAGE = SPECIAL_TOKENS

# Large enough that random weights give clearly separated logits (0.02 yields near-ties).
INIT_RANGE = 0.2
ROPE_THETA = 10000.0
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Vicuna-v1 / LLaVA-1.5 conversation format: "<s>SYS USER: <image>\nQ ASSISTANT: A</s>USER: ..."
CHAT_TEMPLATE = (
    "{{- '<s>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}{%- set parts = message['content'] -%}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}{{- 'USER: ' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'ASSISTANT: ' -}}{%- endif -%}"
    "{%- for part in parts if part['type'] in ['image', 'image_url'] -%}{{- '<image>\\n' -}}{%- endfor -%}"
    "{{- parts | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -}}"
    "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- else -%}{{- ' ' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and
this small model has seen neither pictures nor words before today. What is this? It is
an image of a red circle on a blue background; the circle is 12 pixels wide.
USER: Describe the image. ASSISTANT: The image shows a cat sitting on a mat near a window.
There are 3 apples, 4 oranges and 10 bananas on the table: 17 pieces of fruit in total.
In 1969, humans first walked on the Moon. On July 20th, at 20:17 UTC, the lunar module
landed. Prices rose by 2.5% in 2023 (up from 1.8%), while wages grew 4.1% - a real gain!
Q: How many legs does a spider have? A: Eight. Q: And an insect? A: Six, usually.
Email me at someone@example.com or call +1 (555) 010-9999; the office opens at 9:00 am.
Large language models predict the next token. Vision encoders turn pixels into patches,
and a projector maps those patch features into the language model's embedding space.
"Hello," she said, "it's a beautiful day, isn't it?" He nodded & smiled [quietly] {twice}.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 42 #7 $19.99 50/50 a*b=c ~x^2.
The weather today is sunny with a high of 25 degrees and a low of 14 degrees Celsius.
"""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny checkpoint; equal specs build byte-identical shards."""

    arch: str = "llava-llama"
    seed: int = 0
    hidden: int = 64  # text hidden size
    layers: int = 2  # text layers
    heads: int = 4  # text attention heads
    kv_heads: int = 2  # GQA
    intermediate: int = 128
    vocab_size: int = 512  # target BPE vocab size (trained locally)
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 4
    image_size: int = 32
    patch_size: int = 8
    num_experts: int = 4  # mixtral only
    experts_per_tok: int = 2  # mixtral only
    sliding_window: int = 48  # mistral only (small, so tests exercise it)
    max_position_embeddings: int = 4096
    max_shard_size: str = "200KB"  # so even tiny models are sharded

    @property
    def image_seq_length(self) -> int:
        """Image tokens per image with strategy "default" (CLS dropped)."""
        return (self.image_size // self.patch_size) ** 2


def train_tokenizer(vocab_size: int, model_max_length: int):
    """Train a byte-level BPE on CORPUS and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token=UNK))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        add_bos_token=False,  # the chat template writes <s> itself
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
    if tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("special tokens did not get ids 0..4; token ids in configs would be wrong")
    return tok


def _text_config(spec: TinyModelSpec, vocab: int):
    """Decoder config for the requested architecture, sized by spec."""
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=INIT_RANGE,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
    )
    if spec.arch == "llava-llama":
        return LlamaConfig(**common)
    if spec.arch == "llava-mistral":
        return MistralConfig(sliding_window=spec.sliding_window, **common)
    if spec.arch == "llava-qwen2":
        return Qwen2Config(**common)
    if spec.arch == "llava-mixtral":
        return MixtralConfig(
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_tok,
            sliding_window=None,
            **common,
        )
    raise ValueError(f"unknown arch {spec.arch!r}; expected one of {ARCHITECTURES}")


def make_config(spec: TinyModelSpec, vocab: int, image_token_id: int):
    """Full LlavaConfig (CLIP vision tower + decoder) for spec."""
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_hidden * 2,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden,
        initializer_range=INIT_RANGE,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=_text_config(spec, vocab),
        image_token_id=image_token_id,
        image_seq_length=spec.image_seq_length,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def make_processor(spec: TinyModelSpec, tok):
    """LlavaProcessor whose <image> expands to spec.image_seq_length tokens."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
        resample=3,  # PIL bicubic
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=spec.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def _build_model(spec: TinyModelSpec, config):
    """Seeded random LlavaForConditionalGeneration in fp32 with a greedy generation config."""
    import torch
    from transformers import GenerationConfig, LlavaForConditionalGeneration

    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _perturb_constant_params(model, spec.seed)
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        do_sample=False,
    )
    return model


def _perturb_constant_params(model, seed: int) -> None:
    """Make biases nonzero and norm weights non-one, so kernels that drop them fail tests."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_RANGE)
            elif "norm" in name and name.endswith(".weight"):
                param.copy_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=gen))


def write_sha256sums(out_dir: Path) -> Path:
    """Write SHA256SUMS (sha256sum format) for every safetensors shard, for integrity checks."""
    lines = []
    for shard in sorted(out_dir.glob("*.safetensors")):
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        lines.append(f"{digest}  {shard.name}\n")
    path = out_dir / "SHA256SUMS"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def verify_sha256sums(out_dir: str | Path) -> bool:
    """True iff every file listed in SHA256SUMS exists and matches its digest."""
    out_dir = Path(out_dir)
    for line in (out_dir / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        digest, name = line.split("  ", 1)
        target = out_dir / name
        if not target.is_file() or hashlib.sha256(target.read_bytes()).hexdigest() != digest:
            return False
    return True


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while a tiny checkpoint is written: its shards take milliseconds, and a
    CLI that builds the demo model before it refuses a flag must still answer in one line."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def build_tiny_model(spec: TinyModelSpec, out_dir: str | Path) -> Path:
    """Write a complete offline-loadable HF LLaVA checkpoint for spec into out_dir."""
    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {spec.arch!r}; expected one of {ARCHITECTURES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    image_token_id = tok.convert_tokens_to_ids(IMAGE)
    config = make_config(spec, len(tok), image_token_id)
    model = _build_model(spec, config)
    with no_progress_bars():
        model.save_pretrained(out_dir, max_shard_size=spec.max_shard_size)
        make_processor(spec, tok).save_pretrained(out_dir)
    write_sha256sums(out_dir)
    logger.info("built %s (seed %d, vocab %d) in %s", spec.arch, spec.seed, len(tok), out_dir)
    return out_dir


def default_cache_dir() -> Path:
    """Root for cached artifacts; STRATA_CACHE overrides ~/.cache/strata."""
    return Path(os.environ.get("STRATA_CACHE", "~/.cache/strata")).expanduser()


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Build the default tiny model once (atomically) and return its directory."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "models" / "tiny-llava-llama-seed0"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build_tiny_model(TinyModelSpec(), tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache should be readable like any other
        os.rename(tmp, final)  # atomic: readers see nothing or a complete model
    except OSError:
        if not final.is_dir():
            raise
        logger.info("demo model appeared concurrently at %s", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def make_demo_image(path: Path, size: int = 64) -> Path:
    """Write a deterministic RGB PNG (gradient + shapes) for demos and tests."""
    from PIL import Image, ImageDraw

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (size, size))
    img.putdata(
        [(x * 255 // max(size - 1, 1), y * 255 // max(size - 1, 1), 128) for y in range(size) for x in range(size)]
    )
    draw = ImageDraw.Draw(img)
    q = size // 4
    draw.ellipse((q, q, 3 * q, 3 * q), fill=(220, 30, 30), outline=(255, 255, 255))
    draw.rectangle((size - q, 0, size - 1, q), fill=(20, 200, 60))
    img.save(path, format="PNG")
    return path
