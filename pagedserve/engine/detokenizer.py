"""Incremental detokenization of one request's output, with stop strings.

Decoding token by token is wrong for byte-level and sentencepiece tokenizers: a character can
span tokens, and a token's leading space depends on what precedes it. So each step decodes a
short window of ids twice: [prefix_offset, read_offset) is text already emitted, kept as
context; [prefix_offset, end) is the same plus the new ids; the new text is the difference.
While the window's text ends in U+FFFD (a character still incomplete) the offsets stay put
and nothing is emitted.
"""

from __future__ import annotations

# How many prompt tokens seed the window, so that the first output token decodes in context.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns output token ids into text deltas for one request.

    `text` is the output text so far, cut at the first stop string (kept if
    include_stop_str_in_output). Deltas hold back the tail of `text` that could still be the
    start of a stop string; once a stop string matched (`stop_matched`) or after `finish()`,
    the deltas returned add up to `text`. As in vLLM, stop strings are looked for only once
    more than `min_tokens` tokens have been added.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # With the stop string kept, the cut falls after it: nothing emitted is ever retracted.
        self._hold_stop_prefixes = bool(self.stop) and not include_stop_str_in_output

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # A prompt ending inside a character would glue its bytes to the output's: start clean.
        if self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._ids = context  # context ids, then every output id
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.num_output_tokens = 0

        self.text = ""
        self.stop_matched: str | None = None
        self.finished = False
        self._emitted = 0  # length of the text already returned as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Appends output ids; returns the text that became final (possibly "")."""
        if self.finished or not token_ids:
            return ""
        self._ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        self._append(self._read_window(final=False))
        return self._take_delta()

    def finish(self) -> str:
        """End of generation: releases the held-back text (an incomplete character decodes as
        U+FFFD, as tokenizer.decode would). Later calls return ""."""
        if self.finished:
            return ""
        self._append(self._read_window(final=True))
        self.finished = True
        return self._take_delta()

    def _read_window(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _append(self, new_text: str) -> None:
        if not new_text:
            return
        start = len(self.text)
        self.text += new_text
        if self.stop and self.num_output_tokens > self.min_tokens:
            self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        # Only matches that end in the new text are new: the text before had none.
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[:i + len(s) if self.include_stop_str_in_output else i]
            self.stop_matched = s
            self.finished = True

    def _take_delta(self) -> str:
        end = len(self.text)
        if not self.finished and self._hold_stop_prefixes:
            end -= self._stop_prefix_len()
        delta = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        text = self.text
        for n in range(min(len(text), max(len(s) for s in self.stop) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) and len(s) > n for s in self.stop):
                return n
        return 0
