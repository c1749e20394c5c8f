"""The model runner: owns the KV tensors, turns a step's plan into flat tensors, runs the model."""

from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import allocate_kv_cache
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.kv import BlockCopy
from pagedserve.models.config import ModelConfig


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str, attention_backend: str = "torch") -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_cache(model_config.num_layers, num_blocks, block_size,
                                           model_config.num_kv_heads, model_config.head_dim, dtype, device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, sample_rows: list[int]) -> torch.Tensor:
        """Run one step; return float32 logits [len(sample_rows), vocab] of the last scheduled token
        of each request listed in `sample_rows` (indices into plan.requests; repeats allowed)."""
        self.copy_blocks(plan.block_copies)
        computed = [r.num_computed_tokens for r in plan.requests]
        input_ids: list[int] = []
        for request, start, n in zip(plan.requests, computed, plan.num_new_tokens):
            input_ids += request.all_token_ids[start : start + n]
        md = AttentionMetadata.build(plan.block_tables, computed, plan.num_new_tokens, self.block_size, self.device)
        md.backend = self.attention_backend
        hidden = self.model(torch.tensor(input_ids, device=self.device), md.positions, self.kv_caches, md)
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = md.logits_indices[torch.tensor(sample_rows, device=self.device)]
        return self.model.compute_logits(hidden[rows]).float()

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: give each destination block its source's K/V, in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
