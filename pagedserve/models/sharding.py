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

from pagedserve.kv.sizes import cdiv
from pagedserve.models.config import ModelConfig


def accepted_tp_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size this model can be split into (up to its number of heads)."""
    return [n for n in range(1, config.num_heads + 1) if _split_error(config, n) is None]


def check_tp_size(config: ModelConfig, size: int) -> None:
    """ValueError naming the sizes this model accepts, unless `size` is one of them."""
    reason = _split_error(config, size)
    if reason is not None:
        accepted = ", ".join(map(str, accepted_tp_sizes(config)))
        raise ValueError(f"tensor_parallel_size={size} does not split this model: {reason}; "
                         f"it accepts {accepted}")


def _split_error(config: ModelConfig, n: int) -> str | None:
    # The integer rule lives in kv_calc (no torch there), so `pagedserve kv-calc` accepts the same sizes.
    from pagedserve.entrypoints.kv_calc import tp_split_error

    return tp_split_error(config.num_heads, config.num_kv_heads, config.intermediate_size, n)


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
        kv_heads = max(1, config.num_kv_heads // size)
        replicas = max(1, size // config.num_kv_heads)  # ranks that share one KV head
        vocab_rows = cdiv(config.vocab_size, size)
        return cls(rank, size, config.num_heads // size, kv_heads, rank // replicas * kv_heads,
                   config.intermediate_size // size, rank * vocab_rows, vocab_rows)

    def real_vocab_rows(self, vocab_size: int) -> int:
        """Rows of this rank's vocabulary slice that hold real tokens (the last rank's may be short)."""
        return max(0, min(self.vocab_rows, vocab_size - self.vocab_start))


def kv_heads_per_rank(config: ModelConfig, tp_size: int) -> int:
    """KV heads each rank's pool holds at this tensor-parallel size."""
    return TPShard.of(config, 0, tp_size).num_kv_heads
