"""The executor of a single-process engine: one model runner, in the core's own process."""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.offload.file_tier import CLOSE_SECONDS
from pagedserve.worker.draft_runner import make_draft_runner
from pagedserve.worker.model_runner import ModelRunner


class UniProcExecutor:
    """One model runner, in this process."""

    def __init__(self, config: EngineConfig, model=None) -> None:
        from pagedserve.models.loader import load_model

        module, self.model_config = model or load_model(config.model, config.torch_dtype, config.device,
                                                        quantization=config.quantization)
        self.runner = ModelRunner(module, self.model_config, config)
        self.draft = make_draft_runner(config, self.model_config)

    def measure_kv_budget(self, max_model_len: int) -> int:
        return self.runner.measure_kv_budget(max_model_len)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_decode_graphs(max_model_len)
        self.runner.open_kv_tier()
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks, max_model_len)

    def execute(self, step: SchedulerOutput, sample_rows: list[int],
                prompt_spans: list[tuple[int, int, int]]) -> torch.Tensor:
        if self.draft is not None:
            self.draft.fill(step)
        return self.runner.execute(step, sample_rows, prompt_spans)

    def warm_up(self, num_tokens: int, max_model_len: int) -> None:
        self.runner.warm_up(num_tokens, max_model_len)

    def fast_paths(self) -> dict[str, str | None]:
        return self.runner.fast_paths

    def draft_proposer(self):
        return self.draft

    def kv_tier(self):
        return self.runner.kv_tier

    def transfer_blocks(self, stores, loads) -> None:
        self.runner.transfer_blocks(stores, loads)

    def prefetch_lora(self, adapter):
        return self.runner.lora.prefetch(adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.lora.remove(lora_int_id)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.runner.lora is not None:
            self.runner.lora.shutdown()
        if self.runner.kv_tier is not None:  # pending blocks are written (a restart finds them), if the disk lets them
            self.runner.kv_tier.close(timeout=CLOSE_SECONDS)
