"""AttentionMetadata: where one step's new tokens go in the KV cache and what each request reads.

Built once per step by the model runner and passed down to every attention layer as an argument.

Conventions:
- The batch is flat: request i owns tokens query_start_loc[i]:query_start_loc[i+1] of the step,
  which are its context positions num_computed_tokens[i] .. seq_lens[i]-1, in order.
- Requests may come in any order. Every request with exactly one new token (a decode step, or a
  one-token prompt or chunk) takes the decode fast path: one gather through `decode_block_tables`
  serves all of them at once. Requests with more new tokens (fresh prompts, prompts whose first
  blocks came from the prefix cache, prefill chunks) are attended one request at a time.
- Block tables are padded with block 0; padded and not-yet-written slots sit beyond a request's
  seq_len and the causal mask hides them.
- `decode_groups` split the one-token requests into a few groups of similar context length, so
  that padding each group to its longest member reads little more K/V than the requests own.
  They are built on first use, as only the SDPA decode path reads them.
  Everything here is computed once per step; attention layers only index with it, and may keep
  per-step tensors they derive from it (masks) in `cache`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pagedserve.kv.sizes import cdiv

# A decode group ends where a request's context falls below DECODE_GROUP_RATIO of the group's
# longest (padding then wastes under 20% of the K/V a group reads), or where it would hold more
# than DECODE_GROUP_MAX_KEYS keys in all (1.5 MB each of K and V per layer for the embedded model, so
# a group's gathered K/V is still in cache when attention reads it: on the 2-core test machine, 64
# decodes of 150-240 tokens took 6.3 ms per layer in capped groups, 8.7 ms without the cap).
DECODE_GROUP_RATIO = 0.8
DECODE_GROUP_MAX_KEYS = 2048


@dataclass
class DecodeGroup:
    """One-token requests attended together, each padded to the group's longest context."""

    token_indices: Tensor  # [n] batch index of each request's token
    block_ids: Tensor      # [n * num_blocks] their block tables, padded with block 0, flattened
    seq_lens: Tensor       # [n] context lengths (the new token's position + 1)
    num_blocks: int        # blocks read per request


@dataclass
class AttentionMetadata:
    # Device tensors, all int64.
    slot_mapping: Tensor         # [num_tokens] block * block_size + offset of each new token
    block_tables: Tensor         # [num_reqs, max_blocks] physical block ids, padded with 0
    seq_lens: Tensor             # [num_reqs] context length after this step (computed + new)
    query_start_loc: Tensor      # [num_reqs + 1] offsets of each request's tokens in the batch
    positions: Tensor            # [num_tokens] context position of each new token
    logits_indices: Tensor       # [num_reqs] index of each request's last token in the batch
    decode_token_indices: Tensor  # [num_decodes] batch index of each one-token request's token
    decode_block_tables: Tensor  # [num_decodes, decode_max_blocks] their block tables
    decode_seq_lens: Tensor      # [num_decodes] their context lengths
    # Host-side copies, so the attention loop never waits on the device.
    block_size: int
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    prefill_req_indices: list[int]  # requests with more than one new token
    backend: str = "torch"  # which attention implementation layers call (see attention/__init__.py)
    calculate_kv_scales: bool = False  # layers set their fp8 cache's scales from this step's K/V
    # Per-step tensors that attention layers derive from the above (e.g. masks), built by the
    # first layer that needs them and reused by the others.
    cache: dict[Any, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def decode_groups(self) -> list[DecodeGroup]:
        qsl, seq_lens, device = self.query_start_loc_cpu, self.seq_lens_cpu, self.block_tables.device
        decodes = [i for i in range(self.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        groups = []
        for members in _group_by_length(sorted(decodes, key=lambda i: -seq_lens[i]), seq_lens):
            num_blocks = cdiv(seq_lens[members[0]], self.block_size)
            groups.append(DecodeGroup(
                token_indices=torch.tensor([qsl[i] for i in members], dtype=torch.int64, device=device),
                block_ids=self.block_tables[torch.tensor(members, device=device), :num_blocks].flatten(),
                seq_lens=torch.tensor([seq_lens[i] for i in members], dtype=torch.int64, device=device),
                num_blocks=num_blocks,
            ))
        return groups

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]] | Tensor,
        num_computed_tokens: list[int],
        num_new_tokens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for one step. Request i has num_computed_tokens[i] tokens already in its blocks
        and runs num_new_tokens[i] new ones; block_tables[i] must cover all of them (extra blocks
        at the end are allowed and ignored). block_tables may also come as a host tensor, padded
        with 0, at least as wide as the longest request needs (the model runner keeps one)."""
        num_reqs = len(block_tables)
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_reqs == 0 or not num_reqs == len(num_computed_tokens) == len(num_new_tokens):
            raise ValueError("need one block table, computed count and new count per request, and at least one request")
        seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens)]
        needed = [cdiv(s, block_size) for s in seq_lens]
        for i, need in enumerate(needed):
            if num_new_tokens[i] < 1 or num_computed_tokens[i] < 0:
                raise ValueError(f"request {i}: needs at least one new token and no negative computed count")
            if isinstance(block_tables, list) and len(block_tables[i]) < need:
                raise ValueError(f"request {i}: {seq_lens[i]} tokens need {need} blocks, "
                                 f"its table has {len(block_tables[i])}")

        query_start_loc = [0]
        for n in num_new_tokens:
            query_start_loc.append(query_start_loc[-1] + n)
        max_blocks = max(needed)
        if isinstance(block_tables, Tensor):
            if block_tables.shape[1] < max_blocks:
                raise ValueError(f"the block tables are {block_tables.shape[1]} wide, a request needs {max_blocks}")
            tables = block_tables[:, :max_blocks]
        else:
            padded = [list(t[:n]) + [0] * (max_blocks - n) for t, n in zip(block_tables, needed)]
            tables = torch.tensor(padded, dtype=torch.int64)

        # Per-token indices, vectorised on the host.
        new = torch.tensor(num_new_tokens, dtype=torch.int64)
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), new)
        positions = (torch.arange(query_start_loc[-1]) - starts[req_of_token]
                     + torch.tensor(num_computed_tokens, dtype=torch.int64)[req_of_token])
        slots = tables[req_of_token, positions // block_size] * block_size + positions % block_size

        decodes = [i for i, n in enumerate(num_new_tokens) if n == 1]
        decode_max_blocks = max((needed[i] for i in decodes), default=0)
        return cls(
            slot_mapping=slots.to(device),
            block_tables=tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
            positions=positions.to(device),
            logits_indices=torch.tensor(query_start_loc[1:], dtype=torch.int64, device=device) - 1,
            decode_token_indices=starts[decodes].to(device),
            decode_block_tables=tables[decodes, :decode_max_blocks].to(device),
            decode_seq_lens=torch.tensor([seq_lens[i] for i in decodes], dtype=torch.int64, device=device),
            block_size=block_size,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start_loc,
            max_query_len=max(num_new_tokens),
            max_seq_len=max(seq_lens),
            num_decodes=len(decodes),
            prefill_req_indices=[i for i, n in enumerate(num_new_tokens) if n > 1],
        )


def _group_by_length(reqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split requests sorted by decreasing length into runs whose shortest member is at least
    DECODE_GROUP_RATIO of the run's longest and whose padded length stays within
    DECODE_GROUP_MAX_KEYS."""
    groups: list[list[int]] = []
    for i in reqs:
        if (not groups or seq_lens[i] < DECODE_GROUP_RATIO * seq_lens[groups[-1][0]]
                or (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] > DECODE_GROUP_MAX_KEYS):
            groups.append([])
        groups[-1].append(i)
    return groups
