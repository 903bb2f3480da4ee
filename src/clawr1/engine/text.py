"""The token-advance rule every engine follows (local, vLLM, SGLang, Tinker): append a sampled
token, extend the text, check end of sequence / stop sequences / length, and say what of the text
may be streamed yet.

Text is decoded incrementally (the prefix/read offsets of vLLM's detokenizer): each token decodes
a window of a few tokens, not the whole reply again, so a reply costs time linear in its length.
Text is held back while it could still be the start of a stop sequence (which OpenAI never returns)
or ends in half a UTF-8 character; when the generation ends its text is decoded once in full (the
stored text is exactly the tokenizer's), and the rest of its content is flushed.
"""

from __future__ import annotations

from typing import Any

from clawr1.core.types import Generation


class Advance:
    """One generation's progress through its tokens (one per request)."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], stops: tuple[str, ...], max_tokens: int):
        self.tokenizer, self.eos_ids, self.stops, self.max_tokens = tokenizer, eos_ids, stops, max_tokens
        self.emitted = 0  # characters of visible text already streamed
        self._prefix = 0  # token offset of the decode window's start
        self._read = 0  # tokens whose text is in `gen.text`

    def __call__(self, gen: Generation, token: int, logprob: float) -> tuple[str, str | None]:
        """Take one sampled token: (text to stream now, the finish reason or None)."""
        gen.token_ids.append(token)
        gen.logprobs.append(logprob)
        reason = None
        if token in self.eos_ids:
            reason = "stop"  # special tokens are not text: gen.text is unchanged
        else:
            before = len(gen.text)
            gen.text += self._new_text(gen.token_ids)
            gen.stop_match = self._first_stop(gen.text, before)  # a stop can only end in the new text
            if gen.stop_match is not None:
                reason = "stop"
            elif len(gen.token_ids) >= self.max_tokens:
                reason = "length"
        if reason is None:
            return self._visible(gen.text), None
        delta = self.finish(gen)
        return delta, "stop" if gen.stop_match is not None else reason

    def finish(self, gen: Generation) -> str:
        """At the end (a finish reason here, or the server's own end): the exact text, decoded once
        in full, and the content not streamed yet (cut at a matched stop sequence)."""
        gen.text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        # Matched again on the whole text: a stop that ended in half a character held back (the
        # reply then ran out of tokens, or ended) is only there now.
        gen.stop_match = self._first_stop(gen.text, 0)
        content = gen.content
        delta, self.emitted = content[self.emitted:], max(self.emitted, len(content))
        return delta

    def _first_stop(self, text: str, since: int) -> str | None:
        """The stop sequence that begins first in `text` among those ending after `since` (the
        content is cut there, so it never holds a stop), or None."""
        found = [(at, s) for s in self.stops if (at := text.find(s, max(0, since - len(s) + 1))) >= 0]
        return min(found)[1] if found else None

    def _new_text(self, ids: list[int]) -> str:
        """The text the tokens since `_read` add, or "" while they end in half a character."""
        window = self.tokenizer.decode(ids[self._prefix:self._read], skip_special_tokens=True)
        extended = self.tokenizer.decode(ids[self._prefix:], skip_special_tokens=True)
        if len(extended) <= len(window) or extended.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return extended[len(window):]

    def _visible(self, text: str) -> str:
        end = len(text.rstrip("\ufffd"))
        for stop in self.stops:
            # Only the text not streamed yet can be held back: a longer suffix that begins a stop
            # would have been held when its first character came (bounds the work a token to what
            # is held, not the whole reply).
            for n in range(min(len(stop) - 1, end - self.emitted), 0, -1):
                if text[end - n:end] == stop[:n]:
                    end -= n
                    break
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
