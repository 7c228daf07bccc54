"""Turn one sample's growing list of token ids into text, and find stop strings in it.

Decoding token by token is wrong for byte-level vocabularies (one character may span several
tokens) and decoding everything each time is quadratic, so `TextTracker` feeds each new token
to the tokenizer's own incremental decoder (`tokenizers.decoders.DecodeStream`, one call into
Rust per token), which holds back an incomplete UTF-8 sequence until it is complete.

Stop strings are searched only in the newly decoded text (plus the tail that could start a match).
On a match the text is cut before the stop string (or after it with `include_stop`), the tokens
after the one that completed the match are dropped, and the caller tells the engine to finish the
sample. While streaming, text that could be the start of a stop string is held back until it is
known not to be one. Without stop strings and streaming, the text is decoded once at the end.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream


class Tokenizer(Protocol):
    backend_tokenizer: Any  # the `tokenizers.Tokenizer` of a fast tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: int) -> str | None: ...


def decoder(tokenizer: Tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, or its `tokenizers` backend's decode when that gives the same text
    (a fast tokenizer that cleans up no spaces; streamed text is decoded by the backend
    alone anyway): transformers' own first converts every id in Python (~0.2 µs a token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # (fast tokenizers only)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


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
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self.incremental else None
        self._decoder = decoder(tokenizer)
        self._emitted = 0
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> int:
        """Append tokens; returns how many of them belong to the sample (fewer when a stop string
        matched: the tokens after the one that completed it are dropped)."""
        if not self.incremental:
            self.token_ids.extend(token_ids)
            return len(token_ids)
        if self.stopped_by is not None:
            return 0
        backend, step = self.tokenizer.backend_tokenizer, self._stream.step
        if not self.stop:  # nothing to find between tokens
            self.token_ids.extend(token_ids)
            self.text += "".join([piece for t in token_ids if (piece := step(backend, t))])
            return len(token_ids)
        for used, token_id in enumerate(token_ids, start=1):
            self.token_ids.append(token_id)
            piece = step(backend, token_id)
            if piece:
                search_from = max(0, len(self.text) - self._longest_stop + 1)
                self.text += piece
                self._find_stop(search_from)
                if self.stopped_by is not None:
                    return used
        return len(token_ids)

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

    def finish(self, ended_by_token: bool = False) -> None:
        """The sample ended: decode the lazy text, or flush a character still incomplete. With
        `ended_by_token` (its last token was an end-of-sequence or stop token) that token's text
        leaves the output unless `include_stop`, as in vLLM: `<|im_end|>` is not part of an
        answer decoded with skip_special_tokens = false."""
        if not self.incremental:
            self.text = self._decode(self.token_ids)
        elif self.stopped_by is None:
            full = self._decode(self.token_ids)
            if len(full) > len(self.text) and full.startswith(self.text):
                self.text = full
        if ended_by_token and not self.include_stop and self.stopped_by is None and self.token_ids:
            last = self._decode(self.token_ids[-1:])
            if last and self.text.endswith(last):
                self.text = self.text[: -len(last)]

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
