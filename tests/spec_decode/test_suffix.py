"""Suffix decoding: the tries count what a brute-force scan counts, and proposals are the ones a naive
reference computes from those counts (every draft followed a matching context somewhere)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.spec_decode.suffix import RequestTrie, SuffixProposer
from pagedserve.spec_decode.suffix_trie import ROOT, SuffixTrie

# A tiny alphabet: substrings repeat, so tries branch, merge and split leaves.
token_lists = st.lists(st.integers(0, 3), max_size=30)


def substring_counts(texts: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for text in texts:
        for start in range(len(text)):
            for end in range(start + 1, min(len(text), start + depth) + 1):
                counts[tuple(text[start:end])] += 1
    return counts


def next_token_counts(texts: list[list[int]], context: list[int], depth: int) -> Counter:
    """How often each token followed `context` (the context and the token within the depth)."""
    counts: Counter = Counter()
    if len(context) + 1 > depth:
        return counts
    for text in texts:
        for start in range(len(text) - len(context)):
            if text[start:start + len(context)] == context:
                counts[text[start + len(context)]] += 1
    return counts


def reference_drafts(texts, tokens, depth, k, min_prob):
    """Longest suffix (within the context bound) that was followed by a token, then the most frequent
    next token (smallest id on ties) while the product of the frequencies stays >= min_prob."""
    if k <= 0:
        return []
    max_context = depth - max(1, min(k, depth // 2))
    for length in range(min(max_context, len(tokens)), 0, -1):
        context = list(tokens[len(tokens) - length:])
        if next_token_counts(texts, context, depth):
            break
    else:
        return []
    drafts, prob = [], 1.0
    while len(drafts) < k:
        counts = next_token_counts(texts, context, depth)
        if not counts:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[token] / sum(counts.values())
        if prob < min_prob:
            break
        drafts.append(token)
        context.append(token)
    return drafts


def reference_proposal(tokens, cached, depth, k, min_prob):
    own = reference_drafts([list(tokens)], tokens, depth, k, min_prob)
    shared = reference_drafts(cached, tokens, depth, k, min_prob) if cached else []
    return own if len(own) >= len(shared) else shared


def trie_strings(trie: SuffixTrie) -> Counter:
    """Every substring the trie stores with its count, leaves spelled out; checks the node invariants."""
    counts: Counter = Counter()
    nodes = branching = 0

    def visit(node: int, prefix: tuple) -> None:
        nonlocal nodes, branching
        nodes += 1
        children = trie.children(node)
        branching += len(children) > 1
        assert trie.continuations(node) == sum(map(trie.occurrences, children.values()))
        if children:
            top = max(map(trie.occurrences, children.values()))
            assert trie.most_frequent(node) == min(t for t, c in children.items() if trie.occurrences(c) == top)
        for token, child in children.items():
            string = prefix + (token,)
            assert len(string) <= trie.depth
            if child < 0:
                seq, start = trie.leaf(child)
                assert tuple(seq[start:start + len(string)]) == string
                for end in range(len(string), min(trie.depth, len(seq) - start) + 1):
                    counts[tuple(seq[start:start + end])] += 1
            else:
                assert trie.occurrences(child) > 0
                counts[string] += trie.occurrences(child)
                visit(child, string)

    visit(ROOT, ())
    assert nodes == trie.num_nodes  # no node is lost, none counted twice
    assert branching == len(trie._many)  # a dict only where there are several children, none left behind
    return counts


depths = st.integers(2, 7)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(token_lists, max_size=6), depth=depths, data=st.data())
def test_trie_counts_match_a_scan_after_adds_and_removes(texts, depth, data):
    trie = SuffixTrie(depth)
    ids = [trie.add_sequence(text) for text in texts]
    assert trie_strings(trie) == substring_counts(texts, depth)
    removed = data.draw(st.lists(st.sampled_from(range(len(texts))), unique=True) if texts else st.just([]))
    for index in removed:
        trie.remove_sequence(ids[index])
    kept = [t for i, t in enumerate(texts) if i not in removed]
    assert trie_strings(trie) == substring_counts(kept, depth)
    assert trie.num_occurrences == sum(map(len, kept))
    for string, count in substring_counts(texts, depth).items():
        assert trie.count(list(string)) == substring_counts(kept, depth)[string]


@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(token_lists, min_size=1, max_size=6), depth=depths)
def test_incremental_indexing_equals_indexing_from_scratch(chunks, depth):
    growing = RequestTrie(depth)
    tokens: list[int] = []
    for chunk in chunks:
        tokens = tokens + chunk
        growing.sync(tokens)
        scratch = SuffixTrie(depth)
        scratch.add_sequence(tokens)
        assert trie_strings(growing.trie) == trie_strings(scratch) == substring_counts([tokens], depth)


def test_the_trie_is_a_few_objects_for_the_garbage_collector_whatever_its_size():
    """Per-node objects would make every full collection walk them all, pausing the process."""
    tokens = list(range(100, 1100)) * 3  # repeated: nodes, not only leaves
    gc.collect()
    before = len(gc.get_objects())
    trie = SuffixTrie(24)
    trie.add_sequence(tokens)
    request = RequestTrie(24)
    request.sync(tokens)
    assert trie.num_nodes > 20000 and request.trie.num_nodes > 20000
    assert len(gc.get_objects()) - before < 100


def test_nothing_continues_past_the_depth():
    trie = SuffixTrie(3)
    trie.add(trie.new_sequence([1, 2, 3, 4]), 0)
    assert trie.count([1, 2, 3]) == 1 and trie.count([1, 2, 3, 4]) == 0
    assert trie.has_continuation(trie.find([1, 2], 0, 2), 2)
    assert not trie.has_continuation(trie.find([1, 2, 3], 0, 3), 3)  # 4 follows, beyond the depth
    assert trie.follow(trie.find([1], 0, 1), 1, 5, 0.0) == [2, 3]


operations = st.lists(
    st.tuples(st.sampled_from(["grow", "grow", "grow", "rewrite", "finish", "abort"]), st.integers(0, 2), token_lists,
              st.integers(0, 10)),
    min_size=1, max_size=14,
)


@settings(max_examples=200, deadline=None)
@given(ops=operations, depth=depths, max_cached=st.integers(0, 3), min_prob=st.sampled_from([0.0, 0.1, 0.34, 0.5, 1.0]))
def test_proposals_equal_the_reference(ops, depth, max_cached, min_prob):
    """Requests grow, get rewritten (a preemption), finish into the shared cache or are aborted."""
    proposer = SuffixProposer(max_tree_depth=depth, max_cached_requests=max_cached, min_token_prob=min_prob)
    tokens: dict[int, list[int]] = {}
    cached: list[list[int]] = []
    for op, rid, chunk, k in ops:
        current = tokens.get(rid, [])
        if op == "finish":
            output = current[len(current) // 3:]  # the part after a "prompt"
            proposer.finish(rid, output)
            if output and max_cached:
                cached = (cached + [output])[-max_cached:]
            tokens.pop(rid, None)
            assert proposer.num_cached_requests == len(cached) <= max_cached
            assert proposer.num_cached_tokens == sum(map(len, cached))
            continue
        if op == "abort":
            proposer.abort(rid)
            tokens.pop(rid, None)
            continue
        current = (current[:len(current) // 2] if op == "rewrite" else current) + chunk
        tokens[rid] = current
        drafts = proposer.propose(rid, current, k)
        assert drafts == reference_proposal(current, cached, depth, k, min_prob)
        assert len(drafts) <= max(k, 0)
        if drafts:  # the last token and the drafts occurred together in some text
            window = [current[-1]] + drafts
            assert any(text[s:s + len(window)] == window for text in [current] + cached for s in range(len(text)))


def test_a_repeated_paragraph_is_continued():
    paragraph = list(range(100, 160))
    tokens = [1, 2, 3] + paragraph + [4, 5] + paragraph[:20]
    assert SuffixProposer().propose("r", tokens, 8) == paragraph[20:28]


def test_the_most_frequent_continuation_is_followed():
    # After [7, 8]: 9 three times, 5 once.
    tokens = [7, 8, 9, 0, 7, 8, 9, 1, 7, 8, 5, 2, 7, 8, 9, 3, 7, 8]
    assert SuffixProposer(max_tree_depth=6, min_token_prob=0.5).propose("r", tokens, 1) == [9]
    # 3/4 for the 9, then one of three continuations of [7, 8, 9] (1/3 each): 3/4 * 1/3 < 0.5.
    assert SuffixProposer(max_tree_depth=6, min_token_prob=0.5).propose("r", tokens, 2) == [9]
    assert SuffixProposer(max_tree_depth=6, min_token_prob=0.7).propose("r", tokens, 1) == [9]
    assert SuffixProposer(max_tree_depth=6, min_token_prob=0.8).propose("r", tokens, 1) == []


def test_finished_outputs_are_proposed_to_other_requests():
    proposer = SuffixProposer(max_cached_requests=2)
    answer = [50, 51, 52, 53, 54, 55, 56]
    proposer.finish("a", answer)
    assert proposer.propose("b", [1, 2, 50, 51], 4) == [52, 53, 54, 55]


def test_evicted_outputs_are_no_longer_proposed():
    proposer = SuffixProposer(max_cached_requests=2)
    outputs = [[1000 * i + j for j in range(10)] for i in range(1, 4)]
    for i, output in enumerate(outputs):
        proposer.finish(i, output)
    assert proposer.num_cached_requests == 2 and proposer.num_cached_tokens == 20
    assert proposer.propose("x", outputs[0][:3], 3) == []  # the oldest one went
    assert proposer.propose("y", outputs[1][:3], 3) == outputs[1][3:6]
    assert proposer.propose("z", outputs[2][:3], 3) == outputs[2][3:6]


def test_an_evicted_repetitive_output_leaves_nothing_behind():
    proposer = SuffixProposer(max_cached_requests=1)
    proposer.finish("a", [1, 2, 1, 2, 3] * 4)
    assert proposer.propose("q", [7, 1, 2], 2) == [1, 2]
    proposer.finish("b", [9])
    proposer.finish("c", [8])
    assert proposer.num_cached_tokens == 1
    assert proposer.propose("s", [7, 1, 2], 2) == []


def test_the_own_trie_wins_ties_and_the_longer_proposal_wins_otherwise():
    proposer = SuffixProposer(max_tree_depth=8, min_token_prob=0.6)
    proposer.finish("old", [5, 6, 7, 8, 9, 10])
    # Own tokens continue [5, 6] with 40 or 41, too uncertain to propose; the cache is sure of 7.
    assert proposer.propose("r", [5, 6, 40, 5, 6, 41, 5, 6], 4) == [7, 8, 9, 10]
    # Own continuation as long as the cache's: the own one is kept.
    assert proposer.propose("s", [5, 6, 40, 41, 42, 43, 1, 5, 6], 4) == [40, 41, 42, 43]


def test_a_preempted_request_is_reindexed():
    proposer = SuffixProposer(max_tree_depth=8)
    tokens = [3, 4, 5, 6, 3, 4]
    assert proposer.propose("r", tokens, 2) == [5, 6]
    # Recomputed after a preemption from a shorter list, then grown differently.
    assert proposer.propose("r", [3, 4, 9, 3, 4], 2) == [9, 3]
    assert proposer.propose("r", [3, 4], 2) == []
    # As long as before or longer, but different inside.
    assert proposer.propose("r", [3, 4, 5, 6, 3, 4], 2) == [5, 6]
    assert proposer.propose("r", [3, 8, 5, 6, 3, 8, 5], 2) == [6, 3]


def test_finish_and_abort_drop_the_request():
    proposer = SuffixProposer()
    proposer.propose("a", [1, 2, 1], 2)
    proposer.propose("b", [1, 2, 1], 2)
    proposer.finish("a", [])
    proposer.abort("b")
    assert proposer.num_requests == 0 and proposer.num_cached_requests == 0


def test_negative_token_ids_are_refused_and_leave_no_state():
    proposer = SuffixProposer()
    with pytest.raises(ValueError):
        proposer.propose("r", [1, 2, -3], 2)
    assert proposer.propose("r", [1, 2, 1], 2) == [2, 1]
    with pytest.raises(ValueError):
        proposer.finish("r", [4, -1])
    assert proposer.num_cached_requests == 0


@pytest.mark.parametrize("kwargs", [dict(max_tree_depth=1), dict(max_tree_depth=True), dict(max_cached_requests=-1),
                                    dict(min_token_prob=1.5), dict(min_token_prob=-0.1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SuffixProposer(**kwargs)
