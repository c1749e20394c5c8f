"""The adapters' weights on the model's fused linears, and the batched delta they add.

Each of the four fused linears of every layer (qkv_proj, o_proj, gate_up_proj, down_proj) gets a
`LoRAStack` as its `lora` attribute: the A and B of every slot, in fixed memory, which `load_slot`
overwrites in place. One `LoRABatch` per model holds the step's slot for each token; every stack adds,
to each row of its linear's output, the delta of that row's slot (none for -1, the base model), all
slots in one call:
- on CPU in float32 and bfloat16, in C (ops/lora_cpu.py, csrc/lora.c), a call that a decode replay
  (worker/cpu_graphs.py) records like the other kernels: it reads the slots from the batch's buffer,
  whose address never changes, and the weights from the stacks, which a slot's load writes in place;
- elsewhere (CUDA, float16, PAGEDSERVE_CPU_KERNEL=0) in torch: the rows grouped by slot (once per
  step), each group padded to the longest, two batched matmuls per part against the groups' A and B,
  and the deltas added back to their rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from pagedserve.ops import lora_cpu

Parts = list[tuple[Tensor, Tensor] | None]  # per part of a fused linear: (A [r, in], B [width, r]), or None


class AdapterModules(Protocol):
    """What `load_slot` reads of an adapter (lora/weights.py's LoRAWeights): (layer, fused module)
    -> its parts, for the modules it touches."""

    modules: dict[tuple[int, str], Parts]


@dataclass
class _Groups:
    """A step's rows grouped by slot, for the torch path: `rows` [groups, longest] the rows of each
    group (padded with row 0), `slots` [groups] their slots, `dest` the rows in group order and
    `flat` where each sits in rows.view(-1)."""

    slots: Tensor
    rows: Tensor
    dest: Tensor
    flat: Tensor


def _group(slots: Tensor, device: torch.device) -> _Groups | None:
    """The grouping of rows by their slots (a CPU tensor, -1 for none); None when no row has one."""
    active = (slots >= 0).nonzero().squeeze(1)
    if active.numel() == 0:
        return None
    by_slot = torch.argsort(slots[active], stable=True)
    dest, sorted_slots = active[by_slot], slots[active][by_slot]
    used, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    longest = int(counts.max())
    group = torch.repeat_interleave(torch.arange(len(used)), counts)
    flat = group * longest + torch.arange(len(dest)) - (counts.cumsum(0) - counts)[group]
    rows = torch.zeros(len(used) * longest, dtype=torch.int64)
    rows[flat] = dest
    return _Groups(*(t.to(device) for t in (used, rows.view(len(used), longest), dest, flat)))


class LoRABatch:
    """The step's slot for each of up to `capacity` tokens (-1: the base model), in `slots`, a buffer
    whose address never changes: every stack reads it, and a recorded replay points at it. Rows past
    the last `set` are -1."""

    def __init__(self, capacity: int, num_slots: int, device: torch.device | str) -> None:
        if capacity < 1 or num_slots < 1:
            raise ValueError(f"a LoRA batch needs a capacity and slots, got {capacity} and {num_slots}")
        self.capacity, self.num_slots = capacity, num_slots
        self.slots = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self._host = torch.empty(0, dtype=torch.int64)  # slots[:len] on CPU: the torch path groups from it
        self._groups: dict[int, _Groups | None] = {}

    def set(self, token_slots: list[int]) -> None:
        """This step's slots, one per token."""
        n = len(token_slots)
        if n > self.capacity:
            raise ValueError(f"{n} tokens in a step, past the LoRA batch's capacity of {self.capacity}")
        host = torch.tensor(token_slots, dtype=torch.int64)
        if n and not (-1 <= int(host.min()) and int(host.max()) < self.num_slots):
            raise ValueError(f"a token's LoRA slot is outside [-1, {self.num_slots})")
        self.slots[:n].copy_(host)
        if len(self._host) > n:
            self.slots[n:len(self._host)] = -1
        self._host, self._groups = host, {}

    def clear(self, rows: int | None = None) -> None:
        """Rows [0, rows) (every row: None) back to the base model."""
        rows = self.capacity if rows is None else min(rows, self.capacity)
        self.slots[:rows] = -1
        if rows >= len(self._host):
            self._host = self._host[:0]
        else:
            self._host = self._host.clone()
            self._host[:rows] = -1
        self._groups = {}

    def groups(self, rows: int) -> _Groups | None:
        """Rows [0, rows) grouped by slot for the torch path (None: none has an adapter), made once
        per step and row count."""
        if rows not in self._groups:
            self._groups[rows] = _group(self._host[:rows], self.slots.device)
        return self._groups[rows]


class LoRAStack:
    """The A and B of every slot of `batch` for one fused linear of `in_features` inputs whose
    output columns are parts of `part_widths` (q | k | v, gate | up, or one), up to rank `max_rank`,
    zero until a slot is set. Kept in csrc/lora.c's layout, which the torch path reads too: A
    transposed `at` [slots, parts, in_features, R], B transposed into its part's columns `bt`
    [slots, R, out_features], the rank of each slot's part `ranks` [slots, parts] (0: unused), R the
    max rank rounded up to lora_cpu.RANK_MULTIPLE. Every tensor keeps its address for good."""

    def __init__(self, batch: LoRABatch, in_features: int, part_widths: tuple[int, ...], max_rank: int,
                 dtype: torch.dtype) -> None:
        if max_rank < 1 or not part_widths or min(part_widths) < 1:
            raise ValueError(f"a LoRA stack needs a rank and parts, got {max_rank} and {part_widths}")
        self.batch, self.in_features, self.part_widths, self.max_rank = batch, in_features, tuple(part_widths), max_rank
        ends = list(itertools.accumulate(part_widths))
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self.out_features = ends[-1]
        self.rank_dim = -(-max_rank // lora_cpu.RANK_MULTIPLE) * lora_cpu.RANK_MULTIPLE
        device, slots, parts = batch.slots.device, batch.num_slots, len(part_widths)
        self.at = torch.zeros(slots, parts, in_features, self.rank_dim, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, self.rank_dim, self.out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, parts, dtype=torch.int64)
        self.part_ends = torch.tensor(ends, dtype=torch.int64)
        # The C kernel where it runs; tests switch it off to hold the two paths against each other.
        self.use_kernel = lora_cpu.available(device, dtype)

    def check(self, slot: int, parts: Parts | None) -> list[int]:
        """The rank of each part of `parts` (0 for None); ValueError unless they fit this stack."""
        if not 0 <= slot < self.batch.num_slots:
            raise ValueError(f"LoRA slot {slot} is outside [0, {self.batch.num_slots})")
        if parts is None:
            return [0] * len(self.part_widths)
        if len(parts) != len(self.part_widths):
            raise ValueError(f"{len(parts)} LoRA parts for a linear of {len(self.part_widths)}")
        ranks = []
        for part, width in zip(parts, self.part_widths):
            rank = 0 if part is None else part[0].shape[0]
            if part is not None and not (1 <= rank <= self.max_rank and part[0].shape == (rank, self.in_features)
                                         and part[1].shape == (width, rank)):
                raise ValueError(f"LoRA A {tuple(part[0].shape)} and B {tuple(part[1].shape)} do not fit a part of "
                                 f"{self.in_features} inputs and {width} outputs up to rank {self.max_rank}")
            ranks.append(rank)
        return ranks

    def set_slot(self, slot: int, parts: Parts | None) -> None:
        """Copy one adapter's A/B (per part, None where it has none; None: no adapter) into `slot`,
        in place. ValueError, and the slot left as it was, unless they fit."""
        ranks = self.check(slot, parts)
        at, bt = self.at[slot], self.bt[slot]
        for p, (rank, (start, end)) in enumerate(zip(ranks, self.bounds)):
            if rank:
                at[p, :, :rank].copy_(parts[p][0].T)
                bt[:rank, start:end].copy_(parts[p][1].T)
            # The ranks past the adapter's are zero: the torch path multiplies them. (Zeroing only
            # them: a whole slot's zeroing cost more than its copies.)
            if rank < self.rank_dim:
                at[p, :, rank:].zero_()
                bt[rank:, start:end].zero_()
        self.ranks[slot] = torch.tensor(ranks)

    def add_to(self, x: Tensor, out: Tensor) -> None:
        """out += the delta of each row of x under the batch's slots (row r: slot batch.slots[r]), in
        place: x [..., in_features], out [..., out_features], x's rows the first of the batch."""
        x, out = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
        rows = x.shape[0]
        if rows > self.batch.capacity:
            raise ValueError(f"{rows} rows, past the LoRA batch's capacity of {self.batch.capacity}")
        if self.use_kernel and x.dtype == self.at.dtype:
            lora_cpu.lora_add(x.contiguous(), out, self.batch.slots, self.at, self.bt, self.ranks, self.part_ends)
            return
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # The grouping is the step's, made on the host: a CUDA graph would replay the capture's.
            raise RuntimeError("LoRA deltas in torch cannot be captured in a CUDA graph: run with enforce_eager")
        groups = self.batch.groups(rows)
        if groups is None:
            return
        xs = x[groups.rows]  # [groups, longest, in]
        at, bt = self.at.index_select(0, groups.slots), self.bt.index_select(0, groups.slots)
        delta = torch.cat([torch.bmm(torch.bmm(xs, at[:, p]), bt[:, :, start:end])
                           for p, (start, end) in enumerate(self.bounds)], dim=2)
        out.index_add_(0, groups.dest, delta.view(-1, self.out_features)[groups.flat])


def _fused_linears(model: nn.Module) -> list[tuple[int, str, nn.Module, tuple[int, ...]]]:
    """(layer, name, linear, part widths) of every fused linear a LoRA stack attaches to."""
    hidden, intermediate = model.config.hidden_size, model.shard.intermediate_size
    found = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        found += [(i, "qkv_proj", attn.qkv_proj, (attn.q_size, attn.kv_size, attn.kv_size)),
                  (i, "o_proj", attn.o_proj, (hidden,)),
                  (i, "gate_up_proj", mlp.gate_up_proj, (intermediate, intermediate)),
                  (i, "down_proj", mlp.down_proj, (hidden,))]
    return found


def attach(model: nn.Module, num_slots: int, max_rank: int, capacity: int) -> LoRABatch:
    """Give every fused linear of `model` (a DecoderForCausalLM, on its device, in its dtype) a
    LoRAStack of `num_slots` slots up to rank `max_rank`, all reading one LoRABatch of `capacity`
    tokens, which is returned and kept as `model.lora_batch`. ValueError if the model has them already."""
    if getattr(model, "lora_batch", None) is not None:
        raise ValueError("the model already has LoRA slots")
    reference = model.model.norm.weight  # in the model's dtype and on its device, quantized linears or not
    batch = LoRABatch(capacity, num_slots, reference.device)
    linears = _fused_linears(model)
    for i, name, linear, widths in linears:
        if sum(widths) != linear.out_features:
            raise ValueError(f"layer {i}'s {name} has {linear.out_features} outputs, not its parts' {widths}")
    for _, _, linear, widths in linears:
        linear.lora = LoRAStack(batch, linear.in_features, widths, max_rank, reference.dtype)
    model.lora_batch = batch
    return batch


def detach(model: nn.Module) -> None:
    """Take the stacks and the batch off `model` (nothing to take: nothing done)."""
    if getattr(model, "lora_batch", None) is None:
        return
    for _, _, linear, _ in _fused_linears(model):
        linear.lora = None
    model.lora_batch = None


def load_slot(model: nn.Module, slot: int, weights: AdapterModules) -> None:
    """Copy an adapter into `slot` of every stack of `model` (see `attach`); a linear the adapter
    does not touch gets the slot cleared. ValueError, with nothing written, for weights that do not
    fit (another model's adapter, a rank past the stacks')."""
    linears = _stacks(model)
    names = {(i, name) for i, name, _ in linears}
    if unknown := sorted(set(weights.modules) - names):
        raise ValueError(f"the adapter has modules this model does not: {unknown[:4]}")
    for i, name, stack in linears:  # every check before any write: no half-written slot
        stack.check(slot, weights.modules.get((i, name)))
    for i, name, stack in linears:
        stack.set_slot(slot, weights.modules.get((i, name)))


def clear_slot(model: nn.Module, slot: int) -> None:
    """`slot` of every stack back to zero: its rows get the base model's output."""
    for _, _, stack in _stacks(model):
        stack.set_slot(slot, None)


def _stacks(model: nn.Module) -> list[tuple[int, str, LoRAStack]]:
    if getattr(model, "lora_batch", None) is None:
        raise ValueError("the model has no LoRA slots (lora.layers.attach)")
    return [(i, name, linear.lora) for i, name, linear, _ in _fused_linears(model)]
