"""Generated tokens to text, piece by piece, for streaming: incomplete characters and stop strings held back.

``TextStream.add(token)`` returns the text that may be sent now. Two things are held back until the next
token settles them: a character still incomplete (a byte-level tokenizer's multi-byte character decodes to
U+FFFD until its last byte arrives), and an end of text that could be the start of a stop string (with
``stop=["\\n\\n"]``, a trailing ``"\\n"`` waits). When a stop string appears, the text ends just before it,
``stopped`` is set, and the stop string is never sent. ``finish()`` releases what was held back when the
generation ended for another reason. With ``incremental=False`` (a plain answer without stop strings:
nothing to send early, nothing to look for) tokens are only collected and decoded once, at ``finish()``.
"""

from __future__ import annotations

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, tokenizer, stops: list[str], incremental: bool = True):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.incremental = incremental or bool(self.stops)
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far (up to a stop string, once one is found)
        self.sent = 0  # characters of ``text`` already handed out
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Take one token; return the new text that is safe to send."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        if not self.incremental:
            return ""
        self.text = self._decode()
        if self.stops:
            # A stop string may straddle what was sent and the new text: search a little before ``sent``.
            longest = max(len(s) for s in self.stops)
            start = max(0, self.sent - longest)
            found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.text, self.stopped = self.text[: min(found)], True
                return self._release(len(self.text))
        safe = len(self.text.rstrip("\ufffd"))
        return self._release(safe - self._stop_prefix(self.text[:safe]))

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that a stop string starts with."""
        held = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta, self.sent = self.text[self.sent : upto], upto
        return delta

    def finish(self) -> str:
        """The generation ended (length, end of text): release everything held back."""
        if not self.incremental:
            self.text = self._decode()
        return self._release(len(self.text))
