"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from suffix tries of past tokens.

Two tries of depth `max_tree_depth` (`suffix_trie.SuffixTrie`): one per running request over its own
tokens (prompt and output so far), extended each call by the tokens new since the last; and one
shared over the outputs of the last `max_cached_requests` finished requests, from which the oldest
output is taken back out when a new one would exceed the bound.

A proposal matches the longest suffix of the request's tokens that occurred followed by a token,
then follows the most frequent next token (ties: the smallest id) one at a time while the product of
their frequencies stays at least `min_token_prob`. The matched suffix and the drafts together fit
in the trie's depth, so the suffix is at most `max_tree_depth - min(num_tokens, max_tree_depth // 2)`
tokens (at least one shorter than the depth): room for the drafts without giving up long contexts,
which are already specific at half the depth. Each trie proposes; the request's own proposal wins
when it is at least as long as the shared one.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

from pagedserve.spec_decode.suffix_trie import ROOT, SuffixTrie
from pagedserve.spec_decode.token_history import TokenHistory


class RequestTrie:
    """A trie over one request's tokens, indexed incrementally as they grow.

    `active` holds, for each recent start whose substring up to the last token has occurred before
    (so it is a trie node, not a leaf), that node and the start, longest first: the next token
    extends exactly these, and the first short enough is the context a proposal matches.
    """

    __slots__ = ("history", "trie", "seq_id", "active")

    def __init__(self, depth: int) -> None:
        self.history = TokenHistory()
        self._reset(depth)

    def _reset(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.seq_id = self.trie.new_sequence(self.history.tokens)  # leaves read the tokens from it
        self.active: list[tuple[int, int]] = []

    def sync(self, token_ids: Sequence[int]) -> None:
        """Index the tokens new since the last call, or all of them when the list was rewritten."""
        known = self.history.sync(token_ids)
        seq = self.history.tokens
        if known < len(seq) and min(seq[known:]) < 0:
            self.history = TokenHistory()
            self._reset(self.trie.depth)
            raise ValueError("token ids must be non-negative")
        if known == 0:
            self._reset(self.trie.depth)
        for position in range(known, len(seq)):
            self._append(position)

    def _append(self, position: int) -> None:
        trie, seq_id = self.trie, self.seq_id
        depth = trie.depth
        active = []
        for node, start in self.active:
            reached = trie.step(node, position - start, seq_id, start)
            if reached is not None and position + 1 - start < depth:
                active.append((reached, start))
        reached = trie.step(ROOT, 0, seq_id, position)
        if reached is not None and depth > 1:
            active.append((reached, position))
        self.active = active

    def propose(self, max_context: int, num_tokens: int, min_prob: float) -> list[int]:
        """Drafts after the longest suffix of at most `max_context` tokens that occurred before."""
        end = len(self.history.tokens)
        for node, start in self.active:
            # Every active node occurred before its last occurrence here, so it has a continuation.
            if end - start <= max_context:
                return self.trie.follow(node, end - start, num_tokens, min_prob)
        return []


class SuffixProposer:
    """Suffix-decoding drafts from the request's own tokens and from recently finished outputs.

    Memory: a request's trie lives until `finish` or `abort`; the shared trie holds at most
    `max_cached_requests` outputs. Both spend nodes only on repeated substrings (at most
    `max_tree_depth` a token) and one leaf per indexed token otherwise.
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, min_token_prob: float = 0.1) -> None:
        if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) or max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be an integer >= 2, got {max_tree_depth!r}")
        if isinstance(max_cached_requests, bool) or not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an integer >= 0, got {max_cached_requests!r}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = float(min_token_prob)
        self._requests: dict[Hashable, RequestTrie] = {}
        self._cache = SuffixTrie(max_tree_depth)
        self._cached: deque[int] = deque()  # the shared trie's sequence ids, oldest first

    @property
    def num_requests(self) -> int:
        """Requests whose trie is kept (until `finish` or `abort`)."""
        return len(self._requests)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    @property
    def num_cached_tokens(self) -> int:
        return self._cache.num_occurrences

    def max_context(self, num_tokens: int) -> int:
        """The most tokens of context a proposal of `num_tokens` drafts matches on."""
        depth = self.max_tree_depth
        return depth - max(1, min(num_tokens, depth // 2))

    def propose(self, request_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to num_tokens drafts continuing token_ids, all the request's tokens so far.

        Between calls for one id the tokens only grow and only the new ones are indexed; a list
        that does not extend the previous one (after a preemption) rebuilds the request's trie.
        """
        tree = self._requests.get(request_id)
        if tree is None:
            tree = self._requests[request_id] = RequestTrie(self.max_tree_depth)
        tree.sync(token_ids)
        if num_tokens <= 0:
            return []
        max_context = self.max_context(num_tokens)
        own = tree.propose(max_context, num_tokens, self.min_token_prob)
        if len(own) >= num_tokens or not self._cached:
            return own
        found = self._cache.longest_context(tree.history.tokens, max_context)
        if found is None:
            return own
        shared = self._cache.follow(*found, num_tokens, self.min_token_prob)
        return own if len(own) >= len(shared) else shared

    def finish(self, request_id: Hashable, output_token_ids: Sequence[int]) -> None:
        """The request ended: drop its own trie; add its output to the shared one."""
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0 or len(output_token_ids) == 0:
            return
        output = list(output_token_ids)
        if min(output) < 0:
            raise ValueError("token ids must be non-negative")
        self._cached.append(self._cache.add_sequence(output))
        while len(self._cached) > self.max_cached_requests:
            self._cache.remove_sequence(self._cached.popleft())

    def abort(self, request_id: Hashable) -> None:
        """Drop the request's trie; its output is not cached."""
        self._requests.pop(request_id, None)
