"""Megatron-style tensor parallelism: which slice of each weight, and which heads, a rank holds.

Over N ranks, rank r holds:
- attention: q heads [r * H/N, (r+1) * H/N) and their KV heads. With N <= KV heads each rank holds
  KV/N of them; with N > KV heads, N/KV ranks share one KV head and each keeps a copy (vLLM's
  replication), so every rank's q heads still find their KV head locally;
- q/k/v and gate/up: column-parallel (rows of the [out, in] weight); o_proj and down_proj:
  row-parallel (columns), their partial sums all-reduced;
- the embedding and LM head: vocab-parallel, the vocabulary padded to a multiple of N;
- norms and biases of row-parallel layers: whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.kv.sizes import cdiv

if TYPE_CHECKING:  # no torch at import: `pagedserve kv-calc` checks sizes with these rules too
    from pagedserve.models.config import ModelConfig


def split_error(num_heads: int, num_kv_heads: int, intermediate_size: int | None, n: int) -> str | None:
    """Why `n` ranks cannot split a model of this shape, or None when they can."""
    if n < 1:
        return "it must be >= 1"
    if num_heads % n:
        return f"its {num_heads} attention heads are not a multiple of {n}"
    if num_kv_heads % n and n % num_kv_heads:
        return f"its {num_kv_heads} KV heads neither divide into {n} parts nor into {n} copies"
    if intermediate_size is not None and intermediate_size % n:
        return f"its MLP width {intermediate_size} is not a multiple of {n}"
    return None


def accepted_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int | None) -> list[int]:
    """Every tensor-parallel size a model of this shape can be split into (up to its heads)."""
    return [n for n in range(1, num_heads + 1) if split_error(num_heads, num_kv_heads, intermediate_size, n) is None]


def check_split(num_heads: int, num_kv_heads: int, intermediate_size: int | None, n: int) -> None:
    """ValueError naming the sizes this shape accepts, unless `n` is one of them."""
    reason = split_error(num_heads, num_kv_heads, intermediate_size, n)
    if reason is not None:
        accepted = ", ".join(map(str, accepted_sizes(num_heads, num_kv_heads, intermediate_size)))
        raise ValueError(f"tensor_parallel_size={n} does not split this model: {reason}; it accepts {accepted}")


def accepted_tp_sizes(config: ModelConfig) -> list[int]:
    return accepted_sizes(config.num_heads, config.num_kv_heads, config.intermediate_size)


def check_tp_size(config: ModelConfig, size: int) -> None:
    check_split(config.num_heads, config.num_kv_heads, config.intermediate_size, size)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank's pool holds: a share of them, or one (a copy) when ranks outnumber them."""
    return max(1, num_kv_heads // tp_size)


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `size` holds of a model."""

    rank: int
    size: int
    num_heads: int          # q heads on this rank
    num_kv_heads: int       # KV heads on this rank (replicated when size > the model's KV heads)
    kv_head_start: int      # the first of them, in the model's numbering
    intermediate_size: int  # the MLP width on this rank
    vocab_start: int        # this rank's rows of the embedding and LM head
    vocab_rows: int         # padded: the same on every rank; rows past the vocabulary stay zero

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> TPShard:
        check_tp_size(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a tensor-parallel group of {size}")
        kv_heads = kv_heads_per_rank(config.num_kv_heads, size)
        replicas = max(1, size // config.num_kv_heads)  # ranks that share one KV head
        vocab_rows = cdiv(config.vocab_size, size)
        return cls(rank, size, config.num_heads // size, kv_heads, rank // replicas * kv_heads,
                   config.intermediate_size // size, rank * vocab_rows, vocab_rows)

    def real_vocab_rows(self, vocab_size: int) -> int:
        """Rows of this rank's vocabulary slice that hold real tokens (the last rank's may be short)."""
        return max(0, min(self.vocab_rows, vocab_size - self.vocab_start))

