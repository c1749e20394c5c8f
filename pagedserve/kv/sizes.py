"""Block and byte arithmetic that the memory manager, the runner, the kernels and the calculators share."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks that `a` tokens take at `b` tokens a block."""
    return -(-a // b)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """Bytes of K and V that one token occupies across all layers: a key and a value vector per KV
    head per layer."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def kv_tokens_kept(num_tokens: int, window: int | None, block_size: int) -> int:
    """Token slots a layer must keep for a request of `num_tokens` tokens: every token under full
    attention (`window` None), a sliding layer its window and the block being written."""
    return num_tokens if window is None else min(num_tokens, window + block_size)
