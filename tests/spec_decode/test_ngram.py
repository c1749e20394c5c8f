"""Prompt lookup: the drafts are exactly those of a naive scan, with or without kept state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.spec_decode.ngram import NgramProposer


def naive_drafts(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest n first; for it, the earliest earlier occurrence; the tokens after it."""
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        pattern = tokens[len(tokens) - n:]
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n):  # leaves at least one token after the occurrence
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


# Few distinct ids, so patterns repeat; some share bytes, so a byte search can hit across two tokens.
TOKENS = st.sampled_from([0, 1, 2, 3, 257, 65536, 0x01010101, 0x00010100, 2**31 - 1])
token_lists = st.lists(TOKENS, max_size=40)
bounds = st.tuples(st.integers(1, 6), st.integers(0, 4)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(tokens=token_lists, lohi=bounds, k=st.integers(-1, 8))
def test_drafts_equal_the_naive_scan(tokens, lohi, k):
    lo, hi = lohi
    assert NgramProposer(lo, hi).propose(tokens, k) == naive_drafts(tokens, lo, hi, k)


@settings(max_examples=150, deadline=None)
@given(lohi=bounds, steps=st.lists(st.tuples(token_lists, st.booleans(), st.integers(0, 6)), min_size=1, max_size=8))
def test_kept_state_follows_growth_and_rewrites(lohi, steps):
    """Each step appends tokens or (a preemption, a rewrite) replaces the list by a prefix plus others."""
    lo, hi = lohi
    proposer = NgramProposer(lo, hi)
    tokens: list[int] = []
    for chunk, rewrite, k in steps:
        tokens = (tokens[:len(tokens) // 2] if rewrite else tokens) + chunk
        assert proposer.propose(tokens, k, request_id="r") == naive_drafts(tokens, lo, hi, k)


def test_a_repeated_paragraph_is_continued():
    paragraph = list(range(100, 160))
    tokens = [1, 2, 3] + paragraph + [4, 5] + paragraph[:20]
    assert NgramProposer(2, 4).propose(tokens, 5) == paragraph[20:25]


def test_the_longest_pattern_wins_over_an_earlier_shorter_one():
    # [8, 9] occurs first at 0 (followed by 1); the 3-gram [7, 8, 9] occurs only at 3 (followed by 2).
    tokens = [8, 9, 1, 7, 8, 9, 2, 0, 7, 8, 9]
    assert NgramProposer(2, 3).propose(tokens, 1) == [2]
    assert NgramProposer(2, 2).propose(tokens, 1) == [1]


def test_a_longer_match_may_start_before_the_shortest_pattern_first_occurs():
    # [9] first occurs at 2, inside the earliest [7, 8, 9] (at 0); [8, 9] also occurs at 5.
    tokens = [7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9]
    assert NgramProposer(1, 3).propose(tokens, 1) == [1]


def test_the_earliest_occurrence_wins():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert NgramProposer(2, 2).propose(tokens, 1) == [1]


def test_drafts_stop_at_the_end_and_may_run_into_the_pattern():
    tokens = [4, 4, 4, 4]  # the pattern [4, 4] occurs at 0: what follows is the last two tokens
    assert NgramProposer(2, 2).propose(tokens, 5) == [4, 4]


def test_no_match_or_no_room_gives_nothing():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 4], 4) == []
    assert proposer.propose([1], 4) == []
    assert proposer.propose([], 4) == []
    assert proposer.propose([1, 2, 1], 0) == []


def test_a_byte_match_across_two_tokens_is_not_a_match():
    a, b = 0x02010000, 0x00000403  # little-endian bytes 00 00 01 02 | 03 04 00 00
    straddle = 0x04030201  # bytes 01 02 03 04: found in a, b two bytes in
    tokens = [a, b, 9, straddle]
    assert NgramProposer(1, 1).propose(tokens, 2) == []


def test_finish_and_abort_drop_the_kept_tokens():
    proposer = NgramProposer(1, 2)
    proposer.propose([1, 2, 1], 2, request_id="a")
    proposer.propose([1, 2, 1], 2, request_id="b")
    assert proposer.num_requests == 2
    proposer.finish("a", [1])
    proposer.abort("b")
    assert proposer.num_requests == 0
    # A reused id starts over.
    assert proposer.propose([3, 4, 3], 2, request_id="a") == [4, 3]


@pytest.mark.parametrize("lo, hi", [(0, 2), (3, 2), (True, 2), (1, 2.0)])
def test_bad_bounds_are_refused(lo, hi):
    with pytest.raises(ValueError):
        NgramProposer(lo, hi)


def test_token_ids_beyond_32_bits_are_refused_and_leave_no_state():
    proposer = NgramProposer(1, 1)
    with pytest.raises(ValueError):
        proposer.propose([1, 2**40, 1], 2, request_id="r")
    assert proposer.propose([1, 2, 1], 2, request_id="r") == [2, 1]
