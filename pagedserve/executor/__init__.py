"""Executors: how the engine core runs a step on its workers (see `base.Executor`)."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.executor.base import Executor


def make_executor(config: EngineConfig, model=None) -> Executor:
    """The executor config asks for: one runner here, or tensor_parallel_size ranks."""
    if config.tensor_parallel_size == 1:
        from pagedserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model)
    if model is not None:
        raise ValueError("a loaded model cannot be shared with a tensor-parallel engine: each rank loads its shard")
    from pagedserve.executor.tensor_parallel import TensorParallelExecutor  # torch.distributed: only when asked for

    return TensorParallelExecutor(config)
