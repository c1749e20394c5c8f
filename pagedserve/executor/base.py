"""The executor seam: how the engine core runs a step on its workers.

The core plans a step and samples; an executor runs the forward pass of that step wherever the
model lives and returns the logits of the rows that sample, and of the prompt positions whose
logprobs were asked for. Implementations: `uniproc.UniProcExecutor`, the one worker in the core's
own process, and `tensor_parallel.TensorParallelExecutor`, more workers (processes, devices) behind
the same calls; a data-parallel deployment runs several cores, each with its executor. This module
is the package's leaf: the core and the implementations import it, it imports neither.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.models.config import ModelConfig


# Seconds between an idle engine's looks at its executor's health (a tensor-parallel worker may die then).
HEALTH_CHECK_INTERVAL = 1.0


class ExecutorFailed(RuntimeError):
    """The executor can run no more steps (a tensor-parallel worker died, a collective failed or
    timed out). Fatal to the engine: no step is retried."""


class Executor(Protocol):
    model_config: ModelConfig

    def measure_kv_budget(self, max_model_len: int) -> int:
        """Bytes the KV pool may take on each worker (CUDA only)."""

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate every worker's pool of `num_blocks` blocks (and capture what depends on it)."""

    def execute(self, step: SchedulerOutput, sample_rows: list[int],
                prompt_spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """Run one step; float32 logits of each listed row's last token, then of each prompt span's
        tokens (see `ModelRunner.execute`)."""

    def warm_up(self, num_tokens: int, max_model_len: int) -> None:
        """Fault in the KV pool and run a step of `num_tokens` dummy prompt tokens
        (`ModelRunner.warm_up`) on every worker."""

    def fast_paths(self) -> dict[str, str | None]:
        """The fast paths of the runner that plans the steps (rank 0's): None for each it takes,
        else why not (`ModelRunner.fast_paths`)."""

    def draft_proposer(self):
        """The draft model that proposes drafts (speculative_config's method draft_model: it runs
        beside the model, over the same block tables), or None."""

    def kv_tier(self):
        """The KV tier behind the pool (kv_offload_dir), or None."""

    def transfer_blocks(self, stores: list[tuple[int, bytes]], loads: list[tuple[int, torch.Tensor]]) -> None:
        """Copy blocks to the KV tier, then fill blocks from its payloads (`ModelRunner.transfer_blocks`)."""

    def prefetch_lora(self, adapter) -> Future:
        """Start reading a LoRA adapter into host memory, off the step loop: a future done once it
        is there (its exception: why the adapter cannot be served)."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter from host memory."""

    def check_health(self) -> None:
        """Raise ExecutorFailed if a step can no longer run."""

    def shutdown(self) -> None:
        """Stop the workers (no more steps after this)."""
