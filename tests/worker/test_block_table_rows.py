"""BlockTableRows gives, every step, exactly the padded tables the requests hold, although each plan
carries only what changed (whole tables when new, else the blocks from the one the step writes into
first) and it writes only what changed: the oracle is the plain padded list of the whole tables."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.worker.block_table_rows import BlockTableRows

BLOCK = 4


def padded(tables: list[list[int]], seq_lens: list[int]) -> list[list[int]]:
    width = max(-(-n // BLOCK) for n in seq_lens)
    return [t[: -(-n // BLOCK)] + [0] * (width - -(-n // BLOCK)) for t, n in zip(tables, seq_lens)]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_rows_equal_the_padded_tables_whatever_happens_between_steps(data):
    rows = BlockTableRows(BLOCK, num_rows=2, num_cols=2)  # small, so that it must grow
    live: dict[int, tuple[list[int], int]] = {}  # request -> (its table, tokens computed)
    next_id, next_block = 0, 1
    for _ in range(data.draw(st.integers(1, 12))):
        # Requests come and go: new ones (admitted: a fresh table), preempted ones (a new table),
        # ones the step leaves out, and running ones that grow one token or a chunk.
        for _ in range(data.draw(st.integers(0, 3))):
            live[next_id] = ([], 0)
            next_id += 1
        plan, new_tables, freed = [], [], []
        for rid in sorted(live):
            choice = data.draw(st.sampled_from(["run", "run", "skip", "restart", "finish"]))
            table, computed = live[rid]
            if choice == "finish":
                del live[rid]
                freed.append(rid)
                continue
            if choice == "skip":
                continue
            new = choice == "restart" or not table
            if new:
                table, computed = [], 0
            num_new = data.draw(st.integers(1, 9))
            needed = -(-(computed + num_new) // BLOCK)
            if table and not new and computed % BLOCK and data.draw(st.booleans()):
                table[computed // BLOCK] = next_block  # copy-on-write replaces the block it writes into
                next_block += 1
            while len(table) < needed:
                table.append(next_block)
                next_block += 1
            live[rid] = (table, computed)
            plan.append((rid, list(table), computed, computed + num_new))
            new_tables.append(new)
        if not plan:
            continue
        changes = [table if new else table[computed // BLOCK:] for (_, table, computed, _), new in zip(plan, new_tables)]
        got = rows.update([p[0] for p in plan], changes, new_tables, [p[2] for p in plan], [p[3] for p in plan], freed)
        if data.draw(st.booleans()):  # the step failed and is retried: the same plan again
            assert rows.update([p[0] for p in plan], changes, new_tables, [p[2] for p in plan],
                               [p[3] for p in plan], freed).tolist() == got.tolist()
        assert got.tolist() == padded([p[1] for p in plan], [p[3] for p in plan])
        for rid, table, _, seq_len in plan:  # the step ran
            live[rid] = (table, seq_len)


def test_a_decode_step_writes_only_the_new_blocks():
    rows = BlockTableRows(BLOCK)
    tables = [list(range(1, 65)), list(range(100, 164))]
    rows.update([0, 1], tables, [True, True], [0, 0], [256, 256])
    writes = []
    real = torch.Tensor.__setitem__

    def spy(self, key, value):
        if self is rows.table:
            writes.append(len(value))
        return real(self, key, value)

    torch.Tensor.__setitem__ = spy
    try:
        tables[0].append(65)  # request 0 crosses into a new block; request 1 stays in its last one
        got = rows.update([0, 1], [tables[0][64:], tables[1][63:]], [False, False], [256, 255], [257, 256])
    finally:
        torch.Tensor.__setitem__ = real
    assert writes == [2]  # one write: request 0's new block (64) and request 1's last block (63)
    assert got.tolist() == padded(tables, [257, 256])
