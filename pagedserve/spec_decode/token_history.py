"""A request's tokens as a proposer last saw them, to tell growth from a rewrite.

Proposers that keep per-request state update it with the tokens new since the last call. After a
preemption the caller may pass a shorter or different list; then the state must be rebuilt, which
`sync` reports by returning 0.
"""

from __future__ import annotations

from typing import Sequence


class TokenHistory:
    """The tokens seen so far for one request (a list: comparing two lists runs in C)."""

    __slots__ = ("tokens",)

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def sync(self, token_ids: Sequence[int]) -> int:
        """Make `tokens` equal `token_ids`; return how many leading tokens were already there.

        0 means the state built on the old tokens must be dropped (nothing was there, or
        `token_ids` does not extend them). A list is compared in one C pass (about 1 ns a token);
        other sequences are copied to a list first.
        """
        if not isinstance(token_ids, list):
            token_ids = list(token_ids)
        seen = self.tokens
        known = len(seen)
        if known and len(token_ids) >= known:
            seen.extend(token_ids[known:])
            if seen == token_ids:
                return known
        self.tokens = list(token_ids)
        return 0
