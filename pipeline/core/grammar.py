"""Structured output in the batched step: one llguidance matcher per constrained sequence, its allowed
tokens applied as a bitmask to that row's logits (every other row untouched), and each sampled token fed
back to its matcher.

The matcher lives on the sequence where it runs; a sequence that arrives mid-generation (a prefill hand-off
to decode) gets a fresh matcher fed with the tokens it has already produced, so the grammar's state is a
function of the tokens, like everything else that crosses a process. A grammar with a trigger token
(``SamplingParams.structured_trigger``: a tool call's opening marker) starts at that token: before it the
row is unconstrained and no mask is computed for it, and its matcher is fed from the trigger on. The tokenizer wrapper llguidance
needs (the vocabulary as a trie) is built once per engine, on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Any, Callable

import torch

from strata.pipeline.frontend.structured import grammar_for

log = logging.getLogger(__name__)


class GrammarRunner:
    """Masks and advances the constrained rows of a step (``EngineCore`` holds one)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer  # called once, on the first constrained request
        self.vocab_size = vocab_size
        self._tokenizer: Any = None

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer(), n_vocab=self.vocab_size)
        return self._tokenizer

    def matcher(self, seq: Any) -> Any:
        """The sequence's matcher, made (and fed its output so far, from its trigger on) where it runs."""
        if seq.grammar_matcher is None:
            from llguidance import LLMatcher

            kind, value = seq.params.structured
            matcher = LLMatcher(self._llg_tokenizer(), grammar_for(kind, value))
            out = seq.output_token_ids
            trigger = seq.params.structured_trigger
            start = 0 if trigger is None else out.index(trigger) if trigger in out else len(out)
            for token in out[start:]:  # produced (and accepted) elsewhere: a hand-off, say
                matcher.consume_token(token)
            seq.grammar_matcher = matcher
        return seq.grammar_matcher

    @staticmethod
    def constrained(seq: Any) -> bool:
        """The row's grammar applies now: it has one, and any trigger token it waits for has come. The
        output is searched for the trigger once per sequence object (one that arrived by a hand-off may
        carry it); after that ``accept`` starts the matcher when the trigger is sampled, so a waiting
        row costs nothing per step."""
        params = seq.params
        if params.structured is None:
            return False
        trigger = params.structured_trigger
        if trigger is None or seq.grammar_matcher is not None:
            return True
        if getattr(seq, "trigger_searched", False):  # (getattr: the bench's rows are plain namespaces)
            return False
        seq.trigger_searched = True
        return trigger in seq.output_token_ids

    def mask(self, logits: torch.Tensor, seqs: Seq[Any]) -> torch.Tensor:
        """``logits`` with each constrained row limited to the tokens its grammar allows next."""
        rows = [i for i, s in enumerate(seqs) if self.constrained(s)]
        if not rows:
            return logits
        import llguidance.torch as lt

        bitmask = lt.allocate_token_bitmask(len(seqs), self.vocab_size)
        bitmask.fill_(-1)  # every token allowed: the unconstrained rows
        for i in rows:
            lt.fill_next_token_bitmask(self.matcher(seqs[i]), bitmask, i)
        logits = logits.clone()
        lt.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return logits

    def accept(self, seq: Any, token: int) -> None:
        """Feed a sampled token to the sequence's matcher (a token the mask allowed); a grammar waiting for
        its trigger starts at it."""
        if not self.constrained(seq) and token != seq.params.structured_trigger:
            return
        matcher = self.matcher(seq)
        if not matcher.consume_token(token):
            log.warning("request %s: the grammar refused token %d (%s)", seq.request_id, token, matcher.get_error())

    def finished(self, seq: Any) -> bool:
        """The grammar is complete and allows nothing more: the answer ends here."""
        return seq.params.structured is not None and seq.grammar_matcher is not None and \
            seq.grammar_matcher.is_stopped()
