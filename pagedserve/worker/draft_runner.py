"""The draft model of speculative decoding (method draft_model): a smaller model with the same
tokenizer guesses each request's next k tokens, inside the step, before the model scores them.

Its K/V lives in the same pool: every block id names a slot in the model's caches and in the
draft's (the pool's size counts both), and the draft reads each request's block table as the
model does. Each step, before the model's forward pass:
1. a catch-up pass runs the draft over every scheduled request's known tokens that its cache does
   not hold yet: the step's prompt chunk or decode token, plus what it missed (the last accepted
   draft, or everything after a preemption or a prefix-cache hit);
2. for the requests whose drafts the scheduler reserved (placeholders, `DRAFT_PENDING`), the catch-up's
   last logits give draft 1, and k - 1 single-token passes give the rest, written into the slots
   the step reserved for them, greedy (the verifier treats each draft as certain), each constrained by
   the request's grammar when it has one.
The drafts are written into the plan in place; the model's forward pass then runs them as usual.
The draft's cache is valid up to a request's computed tokens after verification, at most what the
draft itself computed: both only grow by steps, so a request's next catch-up starts at the smaller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.request import Request
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.models.config import ModelConfig
from pagedserve.structured_output.manager import apply_bitmask, load_xgrammar
from pagedserve.worker.block_table_rows import BlockTableRows
from pagedserve.worker.model_runner import ModelRunner, StepInputs

DRAFT_PENDING = -1  # a reserved draft slot, its token not drafted yet


def make_draft_runner(config: EngineConfig, target: ModelConfig) -> DraftRunner | None:
    """The draft model's runner when speculative_config asks for one, else None."""
    spec = config.speculative_config
    return DraftRunner(config, target) if spec is not None and spec.method == "draft_model" else None


class DraftRunner:
    def __init__(self, config: EngineConfig, target: ModelConfig, tokenizer_of=None) -> None:
        """Load the draft named by config.speculative_config. ValueError when its vocabulary is not
        the model's (`tokenizer_of(path)` gives a checkpoint's tokenizer, to compare them)."""
        from pagedserve.models.loader import load_model, load_tokenizer

        spec = config.speculative_config
        tokenizer_of = tokenizer_of or load_tokenizer
        if tokenizer_of(spec.model).get_vocab() != tokenizer_of(config.model).get_vocab():
            raise ValueError(f"speculative_config: the draft model {spec.model!r} does not share the model's "
                             "tokenizer: its drafts would be other tokens")
        # The draft runs whole, in the planning process, whatever the model's tensor parallelism.
        # Its layers keep K/V for every token, in the blocks of the model's first full-attention KV
        # cache group (of its first group, where the model has none: the draft then reads, outside
        # that group's windows, K/V of other tokens, and drafts worse; the model's check keeps the
        # output exact).
        draft_config = dataclasses.replace(config, model=spec.model, tensor_parallel_size=1, speculative_config=None,
                                           quantization=spec.quantization or "auto", disable_hybrid_kv_cache=True)
        windows = target.kv_layout(config.disable_hybrid_kv_cache).windows
        self.group = windows.index(None) if None in windows else 0
        module, self.model_config = load_model(spec.model, draft_config.torch_dtype, draft_config.device,
                                               quantization=draft_config.quantization)
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({self.model_config.vocab_size}) "
                             f"is not the model's ({target.vocab_size})")
        self.runner = ModelRunner(module, self.model_config, draft_config)
        self.tables = BlockTableRows(config.block_size)
        self.block_size = config.block_size
        self._computed: dict[Hashable, int] = {}  # request -> tokens the draft's cache holds

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        return self.model_config.kv_bytes_per_token(kv_dtype)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_decode_graphs(max_model_len)

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Reserve each request's drafts: placeholders, which the next step fills (`fill`)."""
        return [[DRAFT_PENDING] * k for k in num_tokens]

    @torch.inference_mode()
    def fill(self, plan: SchedulerOutput) -> None:
        """Run the draft over the step (see the module docstring) and write its drafts into the plan."""
        for rid in plan.freed:
            self._computed.pop(rid, None)
        if not plan.requests:
            return
        computed = [r.num_computed_tokens for r in plan.requests]
        seq_lens = [c + n for c, n in zip(computed, plan.num_new_tokens)]
        tables = self.tables.update([r.request_id for r in plan.requests],
                                    [per_group[self.group] for per_group in plan.new_block_ids], plan.new_tables,
                                    computed, seq_lens, plan.freed)[None]  # [1 group, requests, blocks]
        self.runner.copy_blocks(plan.block_copies)
        # 1. Catch up on every request's known tokens; the last one's logits draft for the speculating.
        starts, ends, input_ids = [], [], []
        for request, c, n, drafts in zip(plan.requests, computed, plan.num_new_tokens, plan.spec_token_ids):
            # New to the draft (admitted, forked, recomputed): its computed tokens are in blocks that
            # steps filled, which ran the draft over the same tokens (the catch-up covers a step's
            # every known token), so the draft's K/V is there too.
            start = min(self._computed.get(request.request_id, c), c)
            end = c + n - len(drafts)
            starts.append(start)
            ends.append(end)
            input_ids += request.all_token_ids[start:end]
        speculating = [i for i, d in enumerate(plan.spec_token_ids) if d]
        offsets = [0]
        for s, e in zip(starts, ends):
            offsets.append(offsets[-1] + e - s)
        logits = self.runner.run(StepInputs(input_ids, starts, [e - s for s, e in zip(starts, ends)], tables, [],
                                            [offsets[i + 1] - 1 for i in speculating]))
        for request, end in zip(plan.requests, ends):
            self._computed[request.request_id] = end
        if not speculating:
            return
        # 2. Each draft from the logits after the one before, in the slots the step reserved.
        grammars = [plan.requests[i].grammar for i in speculating]
        accepted = [0] * len(speculating)
        try:
            rows = list(range(len(speculating)))
            for j in range(max(len(plan.spec_token_ids[i]) for i in speculating)):
                tokens = self._pick(logits, [grammars[r] for r in rows])
                for r, token in zip(rows, tokens):
                    i = speculating[r]
                    plan.spec_token_ids[i][j] = token
                    if grammars[r] is not None and not grammars[r].is_terminated() and grammars[r].accept_token(token):
                        accepted[r] += 1
                rows = [r for r in rows if len(plan.spec_token_ids[speculating[r]]) > j + 1]
                if not rows:
                    break
                index = [speculating[r] for r in rows]
                positions = [ends[i] + j for i in index]  # where draft j + 1 goes
                logits = self.runner.run(StepInputs([plan.spec_token_ids[i][j] for i in index], positions,
                                                    [1] * len(index), tables[:, torch.tensor(index)], [],
                                                    list(range(len(index)))))
                for i, p in zip(index, positions):
                    self._computed[plan.requests[i].request_id] = p + 1
        finally:
            for grammar, n in zip(grammars, accepted):
                if n:
                    grammar.rollback(n)

    def _pick(self, logits: torch.Tensor, grammars: list) -> list[int]:
        """Each row's most likely token, among those its grammar allows (a finished grammar: any)."""
        constrained = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if constrained:
            xgr = load_xgrammar()
            bitmask = xgr.allocate_token_bitmask(len(constrained), self.model_config.vocab_size)
            for row, i in enumerate(constrained):
                grammars[i].fill_next_token_bitmask(bitmask, row)
            logits = apply_bitmask(logits, torch.tensor(constrained, device=logits.device), bitmask.to(logits.device))
        return logits.argmax(dim=-1).tolist()
