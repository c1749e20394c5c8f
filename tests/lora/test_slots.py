"""The model's LoRA slots: an adapter a step needs stays where it is, a new one takes a free slot,
else the least recently used one this step does not need."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.lora.request import LoRARequest
from pagedserve.lora.slots import LoRASlots


def adapter(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def test_new_adapters_take_free_slots_and_keep_them():
    slots = LoRASlots(2)
    a, b = adapter(1), adapter(2)
    assigned, loads = slots.assign([a, None, b, a])
    assert assigned[1] == -1 and assigned[0] == assigned[3] != assigned[2]
    assert sorted(loads, key=lambda x: x[0]) == sorted([(assigned[0], a), (assigned[2], b)], key=lambda x: x[0])
    again, loads = slots.assign([b, a])
    assert again == [assigned[2], assigned[0]] and loads == []


def test_a_full_table_evicts_the_least_recently_used_adapter_the_step_does_not_need():
    slots = LoRASlots(2)
    a, b, c = adapter(1), adapter(2), adapter(3)
    (slot_a,), _ = slots.assign([a])
    (slot_b,), _ = slots.assign([b])
    slots.assign([a])  # a is now the most recent
    assigned, loads = slots.assign([c])
    assert assigned == [slot_b] and loads == [(slot_b, c)]
    assert slots.holds(1) and not slots.holds(2)


def test_more_adapters_than_slots_in_one_step_is_refused():
    with pytest.raises(ValueError, match="max_loras"):
        LoRASlots(1).assign([adapter(1), adapter(2)])


def test_a_forgotten_adapter_is_loaded_again():
    slots = LoRASlots(1)
    slots.assign([adapter(1)])
    slots.forget(1)
    _, loads = slots.assign([adapter(1)])
    assert loads == [(0, adapter(1))]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(st.one_of(st.none(), st.integers(1, 6)), max_size=6), max_size=30))
def test_every_step_finds_each_adapter_in_its_own_slot(num_slots, steps):
    """Whatever the sequence of steps: the step's adapters sit in distinct slots, the loads are
    exactly those not already in place, and what stays loaded is remembered."""
    slots = LoRASlots(num_slots)
    held: dict[int, int] = {}  # slot -> adapter id, as the model would hold them
    for ids in steps:
        if len({i for i in ids if i is not None}) > num_slots:
            continue
        assigned, loads = slots.assign([None if i is None else adapter(i) for i in ids])
        for slot, a in loads:
            assert 0 <= slot < num_slots
            held[slot] = a.lora_int_id
        for i, slot in zip(ids, assigned):
            assert (slot == -1) if i is None else held[slot] == i
        loaded = {a.lora_int_id for _, a in loads}
        assert len({s for _, s in zip(ids, assigned) if s >= 0}) == len({i for i in ids if i is not None})
        assert len(loads) == len(loaded)
