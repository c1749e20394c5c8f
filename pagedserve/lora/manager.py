"""A model runner's adapters: read from disk off the step loop into host memory, copied into the
model's slots when a step needs them.

The engine core asks for an adapter when a request for it arrives (`prefetch`): a thread reads and
checks it (`weights.load_adapter`) while steps go on, and the request joins the scheduler once it is
in memory. Host memory keeps `max_cpu_loras` adapters, least recently used out. A step's plan names
the (slot, adapter) pairs to fill before its forward pass (`activate`): a copy of the adapter's A/B
into each fused linear's stacks. An adapter that host memory no longer holds by then (evicted, or a
tensor-parallel worker, which reads its shard only when a step needs it) is read at that point.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedserve.config import EngineConfig
from pagedserve.lora.layers import LoRABatch, attach, load_slot
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.weights import LoRAWeights, load_adapter
from pagedserve.models.config import ModelConfig

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 capacity: int) -> None:
        """capacity: the most tokens a step runs (the per-token slots' buffer)."""
        self.model, self.model_config = model, model_config
        self.max_rank, self.max_host, self.dtype = config.max_lora_rank, config.max_cpu_loras, config.torch_dtype
        self.batch: LoRABatch = attach(model, config.max_loras, config.max_lora_rank, capacity)
        # Keyed by the whole request (id, name and path): an id given to another adapter misses.
        self._host: OrderedDict[LoRARequest, LoRAWeights] = OrderedDict()  # least recently used first
        self._loading: dict[LoRARequest, Future] = {}
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-lora")

    def prefetch(self, adapter: LoRARequest) -> Future:
        """A future done once `adapter` is in host memory (its exception: a ValueError saying why
        the adapter cannot be served)."""
        with self._lock:
            if adapter in self._host:
                self._host.move_to_end(adapter)
                done: Future = Future()
                done.set_result(None)
                return done
            future = self._loading.get(adapter)
            if future is None:
                future = self._loader.submit(self._load, adapter)
                self._loading[adapter] = future
            return future

    def _load(self, adapter: LoRARequest) -> LoRAWeights:
        try:
            weights = load_adapter(adapter.lora_path, self.model_config, self.max_rank, self.dtype, self.model.shard)
            with self._lock:
                self._host[adapter] = weights
                while len(self._host) > self.max_host:
                    self._host.popitem(last=False)
            return weights
        finally:
            with self._lock:
                self._loading.pop(adapter, None)

    def activate(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Fill each slot with its adapter, before a step that needs them. One host memory has
        dropped is read again here (a bounded read of a small file, every check repeated: a file
        changed since is refused, and the step's fault containment fails the requests that need it)."""
        for slot, adapter in loads:
            with self._lock:
                weights = self._host.get(adapter)
            if weights is None:
                weights = self._load(adapter)
            load_slot(self.model, slot, weights)

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            for adapter in [a for a in self._host if a.lora_int_id == lora_int_id]:
                del self._host[adapter]

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
