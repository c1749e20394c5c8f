"""A suffix trie of bounded depth with occurrence counts, over one or more token sequences.

It stores every substring of at most `depth` tokens of the sequences it indexes, each with the number
of its occurrences, and answers: which token most often followed a given context, and how often.

A plain trie spends a node per (position, depth), `depth` nodes a token; most of them lie on paths
that occurred once. Here a path that has occurred once is not spelled out: it is a leaf, the pair
(sequence, start) of its one occurrence, whose deeper tokens are read from the sequence itself. A
second occurrence turns the leaf into a node one level at a time. Nodes are then only spent on
repeated substrings, so text that never repeats costs about one leaf a token.

An occurrence is inserted one token at a time (`step`), so a growing sequence is indexed
incrementally, or all at once (`add`); `remove` takes one occurrence's counts back out.
"""

from __future__ import annotations

from typing import Sequence, Union


class Node:
    """A substring that has occurred (or still occurs, after removals) at least once."""

    __slots__ = ("count", "total", "children", "best")

    def __init__(self, count: int) -> None:
        self.count = count  # occurrences of the substring
        self.total = 0  # occurrences followed by a token: the sum of the children's counts
        # token -> Node, or a leaf: (sequence, start) of the only occurrence of the longer substring.
        self.children: dict[int, Child] = {}
        # The most frequent child's token (ties: the smallest id); None when unknown or childless.
        self.best: int | None = None


Leaf = tuple  # (sequence, start)
Child = Union[Node, Leaf]


def child_count(child: Child) -> int:
    return 1 if type(child) is tuple else child.count


def most_frequent(node: Node) -> int:
    """The token of `node`'s most frequent child (ties: smallest id); `node` must have children."""
    if node.best is None:
        node.best = min(node.children.items(), key=lambda item: (-child_count(item[1]), item[0]))[0]
    return node.best


class SuffixTrie:
    """Occurrence counts of every substring of length <= `depth` of the indexed sequences.

    A sequence must not change over the part of it the trie indexes (it may grow at the end).
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = Node(0)

    @property
    def num_occurrences(self) -> int:
        """How many start positions are indexed (the tokens of all indexed sequences)."""
        return self.root.total

    def step(self, node: Node, depth: int, seq: Sequence[int], start: int) -> Node | None:
        """Extend the occurrence starting at seq[start], whose first `depth` tokens lead to `node`,
        by the token seq[start + depth]. Returns the node it reaches, or None when that longer
        substring had not occurred before (the occurrence is then a leaf, extended implicitly).
        `depth` must be below the trie's depth."""
        token = seq[start + depth]
        children = node.children
        child = children.get(token)
        node.total += 1
        if child is None:
            children[token] = (seq, start)
            reached, count = None, 1
        elif type(child) is tuple:
            # The leaf's occurrence is no longer the only one: give it a node, with the leaf one
            # level down under its own next token (when it has one within the depth).
            reached, count = Node(2), 2
            old_seq, old_start = child
            after = old_start + depth + 1
            if depth + 1 < self.depth and after < len(old_seq):
                reached.children[old_seq[after]] = child
                reached.total = 1
                reached.best = old_seq[after]
            children[token] = reached
        else:
            child.count += 1
            reached, count = child, child.count
        best = node.best
        if node.total == 1:
            node.best = token
        elif best is not None and best != token:
            best_count = child_count(children[best])
            if count > best_count or (count == best_count and token < best):
                node.best = token
        return reached

    def add(self, seq: Sequence[int], start: int) -> None:
        """Index the occurrence starting at seq[start] (its first `depth` tokens)."""
        end = min(len(seq), start + self.depth)
        node: Node | None = self.root
        for depth in range(end - start):
            node = self.step(node, depth, seq, start)
            if node is None:
                return

    def remove(self, seq: Sequence[int], start: int) -> None:
        """Undo `add(seq, start)` (or the incremental steps of the same occurrence)."""
        end = min(len(seq), start + self.depth)
        node = self.root
        for position in range(start, end):
            token = seq[position]
            child = node.children[token]
            node.total -= 1
            if node.best == token:
                node.best = None  # another child may now tie or lead
            if type(child) is tuple:  # the occurrence's own leaf: nothing below holds it
                del node.children[token]
                return
            child.count -= 1
            if child.count == 0:  # everything below held this occurrence only
                del node.children[token]
                return
            node = child

    def find(self, tokens: Sequence[int], begin: int, end: int) -> tuple[Child, int] | None:
        """Where tokens[begin:end] ends in the trie: (node or leaf, length), or None if not stored."""
        if end - begin > self.depth:
            return None
        current: Child = self.root
        for position in range(begin, end):
            if type(current) is tuple:
                seq, start = current
                offset = start + position - begin
                rest = end - position
                if offset + rest > len(seq) or list(seq[offset:offset + rest]) != list(tokens[position:end]):
                    return None
                return current, end - begin
            current = current.children.get(tokens[position])
            if current is None:
                return None
        return current, end - begin

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of `tokens` (0 when longer than the depth)."""
        if not tokens:
            raise ValueError("count needs a non-empty substring")
        found = self.find(tokens, 0, len(tokens))
        return 0 if found is None else child_count(found[0])

    def has_continuation(self, child: Child, length: int) -> bool:
        """Whether the substring of `length` tokens ending at `child` was followed by a token."""
        if type(child) is tuple:
            seq, start = child
            return length < self.depth and start + length < len(seq)
        return child.total > 0

    def longest_context(self, tokens: Sequence[int], max_length: int) -> tuple[Child, int] | None:
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
            found = self.find(tokens, n - mid, n)
            if found is not None and self.has_continuation(*found):
                low, best = mid, found
            else:
                high = mid - 1
        return best

    def follow(self, child: Child, length: int, max_tokens: int, min_prob: float) -> list[int]:
        """Tokens continuing the substring of `length` tokens that ends at `child`: the most frequent
        next token each time, while the product of their frequencies (each count over the
        continuations' total) stays at least `min_prob`, within the trie's depth."""
        drafts: list[int] = []
        prob = 1.0
        limit = min(max_tokens, self.depth - length)
        while len(drafts) < limit:
            if type(child) is tuple:  # one occurrence: its tokens follow with frequency 1
                seq, start = child
                position = start + length + len(drafts)
                drafts.extend(seq[position:position + limit - len(drafts)])
                break
            if child.total == 0:
                break
            token = most_frequent(child)
            nxt = child.children[token]
            prob *= child_count(nxt) / child.total
            if prob < min_prob:
                break
            drafts.append(token)
            child = nxt
        return drafts
