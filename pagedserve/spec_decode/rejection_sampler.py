"""Verification of sampled requests' drafts by speculative sampling (Leviathan et al. 2023, Chen et
al. 2023), which keeps the target model's distribution exactly.

Request i proposes k_i drafts d_0..d_{k_i-1}, drawn from distributions q_0..q_{k_i-1}; one forward
pass of the target gives p_0..p_{k_i}, p_j conditioned on the drafts before j. Draft d_j is accepted
with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection one token is drawn from
normalize(max(0, p_j - q_j)) and the request stops there; if every draft is accepted a bonus token is
drawn from p_{k_i}. Every emitted token then has exactly the target's distribution given the ones
before it. Drafts chosen deterministically (n-gram or suffix lookup, greedy drafting) have q_j one-hot
at d_j: d_j is accepted with probability p_j(d_j), and a rejection draws from p_j without d_j.

Randomness: request i draws k_i uniforms (the acceptance tests) and then V more (the Exp(1) noise of
an exponential race that draws its last token), in that order, from generators[i] alone, whatever is
accepted. A seeded request is thus reproducible and independent of the rest of the batch, and its
generator's state after the call depends on k_i only. Requests without a seed may share one
generator: each draws in request order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: Tensor | None,
    generators: list[torch.Generator],
) -> list[list[int]]:
    """Per request, its accepted drafts followed by one more token: the token drawn at the first
    rejection, or else the bonus token drawn from its last row (between 1 and k_i + 1 tokens).

    target_probs: [sum(k_i + 1), V], request i's k_i + 1 rows one after another in request order,
        each row a distribution.
    draft_token_ids: per request its k_i drafts (k_i may be 0).
    draft_probs: [sum(k_i), V], the distributions the drafts were drawn from, in the same order;
        None when every draft was chosen deterministically (q one-hot at the draft).
    generators: per request the generator of all its draws, on target_probs' device.
    """
    num_drafts = [len(drafts) for drafts in draft_token_ids]
    _check_inputs(target_probs, draft_token_ids, draft_probs, generators)
    num_requests, vocab_size = len(num_drafts), target_probs.shape[1]
    total_drafts = sum(num_drafts)
    if num_requests == 0:
        return []
    device = target_probs.device

    # Where each request's rows start, and for each draft its request, position and target row.
    target_start, draft_start = [], []
    draft_request, draft_position, draft_target_row = [], [], []
    row = 0
    for i, k in enumerate(num_drafts):
        target_start.append(row)
        draft_start.append(len(draft_request))
        draft_request += [i] * k
        draft_position += range(k)
        draft_target_row += range(row, row + k)
        row += k + 1

    # Each request's draws, from its own generator, fixed by k_i alone: k_i uniforms, then one
    # uniform per token for the Exp(1) noise of the last token's race.
    uniforms, noise = [], torch.empty(num_requests, vocab_size, dtype=torch.float32, device=device)
    for i, (k, generator) in enumerate(zip(num_drafts, generators)):
        uniforms.append(torch.rand(k, generator=generator, device=device))
        noise[i].uniform_(generator=generator)
    # -log(U), U kept at least float32's smallest normal so that no noise is infinite (a token with
    # infinite noise could never win).
    noise.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()

    def as_index(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    num_accepted = torch.zeros(num_requests, dtype=torch.long, device=device)
    flat_ids = as_index([token for drafts in draft_token_ids for token in drafts])
    if total_drafts:
        target_at = target_probs[as_index(draft_target_row), flat_ids]
        draft_at = (torch.ones_like(target_at) if draft_probs is None
                    else draft_probs[torch.arange(total_drafts, device=device), flat_ids].to(target_at.dtype))
        # u < p/q written as u*q < p, with no division; p >= q accepts for certain, whatever
        # rounding does to u*q; p > 0 keeps out a draft the target forbids even where q = 0 too
        # (impossible for a draft drawn from q, but then p >= q would hold).
        accepted = (target_at > 0) & ((target_at >= draft_at) | (torch.cat(uniforms) * draft_at < target_at))
        # One row per request, padded with rejections; the accepted prefix ends at the first one.
        grid = torch.zeros(num_requests, max(num_drafts), dtype=torch.long, device=device)
        grid[as_index(draft_request), as_index(draft_position)] = accepted.long()
        num_accepted = grid.cumprod(dim=1).sum(dim=1)

    # Each request's last token comes from row target_start + num_accepted: the bonus row when
    # everything was accepted, else the rejected position's row, less its draft distribution.
    probs = target_probs[as_index(target_start) + num_accepted]
    if total_drafts:
        rejected = (num_accepted < as_index(num_drafts)).unsqueeze(1)
        rejected_draft = (as_index(draft_start) + num_accepted).clamp_(max=total_drafts - 1)
        if draft_probs is None:
            probs = _without_draft_token_(probs, rejected, flat_ids[rejected_draft].unsqueeze(1))
        else:
            probs = _residual_(probs, rejected, draft_probs[rejected_draft].to(probs.dtype))
    # Exponential race: argmax r / Exp(1) picks token t with probability r(t) / sum(r), so the
    # residual needs no normalising.
    last = probs.div_(noise).argmax(dim=1)

    return [drafts[:n] + [token]
            for drafts, n, token in zip(draft_token_ids, num_accepted.tolist(), last.tolist())]


# Both residual helpers work in place on the gathered rows: the rows are large (a vocabulary each)
# and fresh allocations of that size cost more than the arithmetic.
#
# An all-zero residual means p <= q everywhere, so p == q and the rejection had probability zero:
# only rows that do not quite sum to one get there. Such a row keeps its target distribution.

def _residual_(probs: Tensor, rejected: Tensor, draft_rows: Tensor) -> Tensor:
    """max(0, p - q) on the rejected rows, p on the others; draft_rows is overwritten."""
    residual = torch.sub(probs, draft_rows.mul_(rejected), out=draft_rows).clamp_(min=0)
    return torch.where(residual.sum(dim=1, keepdim=True) == 0, probs, residual, out=residual)


def _without_draft_token_(probs: Tensor, rejected: Tensor, draft_ids: Tensor) -> Tensor:
    """The residual for a one-hot q: p without the draft token, on the rejected rows."""
    at_draft = probs.gather(1, draft_ids)
    probs.scatter_(1, draft_ids, at_draft * ~rejected)
    empty = probs.sum(dim=1, keepdim=True) == 0
    return probs.scatter_(1, draft_ids, at_draft * (~rejected | empty))


def _check_inputs(target_probs: Tensor, draft_token_ids: list[list[int]], draft_probs: Tensor | None,
                  generators: list[torch.Generator]) -> None:
    num_drafts = [len(drafts) for drafts in draft_token_ids]
    if len(generators) != len(num_drafts):
        raise ValueError(f"{len(generators)} generators for {len(num_drafts)} requests")
    rows = sum(num_drafts) + len(num_drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != rows:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected ({rows}, vocab)")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(num_drafts), target_probs.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, "
                         f"expected ({sum(num_drafts)}, {target_probs.shape[1]})")
    vocab_size = target_probs.shape[1]
    if any(not 0 <= token < vocab_size for drafts in draft_token_ids for token in drafts):
        raise ValueError(f"a draft token id is outside the vocabulary [0, {vocab_size})")
