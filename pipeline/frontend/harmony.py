"""gpt-oss's harmony format, read: an answer is a run of messages, each a header and a body,
``[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`` ended by
``<|end|>``, ``<|return|>`` or ``<|call|>`` (the first message's ``<|start|>assistant`` is the prompt's). The
reasoning reader (``reasoning.Harmony``) and the tool-call reader (``tools.harmony_format.HarmonyCalls``) both walk it
here, so they agree on where a message begins and ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.pipeline.frontend.stream_text import open_marker_held_back

MESSAGE, CHANNEL, CONSTRAIN = "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
FUNCTIONS = "to=functions."


@dataclass(frozen=True)
class HarmonyMessage:
    header: str  # everything before <|message|>
    body: str  # as far as settled: a marker cut at the end of an unfinished answer is held back
    closed: bool  # its end marker was written

    @property
    def channel(self) -> str:
        return self.header.partition(CHANNEL)[2].split(" ", 1)[0].split("<|", 1)[0]

    @property
    def recipient(self) -> str | None:
        """Whom the message is addressed to (``functions.NAME``), or None (the user: reasoning or answer)."""
        if "to=" not in self.header:
            return None
        return self.header.split("to=", 1)[1].split(" ", 1)[0].split("<|", 1)[0]


def harmony_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of ``text`` whose header is complete; the last may be unfinished."""
    out, at = [], 0
    while (head_end := text.find(MESSAGE, at)) >= 0:
        start = head_end + len(MESSAGE)
        end, close = min(((i, m) for m in ENDS if (i := text.find(m, start)) >= 0), default=(-1, ""))
        body = text[start:end] if end >= 0 else text[start:] if final else open_marker_held_back(text[start:])
        out.append(HarmonyMessage(text[at:head_end], body, end >= 0))
        if end < 0:
            break
        at = end + len(close)
    return out
