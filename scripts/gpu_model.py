"""A stand-in for the embedded model on a machine that cannot hold it (the GPU machine: its
package is not installed there, and the 94 MiB GGUF is more than a device call may carry).

    python scripts/gpu_model.py skeleton DIR   # here: the embedded model's config and tokenizer (~4 MB)
    python scripts/gpu_model.py weights DIR    # there: seeded random weights of that shape, safetensors

DIR is then an ordinary Hugging Face directory that pagedserve (`--model DIR`) and transformers
both load, so the GPU checks compare the two on identical weights. Random weights make text
nonsense but the comparison exact; the output layer is scaled up so that greedy picks are decided
by clear margins rather than by the last bits of near-equal logits.
"""

from __future__ import annotations

import argparse

import torch

OUTPUT_SCALE = 8.0  # logit spread of a few units, as a trained model has, not a few hundredths


def skeleton(out: str) -> None:
    from pagedserve.bench.throughput import load_hf_reference
    from pagedserve.models.loader import load_tokenizer

    config = load_hf_reference().config
    del config.quantization_config  # the GGUF's; the weights written on the GPU side are plain
    config.save_pretrained(out)
    load_tokenizer().save_pretrained(out)
    print(f"wrote the config and tokenizer of the embedded model to {out}")


def weights(out: str, seed: int = 0) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(OUTPUT_SCALE)  # tied: the input embedding too
    model.save_pretrained(out, safe_serialization=True)
    print(f"wrote seeded random weights ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M) to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["skeleton", "weights"])
    parser.add_argument("dir")
    args = parser.parse_args()
    (skeleton if args.step == "skeleton" else weights)(args.dir)
