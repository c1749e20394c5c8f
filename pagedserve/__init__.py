"""pagedserve: an LLM inference and serving engine built on PagedAttention."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name: str):
    # Lazy, so that `import pagedserve.kv` (pure Python) does not pull in torch.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from pagedserve.sampling_params import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from pagedserve.lora.request import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
