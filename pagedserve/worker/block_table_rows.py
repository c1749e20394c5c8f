"""The step's block tables as one tensor, kept from step to step, fed by the scheduler's changes.

Rebuilding every running request's table as a padded list of lists, then a new tensor, costs
O(running x context) host time per step, and so would the scheduler copying whole tables. Here
the runner keeps each request's table (`blocks_of`), which the plan changes: a table new to the
runner (an admission, a recompute after preemption or a failed step, a fork) comes whole; a grown
one comes from the block its step writes into first (a copy-on-write may have replaced that one)
to its end. The scheduler's `freed` ids let go of finished and preempted requests.

Each request scheduled keeps a row of a persistent tensor while it is scheduled step after step,
and only the changed entries are written. Rows of requests that a step does not schedule are
given up; such a request's row is written whole from its kept table when it comes back. Beyond
each table, a row holds zeros, as the padded lists did.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from pagedserve.kv.sizes import cdiv


class BlockTableRows:
    def __init__(self, block_size: int, num_rows: int = 64, num_cols: int = 64) -> None:
        self.block_size = block_size
        self.blocks_of: dict[Hashable, list[int]] = {}  # every live request's table, as the plans said
        self.table = torch.zeros((num_rows, num_cols), dtype=torch.int64)
        self.lengths = [0] * num_rows  # entries of each row that may be non-zero
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.row_of: dict[Hashable, int] = {}

    def update(self, request_ids: list[Hashable], new_block_ids: list[list[int]], new_tables: list[bool],
               num_computed_tokens: list[int], seq_lens: list[int], freed: list[Hashable] = ()) -> Tensor:
        """Apply one plan's changes (see the module docstring); return this step's tables,
        [num_requests, most blocks any of them needs], padded with 0. Applying the same plan
        twice (a step retried after a fault) gives the same tables."""
        for rid in freed:
            self.blocks_of.pop(rid, None)
        scheduled = set(request_ids)
        for gone in [rid for rid in self.row_of if rid not in scheduled]:
            self.free_rows.append(self.row_of.pop(gone))
        tables = []
        for rid, ids, new, computed in zip(request_ids, new_block_ids, new_tables, num_computed_tokens):
            if new:
                blocks = self.blocks_of[rid] = list(ids)
            else:
                blocks = self.blocks_of[rid]
                blocks[computed // self.block_size:] = ids
            tables.append(blocks)
        self._fit(len(request_ids), max(len(t) for t in tables))  # every kept row is scheduled
        rows, cols, values = [], [], []
        for rid, blocks, new, computed in zip(request_ids, tables, new_tables, num_computed_tokens):
            row = self.row_of.get(rid)
            if row is None or new:
                if row is None:
                    row = self.row_of[rid] = self.free_rows.pop()
                start, end = 0, max(len(blocks), self.lengths[row])  # zero what a longer table left
            else:
                start, end = min(computed // self.block_size, len(blocks)), len(blocks)
            for col in range(start, end):
                rows.append(row)
                cols.append(col)
                values.append(blocks[col] if col < len(blocks) else 0)
            self.lengths[row] = len(blocks)
        if rows:
            self.table[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(values, dtype=torch.int64)
        width = max(cdiv(n, self.block_size) for n in seq_lens)
        index = torch.tensor([self.row_of[rid] for rid in request_ids])
        return self.table[index, :width]

    def _fit(self, num_rows: int, num_cols: int) -> None:
        """Grow the tensor (doubling) to hold this many rows and columns."""
        old_rows, old_cols = self.table.shape
        rows, cols = old_rows, old_cols
        while rows < num_rows:
            rows *= 2
        while cols < num_cols:
            cols *= 2
        if (rows, cols) == (old_rows, old_cols):
            return
        table = torch.zeros((rows, cols), dtype=torch.int64)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self.lengths += [0] * (rows - old_rows)
        self.free_rows = list(range(rows - 1, old_rows - 1, -1)) + self.free_rows
