"""Per-request sampling configuration, validated once at admission so the sampler can trust it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOKENS = 1_000_000_000
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # logits / 1e-5 stay finite for any fp32 logit a model produces
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024  # OpenAI's limit is 300 entries; more only slows the step


@dataclass
class SamplingParams:
    """How one request turns logits into tokens and when its generation ends."""

    max_tokens: int | None = 16  # None: the room the context leaves (OpenAI's default), fixed at intake
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> disabled
    seed: int | None = None  # per-request reproducibility
    # Matched on detokenized output; the stop string itself is excluded from the output text.
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k most likely
    # None: none; k >= 0: every prompt token's logprob (the first has none) and the k most likely at its position.
    # Computed from the prompt's own forward: such a request never starts from the prefix cache
    prompt_logprobs: int | None = None
    # logits processors (``core.logits_processors``); the defaults change nothing
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # transformers / vLLM: > 1 discourages every token seen, prompt included
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI: token id -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM: no end-of-sequence or stop token before this many output tokens
    # structured output: (kind, source), kind json | regex | choice | lark (``frontend.structured``)
    structured: tuple[str, str] | None = None
    # the grammar applies from this token on (a tool call's one-token opening marker): until the model samples
    # it the row is unconstrained, and costs no mask
    structured_trigger: int | None = None
    # the trigger is the grammar's first token (a call's marker), or comes just before the grammar's language
    # (the thinking's end tag: ``frontend.reasoning``)
    structured_trigger_in_grammar: bool = True
    # vLLM: False keeps special tokens in the text (a tool-call format whose markers are special tokens);
    # the end-of-sequence or stop token that ends the answer is never text
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the offending field, so API callers get an actionable message."""
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or not 1 <= self.max_tokens <= MAX_TOKENS):
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 or not _is_real(v) or not -100 <= v <= 100
                for t, v in self.logit_bias.items()):
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]")
        if self.structured is not None and (len(self.structured) != 2 or not all(isinstance(v, str) for v in self.structured)
                                            or self.structured[0] not in ("json", "regex", "choice", "lark")):
            raise ValueError(f"structured must be (json|regex|choice|lark, source), got {self.structured!r}")
        if self.structured_trigger is not None and (isinstance(self.structured_trigger, bool) or not isinstance(
                self.structured_trigger, int) or self.structured_trigger < 0 or self.structured is None):
            raise ValueError(f"structured_trigger must be a token id, with structured set, got {self.structured_trigger!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= MAX_TOKENS:
            raise ValueError(f"min_tokens must be an integer in [0, {MAX_TOKENS}], got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        """Deterministic argmax (no generator is consumed): temperature 0, or one so small that dividing
        the logits by it would overflow them (the limit of sampling as temperature -> 0 is argmax)."""
        return self.temperature < GREEDY_BELOW


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
