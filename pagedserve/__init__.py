"""pagedserve: an LLM inference and serving engine built on PagedAttention."""

__version__ = "0.1.0"
