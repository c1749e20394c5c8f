"""Prompt lookup ("ngram" speculation): draft what followed an earlier occurrence of the last n tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are the pattern; the
earliest earlier occurrence of it wins, and the drafts are the tokens that followed that occurrence
(fewer near the end of the list). The first n that matches decides. This is vLLM's rule.

The search runs in C: tokens are packed as 32-bit integers and `bytes.find` scans them. Packing a
Python list costs about 11 ns a token, more than the search; with a `request_id` the packed tokens
are kept between calls and only the new ones are packed.
"""

from __future__ import annotations

import struct
from typing import Hashable, Sequence

from pagedserve.spec_decode.token_history import TokenHistory

_TOKEN_BYTES = 4


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian 32-bit integers."""
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**31): {e}") from None


def earliest_match(packed: bytes | bytearray, num_tokens: int, n: int, begin: int = 0) -> int:
    """Start of the earliest occurrence, at token `begin` or later, of the last `n` tokens that ends
    before the last token; -1 when there is none. `packed` holds `num_tokens` tokens."""
    width = n * _TOKEN_BYTES
    pattern = packed[len(packed) - width:]
    end = (num_tokens - 1) * _TOKEN_BYTES  # the occurrence must leave a token after it
    pos = packed.find(pattern, begin * _TOKEN_BYTES, end)
    while pos > 0 and pos % _TOKEN_BYTES:  # a hit that straddles two tokens
        pos = packed.find(pattern, pos + 1, end)
    return -1 if pos < 0 else pos // _TOKEN_BYTES


def lookup(packed: bytes | bytearray, num_tokens: int, min_n: int, max_n: int) -> tuple[int, int] | None:
    """(start, n) of the match the drafts follow: the longest n in [min_n, max_n], earliest start."""
    max_n = min(max_n, num_tokens - 1)
    if max_n < min_n:
        return None
    start = earliest_match(packed, num_tokens, min_n)
    if start < 0:
        return None
    n = min_n
    # Grow n while it matches: a match of n + 1 tokens holds one of n a token later, so it starts at
    # start - 1 or after, and when n + 1 tokens have none, no longer pattern has one. Text that
    # repeats little costs two scans, text that repeats a lot a few short ones.
    while n < max_n:
        longer = earliest_match(packed, num_tokens, n + 1, max(0, start - 1))
        if longer < 0:
            break
        start, n = longer, n + 1
    return start, n


class NgramProposer:
    """Prompt-lookup drafts over a request's own tokens (prompt and output so far).

    The earliest occurrence is vLLM's choice and is kept: drafts match vLLM's, and an early
    occurrence leaves the most tokens after it (a recent one, in a loop near the end of the text,
    is cut short by the end).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        for name, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._requests: dict[Hashable, tuple[TokenHistory, bytearray]] = {}

    @property
    def num_requests(self) -> int:
        """Requests whose packed tokens are kept (until `finish` or `abort`)."""
        return len(self._requests)

    def propose(self, token_ids: Sequence[int], num_tokens: int, *, request_id: Hashable | None = None) -> list[int]:
        """Up to num_tokens drafts continuing token_ids (the request's prompt + output so far).

        With `request_id`, the packed tokens are kept for the next call with that id (only new
        tokens are packed; a list that does not extend the last one is repacked whole) until
        `finish` or `abort` drops them. Without it, nothing is kept.
        """
        packed = self._packed(request_id, token_ids) if request_id is not None else None
        if num_tokens <= 0 or len(token_ids) <= self.prompt_lookup_min:
            return []
        if packed is None:
            packed = pack_tokens(token_ids)
        found = lookup(packed, len(token_ids), self.prompt_lookup_min, self.prompt_lookup_max)
        if found is None:
            return []
        start, n = found
        return list(token_ids[start + n:start + n + num_tokens])

    def finish(self, request_id: Hashable, output_token_ids: Sequence[int] = ()) -> None:
        """The request ended: drop what was kept for it (outputs are not shared across requests)."""
        self._requests.pop(request_id, None)

    def abort(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)

    def _packed(self, request_id: Hashable, token_ids: Sequence[int]) -> bytearray:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = (TokenHistory(), bytearray())
        history, packed = state
        known = history.sync(token_ids)
        if known == 0:
            packed.clear()
        try:
            packed += pack_tokens(history.tokens[known:])
        except ValueError:
            del self._requests[request_id]  # the history already holds tokens the buffer lacks
            raise
        return packed
