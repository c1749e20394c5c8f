"""Write a GGUF of a Llama-family Hugging Face directory, laid out as llama.cpp's converter
(convert_hf_to_gguf.py) writes one, with weights quantized by gguf-py's own quantizers:

    .venv/bin/python scripts/make_gguf.py /work/llama-1b /work/llama-1b-q8_0.gguf --gguf-type Q8_0
    .venv/bin/python scripts/make_gguf.py /work/llama-1b /work/llama-1b-q4_0.gguf --gguf-type Q4_0
    .venv/bin/pagedserve generate --model /work/llama-1b-q4_0.gguf ...

scripts/make_random_model.py calls this for its `--gguf-type` (a random model and its GGUF in one go).
For Llama-3.2-1B's shape (make_random_model.py's default) the Q8_0 file is 1.14 GB and the Q4_0 file
0.61 GB, each written in about 40 s on a 2-core machine, holding at most 3.7 GB of memory.

What the file holds:
- llama architecture metadata (block count, context length, widths, heads, rope base and dimension,
  RMS-norm epsilon, file type, quantization version);
- the tokenizer as llama.cpp's converter writes a byte-level BPE one: model "gpt2", the
  pre-tokenizer name llama.cpp knows it by (found, as llama.cpp finds it, from a hash of the
  tokenizer's encoding of a check text), tokens and their types, merges, special token ids, the
  chat template (gguf-py's SpecialVocab);
- the weights: norms in F32, every other matrix (token embedding included) in `--gguf-type`; a
  matrix whose rows do not divide into the type's blocks falls back to F16, as llama.cpp's converter
  does. q_proj / k_proj rows are permuted as llama.cpp expects (transformers undoes the permutation
  when it reads a GGUF). A tied model gets no output.weight: llama.cpp reads the embedding then.

Only plain Llama checkpoints are converted (no biases, default rope); anything else is refused with
the reason, never written wrong.
"""

from __future__ import annotations

import argparse
import json
import time
from hashlib import sha256
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType, TokenType

GGUF_TYPES = {
    "F32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}

# llama.cpp names a BPE pre-tokenizer by the SHA-256 of the token ids its tokenizer gives this text
# (convert_hf_to_gguf.py, get_vocab_base_pre). Only the tokenizers this project's models use are listed.
_PRE_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
_KNOWN_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
}


def permute_rotary_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for q_proj / k_proj: within each head, the two rotary halves
    interleaved (row i of the first half, then row i of the second), since llama.cpp rotates
    adjacent pairs where transformers rotates halves."""
    head_dim = weights.shape[0] // n_head
    return (weights.reshape(n_head, 2, head_dim // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def tensor_type(array: np.ndarray, wanted: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type a tensor is stored in: vectors (norms) in F32; matrices in `wanted`, or F16 where
    their rows do not divide into `wanted`'s blocks."""
    if array.ndim <= 1:
        return GGMLQuantizationType.F32
    block_size, _ = gguf.GGML_QUANT_SIZES[wanted]
    if array.shape[-1] % block_size:
        return GGMLQuantizationType.F16
    return wanted


def vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[TokenType], str]:
    """Tokens, their types and the pre-tokenizer name, as llama.cpp's converter makes them for a
    byte-level BPE tokenizer (get_vocab_base): ids the tokenizer lacks become unused [PAD<i>]
    tokens; added tokens are CONTROL when special, else USER_DEFINED."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check = sha256(str(tokenizer.encode(_PRE_CHECK_TEXT)).encode()).hexdigest()
    if check not in _KNOWN_PRE_TOKENIZERS:
        raise ValueError(f"{model_dir}: llama.cpp's name for this tokenizer's pre-tokenizer is not known here "
                         f"(check hash {check}); add it from convert_hf_to_gguf.py's get_vocab_base_pre")
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[TokenType] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            looks_special = by_id[i].startswith("<|") and by_id[i].endswith("|>")
            types.append(TokenType.CONTROL if added[i].special or looks_special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return tokens, types, _KNOWN_PRE_TOKENIZERS[check]


def _checked_config(model_dir: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    refuse = []
    if config.model_type != "llama":
        refuse.append(f"model_type {config.model_type!r} (only llama)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        refuse.append("biases")
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    if rope.get("rope_type", "default") != "default":
        refuse.append(f"rope type {rope['rope_type']!r} (only default)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        refuse.append("a head_dim other than hidden_size / num_attention_heads")
    if refuse:
        raise ValueError(f"{model_dir}: cannot write a GGUF of this checkpoint: {', '.join(refuse)}")
    return config, float(rope["rope_theta"]), head_dim


def _source_tensors(model_dir: Path):
    """(name, float32 array) for every tensor of the directory's safetensors, one at a time."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float().numpy()


def write_gguf(model_dir: str | Path, out: str | Path, gguf_type: str = "Q8_0") -> dict[str, int]:
    """Write `model_dir` (a Llama-family HF directory) as the GGUF `out`, its matrices in
    `gguf_type`. Returns how many tensors went into each type."""
    model_dir, out = Path(model_dir), Path(out)
    wanted, file_type = GGUF_TYPES[gguf_type]
    config, rope_theta, head_dim = _checked_config(model_dir)
    n_layers = config.num_hidden_layers

    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_dir.name)
    writer.add_block_count(n_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(file_type)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)

    tokens, types, pre = vocab(model_dir, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text()) \
        if (model_dir / "tokenizer_config.json").is_file() else {}
    if "add_prefix_space" in tokenizer_config:
        writer.add_add_space_prefix(tokenizer_config["add_prefix_space"])
    if config.vocab_size == 49152:  # llama.cpp's converter adds no BOS for this vocabulary (SmolLM's, Granite's)
        writer.add_add_bos_token(False)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    counts: dict[str, int] = {}
    for hf_name, array in _source_tensors(model_dir):
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: llama.cpp reads token_embd.weight for the head
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))  # keeps the suffix
        if name is None:
            raise ValueError(f"{model_dir}: no GGUF name for tensor {hf_name!r}")
        if hf_name.endswith("q_proj.weight"):
            array = permute_rotary_rows(array, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = permute_rotary_rows(array, config.num_key_value_heads)
        qtype = tensor_type(array, wanted)
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir",
                        help="a Llama-family Hugging Face directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--gguf-type", default="Q8_0", choices=list(GGUF_TYPES), help="the matrices' type")
    args = parser.parse_args()
    start = time.perf_counter()
    counts = write_gguf(args.model_dir, args.out, args.gguf_type)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {size / 1e6:.1f} MB, tensors {counts}, in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
