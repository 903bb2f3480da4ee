"""The token-advance rule every engine follows (local, vLLM, SGLang, Tinker): append a sampled
token, extend the text, check end of sequence / stop sequences / length, and say what of the text
may be streamed yet.

Text is decoded incrementally (the prefix/read offsets of vLLM's detokenizer): each token decodes
a window of a few tokens, not the whole reply again, so a reply costs time linear in its length.
Text is held back while it could still be the start of a stop sequence (which OpenAI never returns)
or ends in half a UTF-8 character; when the generation ends its text is decoded once in full (the
stored text is exactly the tokenizer's), and the rest of its content is flushed.

Engines stream through `events` and `end`: a token's event waits while text up to it is held back,
so the text an end releases always has a token's event to ride, also when the end brings no token
(an abort, a server's own end). Streamed, it adds up to the content however the reply ended; before,
such an end put the held text in `gen.content` but dropped it from the stream.
"""

from __future__ import annotations

from typing import Any

from clawr1.core.types import Generation, TokenEvent


class Advance:
    """One generation's progress through its tokens (one per request)."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], stops: tuple[str, ...], max_tokens: int):
        self.tokenizer, self.eos_ids, self.stops, self.max_tokens = tokenizer, eos_ids, stops, max_tokens
        self.emitted = 0  # characters of visible text already streamed
        self._prefix = 0  # token offset of the decode window's start
        self._read = 0  # tokens whose text is in `gen.text`
        self._partial = False  # the tokens since `_read` end in half a character (held back)
        self._waiting: list[TokenEvent] = []  # events not streamed yet: text up to them is held back

    def events(self, gen: Generation, token: int, logprob: float) -> tuple[list[TokenEvent], str | None]:
        """Take one sampled token: (the events to stream now, the finish reason or None). Its event
        waits while text is held back (a possible stop's start, half a character), and goes out
        with the next event that leaves nothing held, or at the end (`end`, or a finish here)."""
        text, reason = self(gen, token, logprob)
        self._waiting.append(TokenEvent(token, logprob, text))
        if reason is None and (self._partial or self.emitted < len(gen.text)):
            return [], None
        ready, self._waiting = self._waiting, []
        return ready, reason

    def end(self, gen: Generation) -> list[TokenEvent]:
        """An end that brings no token (an abort, the server ending the reply itself): the exact text
        (`finish`), and the events that waited, the last one carrying the text released. With none
        waiting nothing was held, so there is no text to release."""
        delta = self.finish(gen)
        ready, self._waiting = self._waiting, []
        if ready:
            last = ready[-1]
            ready[-1] = TokenEvent(last.token_id, last.logprob, last.text + delta)
        return ready

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
        self._partial = extended.endswith("\ufffd")
        if len(extended) <= len(window) or self._partial:
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
