"""JSON bodies of completion and chat-completion responses, whole and as stream chunks.

Shapes follow OpenAI, with vLLM's token-id fields when the request sets `return_token_ids`
(completions: `prompt_token_ids` and `token_ids` on each choice; chat: `prompt_token_ids` on the
response, `token_ids` on each choice) and tandem's weight versions: `weight_versions` on every
choice (the versions that produced its tokens) and on the response (all of them).
"""

import json
import time
from dataclasses import dataclass
from functools import cached_property

from tandem.inference.generation import Choice
from tandem.inference.stop import Tokenizer

COMPACT = json.JSONEncoder(separators=(",", ":"))


class TokenTexts:
    """Cached text and bytes of single tokens, for logprob entries."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.byte_cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (chat logprobs' `bytes`): a token may hold part of a UTF-8
        character, which its text shows as U+FFFD; clients join the bytes of consecutive tokens
        to rebuild it. Read from a byte-level BPE's token string; other tokenizers: the text's."""
        cached = self.byte_cache.get(token_id)
        if cached is None:
            piece, table = self.tokenizer.convert_ids_to_tokens(token_id), self._byte_level
            if table is not None and isinstance(piece, str) and all(c in table for c in piece):
                cached = [table[c] for c in piece]
            else:
                cached = list(self(token_id).encode("utf-8"))
            self.byte_cache[token_id] = cached
        return cached

    @cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """Byte-level BPE's character → byte table (GPT-2's), when the tokenizer decodes so."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ != "ByteLevel":
            return None
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclass
class ResponseBuilder:
    """Formats one request's response. `top_logprobs` None means the client asked for no logprobs."""

    chat: bool
    request_id: str
    model: str
    token_texts: TokenTexts
    prompts: list[list[int]]
    top_logprobs: int | None
    return_token_ids: bool
    tokens_as_ids: bool

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    @cached_property
    def _event_head(self) -> str:
        """A stream chunk's event up to its choice, serialized once per response (not per token)."""
        header = json.dumps(self._header(self.chunk_object), separators=(",", ":"))
        return f'data: {header[:-1]},"choices":['

    # --- pieces -------------------------------------------------------------------------------

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def logprobs(self, choice: Choice, start: int, end: int, text_offset: int = 0) -> dict | None:
        if self.top_logprobs is None:
            return None
        ids = choice.token_ids[start:end]
        if self.chat:
            content = []
            for i, (token, logprob) in enumerate(zip(ids, choice.logprobs[start:end], strict=True)):
                alternatives = [
                    self._chat_entry(t, lp) for t, lp in choice.top_logprobs[start + i][: self.top_logprobs]
                ]
                content.append({**self._chat_entry(token, logprob), "top_logprobs": alternatives})
            return {"content": content}
        texts = [self.token_texts(t, self.tokens_as_ids) for t in ids]
        offsets, top = [], []
        for i, text in enumerate(texts):
            offsets.append(text_offset)
            text_offset += len(text)
            entry = {self.token_texts(t, self.tokens_as_ids): lp for t, lp in choice.top_logprobs[start + i]}
            entry[text] = choice.logprobs[start + i]
            top.append(entry)
        return {
            "tokens": texts,
            "token_logprobs": choice.logprobs[start:end],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_texts(token_id, self.tokens_as_ids)
        data = list(text.encode("utf-8")) if self.tokens_as_ids else self.token_texts.bytes(token_id)
        return {"token": text, "logprob": logprob, "bytes": data}

    def _header(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    # --- whole responses ------------------------------------------------------------------------

    def full(self, choices: list[Choice]) -> dict:
        body = self._header(self.object)
        body["choices"] = [self._full_choice(c) for c in choices]
        body["usage"] = self.usage(choices)
        body["weight_versions"] = sorted({v for c in body["choices"] for v in c["weight_versions"]})
        if self.chat and self.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0]
        return body

    def _full_choice(self, choice: Choice) -> dict:
        out: dict = {"index": choice.index}
        text = choice.tracker.text
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        out["logprobs"] = self.logprobs(choice, 0, len(choice.token_ids))
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = choice.stop_reason
        if self.return_token_ids:
            if not self.chat:
                out["prompt_token_ids"] = self.prompts[choice.prompt_index]
            out["token_ids"] = list(choice.token_ids)
        out["weight_versions"] = choice.weight_versions
        return out

    # --- stream chunks ----------------------------------------------------------------------------

    def first_chunks(self, n_choices: int) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        if not self.chat:
            return []
        chunks = []
        for index in range(n_choices):
            chunk = self._header("chat.completion.chunk")
            if index == 0 and self.return_token_ids:
                chunk["prompt_token_ids"] = self.prompts[0]
            chunk["choices"] = [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            chunks.append(chunk)
        return chunks

    def chunk_event(self, choice: Choice) -> str | None:
        """The server-sent event of the part of `choice` not streamed yet (a chunk with that one
        choice), or None when there is nothing new to say."""
        finished = choice.finish_reason is not None
        start, end = choice.streamed_tokens, len(choice.token_ids)
        text = choice.tracker.take_delta(final=finished)
        if start == end and not text and not finished:
            return None
        choice.streamed_tokens = end
        out: dict = {"index": choice.index}
        if self.chat:
            out["delta"] = {"content": text} if text or not finished else {}
        else:
            out["text"] = text
        out["logprobs"] = logprobs = self.logprobs(choice, start, end, choice.streamed_offset)
        if logprobs is not None and not self.chat:  # offsets count on across chunks, as OpenAI's do
            choice.streamed_offset += sum(len(token) for token in logprobs["tokens"])
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = choice.stop_reason
        if self.return_token_ids:
            if not self.chat and start == 0:
                out["prompt_token_ids"] = self.prompts[choice.prompt_index]
            out["token_ids"] = choice.token_ids[start:end]
        out["weight_versions"] = sorted(set(choice.versions[start:end]))
        return f"{self._event_head}{COMPACT.encode(out)}]}}\n\n"

    def usage_chunk(self, choices: list[Choice]) -> dict:
        chunk = self._header(self.chunk_object)
        chunk["choices"] = []
        chunk["usage"] = self.usage(choices)
        chunk["weight_versions"] = sorted({v for c in choices for v in c.versions})
        return chunk
