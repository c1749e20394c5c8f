"""AttentionMetadata: where one step's new tokens go in the KV cache and what each request reads.

Built once per step by the engine's attention backend (`AttentionBackend.build_metadata`) and
passed down to every attention layer, which runs that backend on it (`md.backend`).
- `AttentionMetadata` is the part the model runner and every backend read: slots, positions,
  block tables, lengths, where each request's tokens sit in the batch.
- A backend that needs more derives its own class and adds it. Both production backends split
  the step the same way (`BatchedDecodeMetadata`); the torch backend adds its SDPA decode groups
  and masks (`sdpa.SdpaMetadata`), the Triton backend its prefill request ids on the device
  (`triton_paged.TritonMetadata`). The oracle (torch_ref) reads the common part only.

Conventions:
- The batch is flat: request i owns tokens query_start_loc[i]:query_start_loc[i+1] of the step,
  which are its context positions num_computed_tokens[i] .. seq_lens[i]-1, in order.
- Requests may come in any order.
- Block tables are padded with block 0; padded and not-yet-written slots sit beyond a request's
  seq_len and the causal mask hides them.
- Everything here is computed once per step; attention layers only index with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from pagedserve.kv.sizes import cdiv

if TYPE_CHECKING:
    from pagedserve.attention import AttentionBackend

M = TypeVar("M", bound="AttentionMetadata")


class HostStep(NamedTuple):
    """A step's shape on the host, from which each metadata class builds its tensors."""

    tables: Tensor              # [num_reqs, max blocks needed] int64 block ids, padded with 0
    blocks_needed: list[int]    # blocks each request's context spans
    num_new_tokens: list[int]
    seq_lens: list[int]
    query_start_loc: list[int]  # [num_reqs + 1]


@dataclass(kw_only=True)
class AttentionMetadata:
    # Device tensors, all int64.
    slot_mapping: Tensor         # [num_tokens] block * block_size + offset of each new token
    block_tables: Tensor         # [num_reqs, max_blocks] physical block ids, padded with 0
    seq_lens: Tensor             # [num_reqs] context length after this step (computed + new)
    query_start_loc: Tensor      # [num_reqs + 1] offsets of each request's tokens in the batch
    positions: Tensor            # [num_tokens] context position of each new token
    logits_indices: Tensor       # [num_reqs] index of each request's last token in the batch
    # Host-side copies, so the attention loop never waits on the device.
    block_size: int
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    calculate_kv_scales: bool = False  # layers set their fp8 cache's scales from this step's K/V
    # The backend that built this metadata: every attention layer of the step runs it.
    backend: AttentionBackend | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls: type[M],
        block_tables: list[list[int]] | Tensor,
        num_computed_tokens: list[int],
        num_new_tokens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        backend: AttentionBackend | None = None,
    ) -> M:
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

        step = HostStep(tables, needed, num_new_tokens, seq_lens, query_start_loc)
        return cls(
            slot_mapping=slots.to(device),
            block_tables=tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
            positions=positions.to(device),
            logits_indices=torch.tensor(query_start_loc[1:], dtype=torch.int64, device=device) - 1,
            block_size=block_size,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start_loc,
            max_query_len=max(num_new_tokens),
            max_seq_len=max(seq_lens),
            backend=backend,
            **cls.backend_fields(step, device),
        )

    @classmethod
    def backend_fields(cls, step: HostStep, device: torch.device | str) -> dict[str, Any]:
        """The fields a subclass adds, computed from the step's host-side shape: none here."""
        return {}


@dataclass(kw_only=True)
class BatchedDecodeMetadata(AttentionMetadata):
    """The step split as both production backends run it: every request with exactly one new token
    (a decode step, or a one-token prompt or chunk) in one batch, read through
    `decode_block_tables`; requests with more new tokens (fresh prompts, prompts whose first blocks
    came from the prefix cache, prefill chunks) one at a time."""

    decode_token_indices: Tensor  # [num_decodes] batch index of each one-token request's token
    decode_block_tables: Tensor   # [num_decodes, longest decode's blocks] their block tables
    decode_seq_lens: Tensor       # [num_decodes] their context lengths
    num_decodes: int
    prefill_req_indices: list[int]  # requests with more than one new token

    @classmethod
    def backend_fields(cls, step: HostStep, device: torch.device | str) -> dict[str, Any]:
        decodes = [i for i, n in enumerate(step.num_new_tokens) if n == 1]
        width = max((step.blocks_needed[i] for i in decodes), default=0)
        return super().backend_fields(step, device) | dict(
            decode_token_indices=torch.tensor([step.query_start_loc[i] for i in decodes], dtype=torch.int64,
                                              device=device),
            decode_block_tables=step.tables[decodes, :width].to(device),
            decode_seq_lens=torch.tensor([step.seq_lens[i] for i in decodes], dtype=torch.int64, device=device),
            num_decodes=len(decodes),
            prefill_req_indices=[i for i, n in enumerate(step.num_new_tokens) if n > 1],
        )


def static_decode_fields(slot_mapping: Tensor, positions: Tensor, block_tables: Tensor, seq_lens: Tensor,
                         block_size: int) -> dict[str, Any]:
    """`BatchedDecodeMetadata`'s fields over the given tensors for a step of len(seq_lens) one-token
    requests: a graph's static buffers (CUDA graphs, CPU recordings), refilled before each replay.
    The kernels that replay read the step's lengths and tables from those tensors only, never from
    the host-side values, which are therefore upper bounds (whole tables) that hold for every replay."""
    size = seq_lens.shape[0]
    device = seq_lens.device
    tokens = torch.arange(size, device=device)
    full_len = block_tables.shape[1] * block_size
    return dict(
        slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=torch.arange(size + 1, device=device), positions=positions, logits_indices=tokens,
        block_size=block_size, seq_lens_cpu=[full_len] * size, query_start_loc_cpu=list(range(size + 1)),
        max_query_len=1, max_seq_len=full_len,
        decode_token_indices=tokens, decode_block_tables=block_tables, decode_seq_lens=seq_lens, num_decodes=size,
        prefill_req_indices=[],
    )
