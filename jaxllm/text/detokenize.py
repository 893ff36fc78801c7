"""Token ids to streamed text: incremental detokenization and stop strings.

`Detokenizer` decodes one id at a time with transformers' and vLLM's prefix-offset method: each
push decodes a short window (the ids of the previous emission, for context, plus the new ones)
and emits what the window adds past its known prefix. A piece that ends in U+FFFD means the last
id ended inside a UTF-8 character (byte-level BPE and byte-fallback pieces do that), so it is held
back until the character completes: a stream never carries a broken character.

`StopMatcher` finds stop strings in that text as OpenAI's API means them: generation ends where a
stop string first appears, the stop string itself and everything after it dropped. While
streaming, the longest tail of the text that is a prefix of some stop string is held back and
released only once it can no longer become one, so no part of a stop string ever reaches the
client. Matching is on characters, whatever the tokens: a stop string may span many tokens, start
at the first generated character, or overlap another.
"""

from __future__ import annotations

from typing import Sequence

MAX_STOP_STRINGS = 4  # OpenAI's bound


class Detokenizer:
    """Text of generated ids, one id at a time, complete characters only."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the ids of the previous emission, kept as context
        self._read = 0  # ids before this are emitted

    def _new_text(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read], self._skip)
        text = self._decode(self._ids[self._prefix:], self._skip)
        return text[len(prefix_text):]

    def push(self, token_id: int) -> str:
        """The text this id completes ('' while a character is unfinished)."""
        self._ids.append(token_id)
        piece = self._new_text()
        if not piece or piece.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return piece

    def flush(self) -> str:
        """What is held back, at the end of generation (an unfinished character is U+FFFD)."""
        piece = self._new_text()
        self._prefix = self._read = len(self._ids)
        return piece


class StopMatcher:
    """Cuts streamed text at the first stop string; holds back what may still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that is safe to emit now. After a match, `stopped` is True and the text before
        the stop string is the last piece; later pushes return ''."""
        if self.stopped:
            return ""
        buf = self._pending + text
        # The stop string that ends first, as if the text came one character at a time (a piece
        # of several characters can complete more than one); of those ending together, the longest.
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best + len_best, best)):
                best, len_best = i, len(s)
        if best is not None:
            self.stopped = True
            self._pending = ""
            return buf[:best]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """What is held back, at the end of generation (no stop string came)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
