"""What the driver (rank 0) tells the other ranks, as tensors in a fixed number of broadcasts.

Every command is one int64 header of HEADER_LEN entries, broadcast on the control group (a gloo
group with a long timeout, so an idle worker may wait on it for hours). A step adds one int64
payload, the `StepInputs` of the step laid end to end, whose part lengths the header carries:
two broadcasts per step, whatever the batch, and no pickled Python objects.

    header: [op, tokens, requests, table width, block copies, logits rows, arg, 0]

With LoRA a step's header says whether the payload holds each token's adapter slot (arg) and how
many bytes of (slot, adapter) loads follow, as JSON one byte per entry (the last entry).
"""

from __future__ import annotations

import json

import torch
from torch import Tensor

from pagedserve.lora.request import LoRARequest
from pagedserve.worker.model_runner import StepInputs

HEADER_LEN = 8
STEP, SHUTDOWN, MEASURE_KV, INIT_KV, WARM_UP = 1, 2, 3, 4, 5


def header(op: int, *args: int) -> Tensor:
    values = [op, *args]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def pack_step(inputs: StepInputs) -> tuple[Tensor, Tensor]:
    """(header, payload) of a step."""
    tables = inputs.block_tables.to(torch.int64)  # [groups, requests, width]: each rank knows the groups
    _, num_reqs, width = tables.shape
    copies = [i for pair in inputs.block_copies for i in pair]
    slots = inputs.lora_token_slots or []
    loads = list(json.dumps([[slot, a.lora_name, a.lora_int_id, a.lora_path] for slot, a in inputs.lora_loads])
                 .encode()) if inputs.lora_loads else []
    head = header(STEP, len(inputs.input_ids), num_reqs, width, len(inputs.block_copies), len(inputs.logits_rows),
                  int(inputs.lora_token_slots is not None), len(loads))
    lists = torch.tensor(inputs.input_ids + inputs.num_computed + inputs.num_new, dtype=torch.int64)
    rest = torch.tensor(copies + inputs.logits_rows + slots + loads, dtype=torch.int64)
    return head, torch.cat([lists, tables.reshape(-1), rest])


def payload_len(head: Tensor, num_groups: int = 1) -> int:
    """The payload's length, for a model of `num_groups` KV cache groups."""
    tokens, reqs, width, copies, rows, has_slots, load_bytes = head[1:8].tolist()
    return tokens + 2 * reqs + num_groups * reqs * width + 2 * copies + rows + has_slots * tokens + load_bytes


def unpack_step(head: Tensor, payload: Tensor, num_groups: int = 1) -> StepInputs:
    tokens, reqs, width, copies, rows, has_slots, load_bytes = head[1:8].tolist()
    ids, computed, new, tables, pairs, logits_rows, slots, loads = payload.split(
        [tokens, reqs, reqs, num_groups * reqs * width, 2 * copies, rows, has_slots * tokens, load_bytes])
    pairs = pairs.tolist()
    lora_loads = [(slot, LoRARequest(*fields)) for slot, *fields in json.loads(bytes(loads.tolist()))] \
        if load_bytes else []
    return StepInputs(ids.tolist(), computed.tolist(), new.tolist(), tables.view(num_groups, reqs, width),
                      list(zip(pairs[0::2], pairs[1::2])), logits_rows.tolist(),
                      slots.tolist() if has_slots else None, lora_loads)
