"""Turn one sample's growing list of token ids into text, and find stop strings in it.

Decoding token by token is wrong for byte-level vocabularies (one character may span several
tokens) and decoding everything each time is quadratic, so `TextTracker` re-decodes only a short
window: the tokens since the last clean boundary. A window whose text ends in U+FFFD (an
incomplete UTF-8 sequence) waits for more tokens.

Stop strings are searched only in the newly decoded text (plus the tail that could start a match).
On a match the text is cut before the stop string (or after it with `include_stop`), the tokens
after the one that completed the match are dropped, and the caller tells the engine to finish the
sample. While streaming, text that could be the start of a stop string is held back until it is
known not to be one. Without stop strings and streaming, the text is decoded once at the end.
"""

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextTracker:
    """Incremental detokeniser with stop-string matching for one sample."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        incremental: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.incremental = incremental or bool(self.stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped_by: str | None = None
        self._window_start = 0  # tokens before this are fully represented in self.text
        self._window_text_len = 0  # length of the decoded text of token_ids[_window_start:_read]
        self._read = 0
        self._emitted = 0
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> int:
        """Append tokens; returns how many of them belong to the sample (fewer when a stop string
        matched: the tokens after the one that completed it are dropped)."""
        if not self.incremental:
            self.token_ids.extend(token_ids)
            return len(token_ids)
        if not self.stop:  # nothing to find between tokens: decode the new ones together
            self.token_ids.extend(token_ids)
            self._advance()
            return len(token_ids)
        for used, token_id in enumerate(token_ids, start=1):
            if self.stopped_by is not None:
                return used - 1
            self.token_ids.append(token_id)
            self._advance()
            if self.stopped_by is not None:
                return used
        return len(token_ids)

    def _advance(self) -> None:
        window = self.token_ids[self._window_start :]
        window_text = self._decode(window)
        if len(window_text) <= self._window_text_len or window_text.endswith("\ufffd"):
            return  # nothing new yet, or an incomplete character: wait for the next token
        new_text = window_text[self._window_text_len :]
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new_text
        self._window_start, self._read = self._read, len(self.token_ids)
        self._window_text_len = len(self._decode(self.token_ids[self._window_start : self._read]))
        if self.stop:
            self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
            self.stopped_by = s

    def finish(self) -> None:
        """The sample ended: flush text still waiting for a complete character."""
        if not self.incremental:
            self.text = self._decode(self.token_ids)
        elif self.stopped_by is None and self._read < len(self.token_ids):
            window_text = self._decode(self.token_ids[self._window_start :])
            self.text += window_text[self._window_text_len :]
            self._read = len(self.token_ids)

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out; holds back a tail that may begin a stop string unless `final`."""
        end = len(self.text)
        if not final and self.stopped_by is None and self.stop:
            end -= self._possible_stop_prefix()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _possible_stop_prefix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest
