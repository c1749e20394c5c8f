"""Which adapter each of the model's slots holds.

The model keeps `num_slots` (max_loras) adapters' weights at once; a step may use at most that many
distinct adapters (the scheduler's rule). An adapter a step needs stays where it is; one that is not
in a slot takes a free one, else the least recently used slot that this step does not need.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first

    def assign(self, adapters: list[LoRARequest | None]) -> tuple[list[int], list[tuple[int, LoRARequest]]]:
        """The slot of each entry (-1: the base model), and the (slot, adapter) loads that must
        happen before the step runs."""
        needed = {a.lora_int_id: a for a in adapters if a is not None}
        if len(needed) > self.num_slots:
            raise ValueError(f"a step uses {len(needed)} adapters, more than max_loras ({self.num_slots})")
        for lora_id in needed:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
        loads = []
        for lora_id, adapter in needed.items():
            if lora_id not in self._slot_of:
                slot = self._free_slot(needed)
                self._slot_of[lora_id] = slot
                loads.append((slot, adapter))
        return [-1 if a is None else self._slot_of[a.lora_int_id] for a in adapters], loads

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        taken = set(self._slot_of.values())
        free = next((s for s in range(self.num_slots) if s not in taken), None)
        if free is not None:
            return free
        victim = next(lora_id for lora_id in self._slot_of if lora_id not in needed)  # the oldest unneeded
        return self._slot_of.pop(victim)

    def forget(self, lora_int_id: int) -> None:
        """The slot of this adapter no longer counts as holding it (a failed step may have left it
        half written; a removed adapter): it is loaded again when next needed."""
        self._slot_of.pop(lora_int_id, None)

    def forget_all(self) -> None:
        self._slot_of.clear()

    def holds(self, lora_int_id: int) -> bool:
        return lora_int_id in self._slot_of
