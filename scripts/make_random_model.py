"""Write a Hugging Face model directory with random weights in the shape of a real model, and the
embedded model's tokenizer, for benchmarks at the sizes CPU users run, and optionally GGUFs of the
same weights (scripts/make_gguf.py):

    .venv/bin/python scripts/make_random_model.py /tmp/llama-1b            # Llama-3.2-1B's shape
    .venv/bin/pagedserve bench throughput --model /tmp/llama-1b --dtype bfloat16 \\
        --vllm-python /work/vllm-venv/bin/python --systems pagedserve,vllm
    .venv/bin/python scripts/make_random_model.py /tmp/tiny --shape tiny --gguf-type Q8_0 --gguf-type Q4_0
        # also writes /tmp/tiny-q8_0.gguf and /tmp/tiny-q4_0.gguf

`--shape tiny` is for tests: two layers of width 64, untied embeddings (so a GGUF of it holds an
output.weight too).

The vocabulary is the tokenizer's (49,152 tokens), not the original's: every system reads token ids
from the same tokenizer. Weights are drawn as transformers initialises a Llama (normal, std 0.02),
from a fixed seed, so two runs write the same model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# Layer shapes of the models the benchmarks stand in for, and a tiny one for tests.
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False),
}


def write_random_model(out: str, shape: str, dtype: str = "bfloat16", seed: int = 0) -> int:
    """Write the model directory; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.models.loader import load_tokenizer

    tokenizer = load_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=8192, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **SHAPES[shape])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    from make_gguf import GGUF_TYPES, write_gguf  # scripts/ is on sys.path when this runs as a script

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf-type", action="append", default=[], choices=list(GGUF_TYPES),
                        help="also write <out>-<type>.gguf of the same weights (repeatable)")
    args = parser.parse_args()

    params = write_random_model(args.out, args.shape, args.dtype, args.seed)
    print(f"wrote {args.out}: {args.shape}, {params / 1e9:.2f}B parameters in {args.dtype}")
    for gguf_type in args.gguf_type:
        # Beside the directory, not in it: transformers, reading a GGUF's tokenizer from a folder that also
        # holds a Hugging Face tokenizer, loses the GGUF's chat template.
        path = Path(f"{Path(args.out).resolve()}-{gguf_type.lower()}.gguf")
        counts = write_gguf(args.out, path, gguf_type)
        print(f"wrote {path}: {path.stat().st_size / 1e6:.1f} MB, tensors {counts}")


if __name__ == "__main__":
    main()
