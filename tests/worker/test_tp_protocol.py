"""A step's inputs survive the trip through the two int64 tensors the driver broadcasts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.lora.request import LoRARequest
from pagedserve.worker import tp_protocol as protocol
from pagedserve.worker.model_runner import StepInputs


@st.composite
def step_inputs(draw) -> StepInputs:
    num_reqs = draw(st.integers(1, 6))
    new = draw(st.lists(st.integers(1, 9), min_size=num_reqs, max_size=num_reqs))
    computed = draw(st.lists(st.integers(0, 50), min_size=num_reqs, max_size=num_reqs))
    width, groups = draw(st.integers(1, 5)), draw(st.integers(1, 3))  # KV cache groups: a table each
    size = groups * num_reqs * width
    tables = torch.tensor(draw(st.lists(st.integers(0, 2**40), min_size=size, max_size=size))).view(groups, num_reqs,
                                                                                                  width)
    ids = draw(st.lists(st.integers(0, 2**31), min_size=sum(new), max_size=sum(new)))
    copies = draw(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=4))
    rows = draw(st.lists(st.integers(0, sum(new) - 1), max_size=8))
    token_slots = draw(st.one_of(st.none(), st.lists(st.integers(-1, 7), min_size=sum(new), max_size=sum(new))))
    names = st.text(min_size=1, max_size=12)  # any text: names and paths cross as UTF-8 JSON
    loads = draw(st.lists(st.tuples(st.integers(0, 7), st.builds(LoRARequest, names, st.integers(1, 2**40), names)),
                          max_size=3))
    return StepInputs(ids, computed, new, tables, copies, rows, token_slots, loads)


@settings(max_examples=200, deadline=None)
@given(step_inputs())
def test_pack_then_unpack_gives_the_same_step(inputs):
    head, payload = protocol.pack_step(inputs)
    assert head.shape == (protocol.HEADER_LEN,) and head.dtype == payload.dtype == torch.int64
    groups = inputs.block_tables.shape[0]
    assert payload.numel() == protocol.payload_len(head, groups)
    out = protocol.unpack_step(head, payload, groups)
    assert (out.input_ids, out.num_computed, out.num_new, out.block_copies, out.logits_rows) == (
        inputs.input_ids, inputs.num_computed, inputs.num_new, inputs.block_copies, inputs.logits_rows)
    assert (out.lora_token_slots, out.lora_loads) == (inputs.lora_token_slots, inputs.lora_loads)
    assert torch.equal(out.block_tables, inputs.block_tables)
