"""`pagedserve bench hybrid`: a model of sliding-window and full layers, with KV cache groups against
the same engine keeping every layer's K/V (`disable_hybrid_kv_cache`: windows only masked).

Three parts, each on a Gemma-3-shaped model (5 sliding layers of window 1,024 to 1 full layer;
random weights, scaled to run on a CPU; built from transformers' config class and saved to a
temporary directory):
- steps: a decode step's time at each context length, by the model runner alone over a pool
  whose blocks hold arbitrary K/V (a decode step's time does not depend on their values; no
  prefill runs), median of `reps`;
- throughput: one KV budget, long prompts and long outputs through the whole engine; groups hold
  more requests at once, so steps batch more of them;
- multi-turn: conversations whose every turn resends the history; the prefix cache's hit rate with
  groups against the uniform pool (a full-attention model of the same shape would hit as the
  uniform pool does).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

WINDOW = 1024
# The throughput part's workload: long outputs, whose decode steps batch as many requests as fit.
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 12, 512, 768
SHAPE = dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
             vocab_size=4096, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2)


def gemma_shaped_checkpoint(directory: Path, num_layers: int = 6, window: int = WINDOW, **shape) -> Path:
    """A random-weight Gemma 3 model whose every 6th layer is full attention, the others sliding."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    dims = SHAPE | shape
    config = Gemma3TextConfig(**dims, num_hidden_layers=num_layers, sliding_window=window, layer_types=layer_types,
                              query_pre_attn_scalar=dims["head_dim"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def step_times(path: str, contexts: list[int], batch: int, reps: int, dtype: str, uniform: bool) -> list[float]:
    """Median seconds of a decode step of `batch` requests at each context, by the runner alone."""
    from pagedserve.config import EngineConfig
    from pagedserve.kv.sizes import cdiv
    from pagedserve.models.loader import load_model
    from pagedserve.worker.model_runner import ModelRunner, StepInputs

    config = EngineConfig(model=path, dtype=dtype, disable_hybrid_kv_cache=uniform)
    model, model_config = load_model(path, config.torch_dtype, "cpu")
    runner = ModelRunner(model, model_config, config)
    bs = config.block_size
    num_blocks = batch * cdiv(max(contexts) + 1, bs) + 1
    runner.allocate_kv_cache(num_blocks)
    runner.capture_decode_graphs(max(contexts) + 1)
    groups = runner.kv_layout.num_groups
    out = []
    for context in contexts:
        width = cdiv(context + 1, bs)
        rows = [[1 + r * width + b for b in range(width)] for r in range(batch)]
        tables = torch.tensor(rows, dtype=torch.int64).expand(groups, batch, width)
        inputs = StepInputs([3] * batch, [context] * batch, [1] * batch, tables, [], list(range(batch)))
        runner.run(inputs)  # warm
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            runner.run(inputs)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def throughput(path: str, uniform: bool, num_requests: int, prompt_len: int, output_len: int,
               kv_bytes: int, dtype: str, tokenizer) -> dict:
    """Output tokens/s of one long-context workload through the engine under one KV budget."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 4000, (prompt_len,), generator=gen).tolist()}
               for _ in range(num_requests)]
    config = EngineConfig(model=path, dtype=dtype, disable_hybrid_kv_cache=uniform, kv_cache_memory_bytes=kv_bytes,
                          max_model_len=prompt_len + output_len, enable_prefix_caching=False,
                          max_num_batched_tokens=512)  # a prompt's chunk holds blocks in every group
    llm = LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = llm.get_metrics()
    return {"seconds": seconds, "output_tps": num_requests * output_len / seconds,
            "total_tps": num_requests * (prompt_len + output_len) / seconds,
            "blocks": metrics["kv_total_blocks"], "preemptions": metrics["preemptions"]}


def multi_turn_hit_rate(path: str, uniform: bool, conversations: int, turns: int, turn_len: int, reply_len: int,
                        dtype: str, tokenizer) -> float:
    """The prefix cache's hit rate over conversations that resend their history each turn."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    config = EngineConfig(model=path, dtype=dtype, disable_hybrid_kv_cache=uniform,
                          max_model_len=turns * (turn_len + reply_len) + 16)
    llm = LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))
    gen = torch.Generator().manual_seed(1)
    histories = [[] for _ in range(conversations)]
    params = SamplingParams(max_tokens=reply_len, temperature=0.0, ignore_eos=True)
    for _ in range(turns):
        for h in histories:
            h += torch.randint(3, 4000, (turn_len,), generator=gen).tolist()
        outs = llm.generate([{"prompt_token_ids": list(h)} for h in histories], params, use_tqdm=False)
        for h, o in zip(histories, outs):
            h += o.outputs[0].token_ids
    return llm.get_metrics()["prefix_cache_hit_rate"]


def run_hybrid_bench(parts: list[str], contexts: list[int], batch: int, reps: int, dtype: str = "float32",
                     tokenizer=None) -> dict:
    from pagedserve.models.loader import load_tokenizer

    tokenizer = tokenizer or load_tokenizer()
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "steps" in parts:
            path = str(gemma_shaped_checkpoint(Path(tmp) / "steps"))
            result["steps"] = {"contexts": contexts, "batch": batch,
                               "grouped": step_times(path, contexts, batch, reps, dtype, False),
                               "uniform": step_times(path, contexts, batch, reps, dtype, True)}
        small = str(gemma_shaped_checkpoint(Path(tmp) / "small", window=256, hidden_size=256, intermediate_size=768,
                                            num_attention_heads=2, head_dim=128))
        if "throughput" in parts:
            # Two requests of the uniform pool (6 layers x 1,280 tokens x K and V of 128 float32s).
            budget = 2 * 6 * (PROMPT_LEN + OUTPUT_LEN) * 2 * 128 * 4 + (1 << 20)
            result["throughput"] = {
                "grouped": throughput(small, False, NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, budget, dtype, tokenizer),
                "uniform": throughput(small, True, NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, budget, dtype, tokenizer),
                "kv_bytes": budget}
        if "multi-turn" in parts:
            result["multi_turn"] = {
                "grouped": multi_turn_hit_rate(small, False, 8, 4, 300, 64, dtype, tokenizer),
                "uniform": multi_turn_hit_rate(small, True, 8, 4, 300, 64, dtype, tokenizer)}
    return result


def format_hybrid(result: dict) -> str:
    lines = []
    if "steps" in result:
        s = result["steps"]
        lines += [f"Decode step of {s['batch']} requests (Gemma-3-shaped, 6 layers, hidden 1152, window {WINDOW}):", "",
                  "| context | step, groups | x at first context | step, uniform |", "|---:|---:|---:|---:|"]
        for c, g, u in zip(s["contexts"], s["grouped"], s["uniform"]):
            lines.append(f"| {c:,} | {g * 1000:.1f} ms | {g / s['grouped'][0]:.2f}x | {u * 1000:.1f} ms |")
        lines.append("")
    if "throughput" in result:
        t = result["throughput"]
        lines += [f"Long-context workload ({NUM_REQUESTS} requests of {PROMPT_LEN:,} + {OUTPUT_LEN:,} tokens, window 256, "
                  f"KV budget {t['kv_bytes'] / 2**20:.1f} MiB):",
                  "", "| layout | blocks | preemptions | seconds | output tok/s | total tok/s |", "|---|---:|---:|---:|---:|---:|"]
        for name in ("grouped", "uniform"):
            r = t[name]
            lines.append(f"| {name} | {r['blocks']} | {r['preemptions']} | {r['seconds']:.1f} | {r['output_tps']:.1f} | "
                         f"{r['total_tps']:.1f} |")
        lines += ["", f"Groups / uniform: {t['uniform']['seconds'] / t['grouped']['seconds']:.2f}x the throughput", ""]
    if "multi_turn" in result:
        m = result["multi_turn"]
        lines.append(f"Multi-turn prefix-cache hit rate: groups {m['grouped']:.1%}, uniform {m['uniform']:.1%}")
    return "\n".join(lines)
