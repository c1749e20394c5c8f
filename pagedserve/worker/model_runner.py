"""The model runner: owns the KV tensors, turns a step's plan into flat tensors, runs the model.

On CUDA it also sizes the KV pool from the GPU's free memory after a profiling forward pass
(`measure_kv_budget`) and replays decode steps through CUDA graphs (`capture_decode_graphs`).
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass, field

import torch

from pagedserve import heap
from pagedserve.attention import get_backend
from pagedserve.attention.kv_cache import KVCache, allocate_kv_cache, copy_blocks
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import EngineConfig
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.kv import BlockCopy
from pagedserve.kv.sizes import cdiv
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.request import LoRARequest
from pagedserve.models.config import ModelConfig
from pagedserve.models.sharding import kv_heads_per_rank
from pagedserve.offload import transfer
from pagedserve.offload.file_tier import FORMAT_VERSION, FileTier, model_files_identity
from pagedserve.ops import cpu_linear
from pagedserve.worker.block_table_rows import BlockTableRows
from pagedserve.worker.cpu_graphs import CpuDecodeGraph
from pagedserve.worker.cuda_graphs import DecodeGraphs, capture_sizes
from pagedserve.worker import fast_paths


@dataclass
class StepInputs:
    """One step's forward pass as flat arrays: what a tensor-parallel driver sends every rank."""

    input_ids: list[int]                   # the scheduled tokens of every request, one after another
    num_computed: list[int]                # per request: tokens already in its KV blocks
    num_new: list[int]                     # per request: tokens this step runs
    block_tables: torch.Tensor             # [KV cache groups, requests, blocks], int64, padded with 0
    block_copies: list[tuple[int, int]]    # copy-on-write (src, dst) pairs, done before the pass
    logits_rows: list[int]                 # tokens (indices into input_ids) whose logits are wanted
    lora_token_slots: list[int] | None = None  # LoRA: per token its adapter's slot (-1: the base model)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)  # slots to fill first


# The prompts of a warm-up step are at most this long: a chat burst's, not one long document's,
# whose attention would cost more startup time for the same matmul shapes.
WARM_UP_PROMPT_LEN = 512


def kv_budget_from_gpu_memory(total: int, free: int, peak_activation: int, utilization: float) -> int:
    """Bytes the KV pool may take on a GPU of `total` bytes with `free` bytes free now (weights
    loaded; whatever else runs on the GPU counts against us too) and a forward pass whose
    temporaries peaked at `peak_activation` bytes, so that the engine stays within
    `utilization` of the GPU in all."""
    budget = int(total * utilization) - (total - free) - peak_activation
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{total * utilization / 2**30:.2f} GiB, {(total - free) / 2**30:.2f} GiB are in use (weights, other "
            f"processes) and a forward pass needs {peak_activation / 2**30:.2f} GiB more; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig) -> None:
        self.model, self.model_config, self.config = model, model_config, config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches and graph capture use the current device
        if self.device.type == "cpu":
            heap.keep_freed_memory()  # each step's temporaries reuse the last step's pages
        # The pool's buffers (one per layer of a KV cache group: kv/groups.py), and each layer's view
        # of its buffer (with its own fp8 scales).
        self.kv_layout = model_config.kv_layout(config.disable_hybrid_kv_cache)
        self.layer_groups = [g for g, _ in self.kv_layout.layer_places()]  # each layer's group, for every step
        self.kv_caches: list[KVCache] = []
        self.layer_caches: list[KVCache] = []
        # Chosen once; it builds each step's metadata, and the model's attention layers run it.
        self.attention_backend = get_backend(config.attention_backend, self.device, config.kv_torch_dtype)
        self.block_table_rows = [BlockTableRows(self.block_size) for _ in self.kv_layout.groups]
        self.decode_graphs: DecodeGraphs | CpuDecodeGraph | None = None
        # calculate_kv_scales (EngineConfig allows it with fp8 only): the first real step sets every layer's scales.
        self.calibrate_kv_scales = config.calculate_kv_scales
        self._fast_paths: dict[str, str | None] | None = None  # decided with the decode replays
        self.kv_tier: FileTier | None = None  # the KV tier behind the pool (kv_offload_dir)
        # LoRA: the adapters' slots on the model's linear layers. A model that holds another engine's
        # slots runs here with every row on the base model.
        capacity = max(config.max_num_batched_tokens, self.max_decode_rows)
        self.lora = LoRAManager(model, model_config, config, capacity) if config.enable_lora else None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.model_config
        kv_heads = kv_heads_per_rank(c.num_kv_heads, self.config.tensor_parallel_size)  # this rank's
        # One buffer per slot, of its layers' shape (Gemma 4's differ per layer: config.kv_buffer_shapes).
        shapes = c.kv_buffer_shapes(kv_heads, self.config.disable_hybrid_kv_cache)
        self.kv_caches = [cache for h, d in shapes for cache in allocate_kv_cache(
            1, num_blocks, self.block_size, h, d, self.config.kv_torch_dtype, self.device)]
        if self.kv_layout.num_groups == 1:
            self.layer_caches = self.kv_caches
        else:
            self.layer_caches = [KVCache(self.kv_caches[slot].k, self.kv_caches[slot].v,
                                         torch.ones(2, dtype=torch.float32, device=self.device))
                                 for _, slot in self.kv_layout.layer_places()]

    def open_kv_tier(self) -> FileTier | None:
        """The file tier of kv_offload_dir, for this pool's layout (None when it is not set). Its
        namespace names the model's files, the dtypes and the layout, so that no other model or
        format reads its blocks."""
        config, c = self.config, self.model_config
        if config.kv_offload_dir is None:
            return None
        from pagedserve.models.loader import resolve_model_path

        identity = {"format": FORMAT_VERSION, "model": model_files_identity(resolve_model_path(config.model)),
                    "quantization": config.quantization, "dtype": config.dtype,
                    "kv_dtype": str(config.kv_torch_dtype), "block_size": self.block_size,
                    "layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
        if self.kv_layout.num_groups > 1:  # a block's pages hold one group's layers
            identity["kv_groups"] = [[g.window, list(g.layers)] for g in self.kv_layout.groups]
        self.kv_tier = FileTier(config.kv_offload_dir, config.kv_offload_bytes, identity,
                                transfer.block_bytes(self.kv_caches), read_timeout=config.kv_offload_read_timeout)
        return self.kv_tier

    def transfer_blocks(self, stores: list[tuple[int, bytes]], loads: list[tuple[int, torch.Tensor]]) -> None:
        """The KV tier's transfers: copy out the stored blocks, then fill the loaded ones."""
        if stores:
            self.kv_tier.put([h for _, h in stores], transfer.gather_blocks(self.kv_caches, [b for b, _ in stores]))
        if loads:
            transfer.scatter_blocks(self.kv_caches, [b for b, _ in loads], [p for _, p in loads])

    @torch.inference_mode()
    def measure_kv_budget(self, max_model_len: int) -> int:
        """CUDA: run the largest step the scheduler can plan (max_num_batched_tokens tokens, as
        prompts of at most max_model_len, and sampling over max_num_seqs rows of logits) on a
        throwaway cache, and return the bytes the KV pool may take (`kv_budget_from_gpu_memory`).

        The peak is the Triton backend's (the default on CUDA): the torch backend materialises
        [heads, chunk, context] scores for a chunk behind a long prefix, which this step does not
        show. CUDA graphs are captured after the pool is allocated, out of the 1 - utilization share."""
        gc.collect()  # a dropped engine can hold GPU memory until the cycle collector runs
        torch.cuda.empty_cache()
        total_tokens = self.config.max_num_batched_tokens
        lens, tables, num_blocks = self._dummy_prompts(total_tokens, max_model_len)
        self.allocate_kv_cache(num_blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        md = self._metadata(self._every_group(tables), [0] * len(lens), lens)
        hidden = self.model(torch.zeros(total_tokens, dtype=torch.int64, device=self.device), md[0].positions,
                            self.layer_caches, self._per_layer(md))
        logits = self.model.compute_logits(hidden[: min(total_tokens, self.config.max_num_seqs)]).float()
        torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)  # top-p / top-k's temporaries
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden, logits, md
        self.kv_caches = self.layer_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return kv_budget_from_gpu_memory(total, free, peak, self.config.gpu_memory_utilization)

    def capture_decode_graphs(self, max_model_len: int, capture: bool | None = None) -> None:
        """Capture decode graphs when they apply: CUDA, the Triton backend, not enforce_eager.
        capture=False builds the padded buffers and runs them eagerly (tests). On CPU, record the
        decode forward for replay in C instead (`cpu_graphs`), where it can be recorded. Either way
        the runner's `fast_paths` say which were taken."""
        if capture is None:
            kernels = self._cpu_kernel_paths()
            skipped = fast_paths.replay_skipped(self.model_config, self.config, kernels)
            if skipped is None and self.device.type == "cpu":
                groups = self.layer_groups if self.kv_layout.num_groups > 1 else None
                graph = CpuDecodeGraph.attempt(
                    self.model, self.layer_caches, min(self.max_decode_rows, cpu_linear.MAX_ROWS),
                    cdiv(max_model_len, self.block_size), self.block_size, self.attention_backend, groups)
                self.decode_graphs, skipped = (graph, None) if isinstance(graph, CpuDecodeGraph) else (None, graph)
            self._note_fast_paths({fast_paths.DECODE_REPLAY: skipped, **kernels})
            if skipped is not None or self.device.type == "cpu":
                return
            capture = True  # CUDA, the Triton backend, not enforce_eager
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, capture_sizes(self.max_decode_rows), cdiv(max_model_len, self.block_size),
            self.block_size, self.attention_backend, self.device, capture=capture)

    @property
    def max_decode_rows(self) -> int:
        """The most rows a decode step has: one per request, and with speculative decoding one per
        draft too (while requests draft: up to SpeculativeConfig.max_batch of them)."""
        spec, seqs = self.config.speculative_config, self.config.max_num_seqs
        if spec is None:
            return seqs
        return max(seqs, min(seqs, spec.max_batch) * (1 + spec.num_speculative_tokens))

    @property
    def fast_paths(self) -> dict[str, str | None]:
        """Each fast path that applies to this device (fast_paths.py names them): None where this
        runner takes it, else the reason it does not."""
        if self._fast_paths is None:  # no replay was tried (a tensor-parallel rank): say why
            kernels = self._cpu_kernel_paths()
            self._note_fast_paths({fast_paths.DECODE_REPLAY: fast_paths.replay_skipped(
                self.model_config, self.config, kernels) or "decode steps are not replayed here", **kernels})
        return dict(self._fast_paths)

    def _cpu_kernel_paths(self) -> dict[str, str | None]:
        return fast_paths.cpu_kernel_paths(self.model_config, self.config) if self.device.type == "cpu" else {}

    def _note_fast_paths(self, paths: dict[str, str | None]) -> None:
        self._fast_paths = paths
        fast_paths.log_skipped(paths)

    def warm_up(self, num_tokens: int, max_model_len: int) -> None:
        """Before a server's first request: fault in the KV pool, then run a step of `num_tokens`
        dummy prompt tokens (`warm_up_inputs`). On CPU the pool is mapped untouched
        (`hugepages.zeros`), and its blocks are handed out in order, so a server would otherwise
        fault in one 2 MiB page of every layer's K and V at once, each time its requests reach a new
        page: steps stalled 0.35-0.7 s every 5,400 tokens until the pool had been used once (the
        embedded model in bfloat16 on the 2-core test machine). Writing the zeros the pages already
        hold costs 0.6-1.4 s per GiB there, once, before the server reports ready."""
        if self.device.type == "cpu":
            for cache in self.kv_caches:
                cache.k.zero_()
                cache.v.zero_()
        self.run(self.warm_up_inputs(num_tokens, max_model_len))

    def warm_up_inputs(self, num_tokens: int, max_model_len: int) -> StepInputs:
        """A step of `num_tokens` dummy prompt tokens, as prompts of at most WARM_UP_PROMPT_LEN, over
        the pool's first blocks. Run before any request holds a block: it writes only KV that no
        one reads (a block's content counts only once a request has computed into it)."""
        lens, tables, _ = self._dummy_prompts(num_tokens, min(max_model_len, WARM_UP_PROMPT_LEN))
        rows = list(itertools.accumulate(lens))  # each prompt's last token samples, as in a real step
        return StepInputs([0] * num_tokens, [0] * len(lens), lens, self._every_group(tables), [],
                          [r - 1 for r in rows])

    def _every_group(self, tables: torch.Tensor) -> torch.Tensor:
        """[groups, requests, blocks]: the same tables for every group (dummy steps)."""
        return tables.expand(self.kv_layout.num_groups, *tables.shape)

    def _dummy_prompts(self, num_tokens: int, max_len: int) -> tuple[list[int], torch.Tensor, int]:
        """`num_tokens` as prompts of at most `max_len` (their lengths), their block tables over the
        pool's first blocks one after another (padded with 0), and the blocks they take."""
        lens = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
        blocks = [cdiv(n, self.block_size) for n in lens]
        width, first = max(blocks), list(itertools.accumulate(blocks, initial=0))
        tables = torch.tensor([list(range(first[i], first[i + 1])) + [0] * (width - blocks[i])
                               for i in range(len(lens))], dtype=torch.int64)
        return lens, tables, first[-1]

    def _metadata(self, block_tables: torch.Tensor, computed, num_new) -> list[AttentionMetadata]:
        """The step's metadata of each KV cache group, from its tables (`block_tables[g]`)."""
        return [self.attention_backend.build_metadata(tables, computed, num_new, self.block_size, self.device)
                for tables in block_tables]

    def _per_layer(self, mds: list[AttentionMetadata]) -> AttentionMetadata | list[AttentionMetadata]:
        """What the model's forward takes: one metadata for every layer, or each layer its group's."""
        if len(mds) == 1:
            return mds[0]
        return [mds[g] for g in self.layer_groups]

    def execute(self, plan: SchedulerOutput, sample_rows: list[int],
                prompt_spans: list[tuple[int, int, int]] = ()) -> torch.Tensor:
        """Run one step; return float32 logits: first, one row of the last scheduled token of each
        request listed in `sample_rows` (indices into plan.requests; repeats allowed); then, for
        each (row, first, count) of `prompt_spans`, `count` rows: the row's scheduled tokens from
        its `first` on (for prompt logprobs). Only these tokens go through the LM head."""
        if plan.kv_stores or plan.kv_loads:
            self.transfer_blocks(plan.kv_stores, plan.kv_loads)
        return self.run(self.prepare(plan, sample_rows, prompt_spans))

    def prepare(self, plan: SchedulerOutput, sample_rows: list[int],
                prompt_spans: list[tuple[int, int, int]] = ()) -> StepInputs:
        """The step's inputs as flat arrays (host work only; see `execute` for the arguments)."""
        computed = [r.num_computed_tokens for r in plan.requests]
        input_ids: list[int] = []
        for request, start, n, drafts in zip(plan.requests, computed, plan.num_new_tokens, plan.spec_token_ids):
            input_ids += request.all_token_ids[start : start + n - len(drafts)]
            input_ids += drafts  # speculative decoding: the drafts after the known tokens
        seq_lens = [c + n for c, n in zip(computed, plan.num_new_tokens)]
        ids = [r.request_id for r in plan.requests]
        tables = torch.stack([rows.update(ids, [per_group[g] for per_group in plan.new_block_ids], plan.new_tables,
                                          computed, seq_lens, plan.freed)
                              for g, rows in enumerate(self.block_table_rows)])
        starts = list(itertools.accumulate(plan.num_new_tokens, initial=0))  # each request's first token
        num_drafts = [len(d) for d in plan.spec_token_ids] if plan.has_drafts else [0] * len(plan.requests)
        # A sampling request's last token gives logits, and so does each of its drafts.
        rows = [starts[i + 1] - 1 - num_drafts[i] + j for i in sample_rows for j in range(num_drafts[i] + 1)]
        rows += [starts[row] + first + k for row, first, count in prompt_spans for k in range(count)]
        num_new = list(plan.num_new_tokens)
        token_slots = None
        if plan.lora_slots and any(s >= 0 for s in plan.lora_slots):
            token_slots = [slot for slot, n in zip(plan.lora_slots, num_new) for _ in range(n)]
        if plan.has_drafts:
            computed, num_new, tables = self._draft_rows(computed, num_new, num_drafts, tables)
        return StepInputs(input_ids, computed, num_new, tables, list(plan.block_copies), rows, token_slots,
                          list(plan.lora_loads))

    @staticmethod
    def _draft_rows(computed: list[int], num_new: list[int], num_drafts: list[int],
                    tables: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """A speculative request's 1 + k tokens as 1 + k decode rows over its one block table, row j
        at position computed + j: each attends to the rows before it (every row's K/V is written
        before any row's attention reads), so the step is a decode step, computed as decode steps
        are (the decode replays included), whose logits are those of k + 1 steps one after another."""
        rows_computed, rows_new, index = [], [], []
        for i, (c, n, k) in enumerate(zip(computed, num_new, num_drafts)):
            if k == 0:
                rows_computed.append(c)
                rows_new.append(n)
                index.append(i)
            else:
                assert n == k + 1, "drafts follow a decode's one known token"
                rows_computed += range(c, c + n)
                rows_new += [1] * n
                index += [i] * n
        return rows_computed, rows_new, tables[:, torch.tensor(index)]

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The forward pass of a prepared step: float32 logits of `inputs.logits_rows` (None on
        a tensor-parallel rank other than 0, which computes its share of them only)."""
        self.copy_blocks(inputs.block_copies)
        if self.lora is not None:
            self.lora.activate(inputs.lora_loads)
        lora_batch = getattr(self.model, "lora_batch", None)
        if lora_batch is not None:
            lora_batch.set(inputs.lora_token_slots or [-1] * len(inputs.input_ids))
        mds = self._metadata(inputs.block_tables, inputs.num_computed, inputs.num_new)
        md = mds[0]
        ids = torch.tensor(inputs.input_ids, device=self.device)
        graph_md = mds if len(mds) > 1 else md  # (CUDA graphs: one group only)
        if self.decode_graphs is not None and not self.calibrate_kv_scales and self.decode_graphs.can_run(graph_md):
            hidden = self.decode_graphs.run(ids, graph_md)
        else:
            for group_md in mds:
                group_md.calculate_kv_scales = self.calibrate_kv_scales
            hidden = self.model(ids, md.positions, self.layer_caches, self._per_layer(mds))
            self.calibrate_kv_scales = False  # only once a pass has set every layer's scales
        if not inputs.logits_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        logits = self.model.compute_logits(hidden[torch.tensor(inputs.logits_rows, device=self.device)])
        return None if logits is None else logits.float()

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: give each destination block its source's K/V, in every layer."""
        copy_blocks(self.kv_caches, copies)
