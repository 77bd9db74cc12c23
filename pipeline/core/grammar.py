"""Structured output in the batched step: one llguidance matcher per constrained sequence, its allowed
tokens applied as a bitmask to that row's logits (every other row untouched), and each sampled token fed
back to its matcher.

**Off the step loop.** A grammar compiles against the vocabulary when its first mask is computed, which
can take seconds; the vocabulary's own trie is built once per engine. Both happen on a compile thread of
this runner (with a deep stack: llguidance's compiler recurses), and the scheduler holds a constrained
sequence back (:meth:`GrammarRunner.ready`) until its grammar is compiled, while every other sequence
keeps stepping. A compiled grammar is kept as a template; each sequence runs a copy of it.

**Where it runs.** The matcher lives on the sequence; a sequence that arrives mid-generation (a prefill
hand-off to decode) gets a fresh copy fed with the tokens it has already produced, so the grammar's state is
a function of the tokens, like everything else that crosses a process. A grammar with a trigger token
(``SamplingParams.structured_trigger``: a tool call's opening marker) starts at that token: before it the
row is unconstrained and no mask is computed for it. A trigger outside the grammar (the thinking's end tag,
``structured_trigger_in_grammar`` false) starts it with the token after.

**Only the grammar says stop.** A matcher that errs (a limit hit mid-answer, a token it refuses) fails its
row alone, never as a ``stop``. A stop token (EOS, ``stop_token_ids``) ends a constrained answer only where
the grammar is complete; elsewhere it is whatever the grammar makes of it (content it allows, or masked),
so ``finish_reason: stop`` on a constrained row means the text is in the grammar's language.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any, Callable

import torch

from strata.kernels.token_bitmask import apply_token_bitmask
from strata.pipeline.frontend.structured import grammar_for, llg_tokenizer, parser_limits, tokenizer_spec
from strata.pipeline.parallel.fault_points import stall_point

log = logging.getLogger(__name__)
COMPILE_STACK_BYTES = 256 << 20  # far deeper than the sandbox's 8 MiB: what compiled there compiles here
TEMPLATES = 64  # compiled grammars kept (sequences hold their own copies)


class GrammarError(RuntimeError):
    """A grammar failed where it runs (compile or mid-answer): its row ends with this message."""


class _Template:
    """One compiled grammar (a matcher at its start) or why it did not compile."""

    __slots__ = ("matcher", "error", "done")

    def __init__(self) -> None:
        self.matcher: Any = None
        self.error: str | None = None
        self.done = threading.Event()


class GrammarRunner:
    """Masks and advances the constrained rows of a step (``EngineCore`` holds one)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Seq[int] = ()) -> None:
        self._hf_tokenizer = hf_tokenizer  # called once, on the compile thread
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)  # the engine's: llguidance knows only the tokenizer's own
        self._tokenizer: Any = None
        self._templates: OrderedDict[tuple[str, str], _Template] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[tuple[str, str] | None, _Template | None] | None] = queue.SimpleQueue()
        self._compiled = threading.Condition()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ compiling, off the step loop
    def ready(self, seq: Any) -> bool:
        """Whether ``seq`` may be scheduled: it has no grammar, or its grammar is compiled (or failed to,
        which its first mask reports). Queues the compile the first time a grammar is seen."""
        if seq.params.structured is None or getattr(seq, "grammar_template", None) is not None:
            return True
        template = self._template(seq.params.structured)
        if not template.done.is_set():
            return False
        seq.grammar_template = template  # kept by the sequence: the cache may drop it later
        return True

    def wait(self, timeout: float) -> None:
        """Block until some compile finishes or ``timeout`` passes (a step with nothing else to run)."""
        with self._compiled:
            self._compiled.wait(timeout)

    def _template(self, spec: tuple[str, str]) -> _Template:
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
            template = self._templates[spec] = _Template()
            while len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
            self._start()
        self._jobs.put((spec, template))
        return template

    def _start(self) -> None:
        if self._thread is not None:
            return
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._compile_loop, name="grammar-compile", daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def _compile_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            spec, template = job
            if spec is None:  # warm(): the tokenizer alone
                try:
                    self._llg_tokenizer()
                except Exception:  # noqa: BLE001 - the first grammar reports it
                    log.debug("the grammar tokenizer could not be built ahead", exc_info=True)
                continue
            assert template is not None
            try:
                template.matcher = self._compile(spec)
            except Exception as exc:  # noqa: BLE001 - the sequences that need it fail with the reason
                log.warning("a %s grammar failed to compile: %s", spec[0], exc)
                template.error = f"the {spec[0]} grammar could not be compiled: {str(exc).splitlines()[0]}"
            template.done.set()
            with self._compiled:
                self._compiled.notify_all()

    def _compile(self, spec: tuple[str, str]) -> Any:
        from llguidance import LLMatcher

        stall_point("grammar_compile")
        matcher = LLMatcher(self._llg_tokenizer(), grammar_for(*spec), limits=parser_limits(), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask compiles the lexer against the vocabulary
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return matcher

    def warm(self) -> None:
        """Build the vocabulary's trie now, on the compile thread (a server calls this at start: the build
        holds the GIL for ~0.5 s on a 49K vocabulary, which would otherwise land beside the first request)."""
        with self._lock:
            self._start()
        self._jobs.put((None, None))

    def close(self) -> None:
        self._jobs.put(None)

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:  # as the front door's grammar sandbox builds it
            self._tokenizer = llg_tokenizer(tokenizer_spec(self._hf_tokenizer()), self.vocab_size)
        return self._tokenizer

    # ------------------------------------------------------------ the step
    def matcher(self, seq: Any) -> Any:
        """The sequence's matcher, made (a copy of its compiled grammar, fed its output so far from its
        trigger on) where it runs. GrammarError if the grammar did not compile."""
        if seq.grammar_matcher is None:
            template = getattr(seq, "grammar_template", None)
            if template is None:  # not through the scheduler (the bench): compile here and wait
                template = self._template(seq.params.structured)
                template.done.wait()
                seq.grammar_template = template
            if template.error is not None:
                raise GrammarError(template.error)
            matcher = template.matcher.deep_copy()
            out = seq.output_token_ids
            trigger = seq.params.structured_trigger
            after = 0 if seq.params.structured_trigger_in_grammar else 1  # a tag before the language is not fed
            start = 0 if trigger is None else out.index(trigger) + after if trigger in out else len(out)
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

    def mask(self, logits: torch.Tensor, seqs: Seq[Any]) -> tuple[torch.Tensor, dict[int, str]]:
        """``logits`` with each constrained row limited to the tokens its grammar allows next (and, where
        the grammar is complete, the row's stop tokens), and the rows whose grammar failed: row -> why."""
        rows = [i for i, s in enumerate(seqs) if self.constrained(s)]
        if not rows:
            return logits, {}
        failed: dict[int, str] = {}
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for j, i in enumerate(rows):
            try:
                matcher = self.matcher(seqs[i])
            except GrammarError as exc:
                failed[i] = str(exc)
                continue
            word = bitmask[j]
            matcher.unsafe_compute_mask_ptr(word.data_ptr(), word.numel() * word.element_size())
            if matcher.is_error():
                failed[i] = f"the output grammar could not be followed: {_first_line(matcher.get_error())}"
            elif matcher.is_accepting():
                _allow(bitmask, j, self._stop_tokens(seqs[i]))
        logits = logits.clone()
        apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return logits, failed

    def accept(self, seq: Any, token: int) -> str | None:
        """Feed a sampled token to the sequence's matcher (a token its mask allowed); a grammar waiting for
        its trigger starts at it. A stop token where the grammar is complete ends the answer and is not fed.
        Returns why the row must fail (the matcher refused the token), else None."""
        starts = not self.constrained(seq)
        if starts and token != seq.params.structured_trigger:
            return None
        try:
            matcher = self.matcher(seq)
        except GrammarError as exc:
            return str(exc)
        if starts and not seq.params.structured_trigger_in_grammar:
            return None  # the tag that ends the thinking: the grammar starts with the next token
        if self._ends_answer(seq, token) and matcher.is_accepting():
            seq.grammar_stop = True  # a stop where the language is complete: the engine's stop rules end it
            return None
        if not matcher.consume_token(token):
            return f"the output grammar could not be followed: {_first_line(matcher.get_error())}"
        return None

    @staticmethod
    def stop_applies(seq: Any, token: int) -> bool:
        """Whether a stop token just sampled ends ``seq``'s answer: always on an unconstrained row; on a
        constrained one only where its grammar was complete (``accept`` marked it)."""
        if seq.params.structured is None or seq.grammar_matcher is None:
            return True
        return bool(getattr(seq, "grammar_stop", False))

    def _stop_tokens(self, seq: Any) -> list[int]:
        params = seq.params
        eos = () if params.ignore_eos else self.eos_token_ids
        return [t for t in (*eos, *params.stop_token_ids) if 0 <= t < self.vocab_size]

    def _ends_answer(self, seq: Any, token: int) -> bool:
        """``token`` is one of ``seq``'s stop tokens (EOS unless ignored, or a stop token id)."""
        params = seq.params
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def finished(self, seq: Any) -> bool:
        """The grammar is complete and allows nothing more: the answer ends here."""
        matcher = seq.grammar_matcher
        return seq.params.structured is not None and matcher is not None and matcher.is_stopped() and \
            not matcher.is_error()


def _allow(bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
    """Set the bits of ``tokens`` in one row of an llguidance bitmask (int32 words, bit t % 32 of word t // 32)."""
    for t in tokens:
        word, bit = divmod(t, 32)
        bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)


def _first_line(error: str) -> str:
    return (error.strip().splitlines() or ["unknown error"])[0]
