"""A suffix trie of bounded depth with occurrence counts, over one or more token sequences.

It stores every substring of at most `depth` tokens of the sequences it indexes, each with the number
of its occurrences, and answers: which token most often followed a given context, and how often.

A plain trie spends a node per (position, depth), `depth` nodes a token, most of them on paths that
occurred once. Here a path that has occurred once is not spelled out: it is a leaf, the (sequence,
start) of its one occurrence, whose deeper tokens are read from the sequence itself. A second
occurrence turns the leaf into a node one level at a time, so nodes are only spent on repeated
substrings and text that never repeats costs about one leaf a token.

Layout: a node is an index into flat integer arrays and a leaf is a negative integer, so the trie is
a handful of Python objects whatever its size. With an object per node, every full collection of the
cyclic garbage collector walked them all, pausing the whole process: 0.33 s a collection for one
8k-token request's trie and a full shared cache, on the 2-core test machine. A node's only child
is kept in its own array slots; a node with several has a dict of them (ints only, which the
collector does not track either).

An occurrence is inserted one token at a time (`step`), so a growing sequence is indexed
incrementally, or all at once (`add`); `remove` takes one occurrence's counts back out.
"""

from __future__ import annotations

from array import array
from typing import Sequence

ROOT = 0
_NONE = -1  # no child; or the most frequent child is unknown
_MANY = -2  # the node's children are in its dict
_START_BITS = 32
_START_MASK = (1 << _START_BITS) - 1


def _leaf(seq_id: int, start: int) -> int:
    return -1 - ((seq_id << _START_BITS) | start)


def _leaf_parts(ref: int) -> tuple[int, int]:
    value = -1 - ref
    return value >> _START_BITS, value & _START_MASK


class SuffixTrie:
    """Occurrence counts of every substring of length <= `depth` of the indexed sequences.

    A reference to a place in the trie is an int: a node id (>= 0, `ROOT` for the empty string) or a
    leaf (< 0). Sequences are registered with `new_sequence` and must not change over the part that
    is indexed (they may grow at the end). Token ids must be non-negative.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        # Per node: occurrences of its substring, of those followed by a token (the sum of the
        # children's counts), its most frequent child's token (ties: smallest id), and its only child
        # (token, reference) unless the token is _MANY.
        self._count = array("q", [0])
        self._total = array("q", [0])
        self._best = array("q", [_NONE])
        self._token = array("q", [_NONE])
        self._child = array("q", [0])
        self._many: dict[int, dict[int, int]] = {}
        self._used = 1  # ids below are nodes or free; the arrays may be longer
        self._free: list[int] = []  # ids of removed nodes, reused first
        self._seqs: dict[int, Sequence[int]] = {}
        self._next_seq = 0

    # -- sequences ---------------------------------------------------------------------------------

    def new_sequence(self, seq: Sequence[int]) -> int:
        """Register `seq` (nothing indexed yet); returns its id."""
        seq_id = self._next_seq
        self._next_seq += 1
        self._seqs[seq_id] = seq
        return seq_id

    def add_sequence(self, seq: Sequence[int]) -> int:
        """Register `seq` and index every occurrence starting in it; returns its id."""
        seq_id = self.new_sequence(seq)
        for start in range(len(seq)):
            self.add(seq_id, start)
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        """Take out every occurrence `add_sequence` put in, and forget the sequence."""
        for start in range(len(self._seqs[seq_id])):
            self.remove(seq_id, start)
        del self._seqs[seq_id]

    # -- reading -----------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root included (leaves cost none)."""
        return self._used - len(self._free)

    @property
    def num_occurrences(self) -> int:
        """Indexed start positions (the tokens of all indexed sequences)."""
        return self._total[ROOT]

    def child(self, node: int, token: int) -> int | None:
        """The reference under `node` for `token`, or None."""
        only = self._token[node]
        if only == token:
            return self._child[node]
        if only == _MANY:
            return self._many[node].get(token)
        return None

    def children(self, node: int) -> dict[int, int]:
        """token -> reference, for each child of `node` (a copy)."""
        only = self._token[node]
        if only == _NONE:
            return {}
        if only == _MANY:
            return dict(self._many[node])
        return {only: self._child[node]}

    def occurrences(self, ref: int) -> int:
        """Occurrences of the substring that ends at `ref`."""
        return 1 if ref < 0 else self._count[ref]

    def continuations(self, node: int) -> int:
        """Occurrences of `node`'s substring followed by a token."""
        return self._total[node]

    def leaf(self, ref: int) -> tuple[Sequence[int], int]:
        """The (sequence, start) of the only occurrence a leaf stands for."""
        seq_id, start = _leaf_parts(ref)
        return self._seqs[seq_id], start

    def most_frequent(self, node: int) -> int:
        """The token of `node`'s most frequent child (ties: smallest id); `node` must have one."""
        best = self._best[node]
        if best == _NONE:
            items = self.children(node).items()
            best = min(items, key=lambda item: (-self.occurrences(item[1]), item[0]))[0]
            self._best[node] = best
        return best

    # -- writing -----------------------------------------------------------------------------------

    def _new_node(self, count: int) -> int:
        if self._free:
            node = self._free.pop()
        else:
            node = self._used
            if node == len(self._count):  # full: double every array (appending one by one is slower)
                for column in (self._count, self._total, self._best, self._token, self._child):
                    column.frombytes(bytes(column.itemsize * node))
            self._used = node + 1
        self._count[node], self._total[node], self._best[node], self._token[node] = count, 0, _NONE, _NONE
        return node

    def _set_child(self, node: int, token: int, ref: int) -> None:
        only = self._token[node]
        if only == _NONE or only == token:
            self._token[node] = token
            self._child[node] = ref
        elif only == _MANY:
            self._many[node][token] = ref
        else:
            self._many[node] = {only: self._child[node], token: ref}
            self._token[node] = _MANY

    def _delete_child(self, node: int, token: int) -> None:
        if self._token[node] == token:
            self._token[node] = _NONE
            return
        many = self._many[node]
        del many[token]
        if len(many) == 1:
            ((only, ref),) = many.items()
            del self._many[node]
            self._token[node] = only
            self._child[node] = ref

    def step(self, node: int, depth: int, seq_id: int, start: int) -> int | None:
        """Extend the occurrence starting at `start` in sequence `seq_id`, whose first `depth` tokens
        lead to `node`, by its next token. Returns the node it reaches, or None when that longer
        substring had not occurred before (the occurrence is then a leaf, extended implicitly).
        `depth` must be below the trie's depth."""
        # Runs `depth` times a token on repeated text: lookups are inlined.
        token = self._seqs[seq_id][start + depth]
        only_token, only_child, counts = self._token, self._child, self._count
        only = only_token[node]
        if only == token:
            child = only_child[node]
        elif only == _MANY:
            child = self._many[node].get(token)
        else:
            child = None
        total = self._total[node] + 1
        self._total[node] = total
        if child is None:
            self._set_child(node, token, _leaf(seq_id, start))
            reached, count = None, 1
        elif child < 0:
            # The leaf's occurrence is no longer the only one: give it a node, with the leaf one
            # level down under its own next token (when it has one within the depth).
            reached, count = self._new_node(2), 2
            old = -1 - child  # the leaf's (sequence, start), as in `leaf`
            old_seq = self._seqs[old >> _START_BITS]
            after = (old & _START_MASK) + depth + 1
            if depth + 1 < self.depth and after < len(old_seq):
                only_token[reached] = self._best[reached] = old_seq[after]
                only_child[reached] = child
                self._total[reached] = 1
            if only == token:
                only_child[node] = reached
            else:
                self._many[node][token] = reached
        else:
            count = counts[child] + 1
            counts[child] = count
            reached = child
        best = self._best[node]
        if total == 1:
            self._best[node] = token
        elif best != _NONE and best != token:
            best_ref = self.child(node, best)
            best_count = 1 if best_ref < 0 else counts[best_ref]
            if count > best_count or (count == best_count and token < best):
                self._best[node] = token
        return reached

    def add(self, seq_id: int, start: int) -> None:
        """Index the occurrence starting at `start` in sequence `seq_id` (its first `depth` tokens)."""
        length = min(len(self._seqs[seq_id]) - start, self.depth)
        node: int | None = ROOT
        for depth in range(length):
            node = self.step(node, depth, seq_id, start)
            if node is None:
                return

    def remove(self, seq_id: int, start: int) -> None:
        """Undo `add(seq_id, start)` (or the incremental steps of the same occurrence)."""
        seq = self._seqs[seq_id]
        end = min(len(seq), start + self.depth)
        node = ROOT
        freed = []
        for position in range(start, end):
            token = seq[position]
            child = self.child(node, token)
            if not freed:  # `node` stays in the trie
                self._total[node] -= 1
                if self._best[node] == token:
                    self._best[node] = _NONE  # another child may now tie or lead
            if child < 0:  # the occurrence's own leaf: nothing below holds it
                if not freed:
                    self._delete_child(node, token)
                break
            self._count[child] -= 1
            if self._count[child] == 0:
                # Nothing else occurred here, so nothing else below: the rest of the path goes too.
                if not freed:
                    self._delete_child(node, token)
                freed.append(child)
            node = child
        self._free.extend(freed)  # each held one occurrence, so one child at most and no dict

    # -- proposing ---------------------------------------------------------------------------------

    def find(self, tokens: Sequence[int], begin: int, end: int) -> int | None:
        """The reference at which tokens[begin:end] ends, or None when it is not stored."""
        if end - begin > self.depth:
            return None
        ref = ROOT
        for position in range(begin, end):
            if ref < 0:
                seq, start = self.leaf(ref)
                offset = start + position - begin
                rest = end - position
                if offset + rest > len(seq) or list(seq[offset:offset + rest]) != list(tokens[position:end]):
                    return None
                return ref
            ref = self.child(ref, tokens[position])
            if ref is None:
                return None
        return ref

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of `tokens` (0 when longer than the depth)."""
        if not tokens:
            raise ValueError("count needs a non-empty substring")
        ref = self.find(tokens, 0, len(tokens))
        return 0 if ref is None else self.occurrences(ref)

    def has_continuation(self, ref: int, length: int) -> bool:
        """Whether the substring of `length` tokens ending at `ref` was followed by a token."""
        if ref < 0:
            seq, start = self.leaf(ref)
            return length < self.depth and start + length < len(seq)
        return self._total[ref] > 0

    def longest_context(self, tokens: Sequence[int], max_length: int) -> tuple[int, int] | None:
        """The longest suffix of `tokens`, at most `max_length` long, that occurred followed by a
        token: (where it ends, its length), or None.

        Binary search over the length: a suffix followed by a token contains, as its own suffix, a
        shorter one followed by the same token.
        """
        n = len(tokens)
        low, high = 0, min(max_length, n, self.depth - 1)
        best = None
        while low < high:
            mid = (low + high + 1) // 2
            ref = self.find(tokens, n - mid, n)
            if ref is not None and self.has_continuation(ref, mid):
                low, best = mid, (ref, mid)
            else:
                high = mid - 1
        return best

    def follow(self, ref: int, length: int, max_tokens: int, min_prob: float) -> list[int]:
        """Tokens continuing the substring of `length` tokens that ends at `ref`: the most frequent
        next token each time, while the product of their frequencies (each count over the
        continuations' total) stays at least `min_prob`, within the trie's depth."""
        drafts: list[int] = []
        prob = 1.0
        limit = min(max_tokens, self.depth - length)
        while len(drafts) < limit:
            if ref < 0:  # one occurrence: its tokens follow with frequency 1
                seq, start = self.leaf(ref)
                position = start + length + len(drafts)
                drafts.extend(seq[position:position + limit - len(drafts)])
                break
            total = self._total[ref]
            if total == 0:
                break
            token = self.most_frequent(ref)
            nxt = self.child(ref, token)
            prob *= self.occurrences(nxt) / total
            if prob < min_prob:
                break
            drafts.append(token)
            ref = nxt
        return drafts
