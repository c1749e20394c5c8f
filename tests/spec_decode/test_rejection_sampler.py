import bisect
import itertools
import math
import random

import pytest
import torch

from pagedserve.spec_decode.rejection_sampler import rejection_sample

# Each goodness-of-fit test rejects "the sampler keeps the target distribution" at this level.
ALPHA = 1e-3
TRIALS = 20_000
V = 5


# --- chi-square survival function (scipy is not a dependency) --------------------------------------

def upper_regularized_gamma(s: float, x: float) -> float:
    """Q(s, x) = Gamma(s, x) / Gamma(s): a series for P = 1 - Q below x = s + 1, Lentz's continued
    fraction for Q above (Numerical Recipes, 6.2), each where it converges fast."""
    if x <= 0:
        return 1.0
    log_prefactor = -x + s * math.log(x) - math.lgamma(s)
    if x < s + 1:
        term = total = 1.0 / s
        a = s
        while abs(term) > abs(total) * 1e-16:
            a += 1
            term *= x / a
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = x + 1 - s
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - s)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi_square_sf(statistic: float, df: int) -> float:
    return upper_regularized_gamma(df / 2, statistic / 2)


def chi_square_p_value(counts: dict, expected: dict) -> float:
    """Goodness of fit of several independent histograms at once. counts[key] is a histogram over
    the vocabulary, expected[key] the distribution it should follow; each histogram's own total
    is given (the conditioning), so each contributes (number of possible tokens - 1) degrees of
    freedom. Every expected count must be at least 5, where the chi-square law is a fair
    approximation."""
    statistic, df = 0.0, 0
    for key, observed in counts.items():
        n = sum(observed)
        if n == 0:
            continue
        assert n * min(prob for prob in expected[key] if prob > 0) >= 5, f"too few samples given {key}"
        for seen, prob in zip(observed, expected[key]):
            if prob == 0:
                if seen:
                    return 0.0  # a token the target forbids
                continue
            statistic += (seen - n * prob) ** 2 / (n * prob)
        df += sum(prob > 0 for prob in expected[key]) - 1
    return chi_square_sf(statistic, df)


@pytest.mark.parametrize("x", [0.01, 0.3, 1.0, 2.5, 4.0, 7.7, 15.0, 40.0, 120.0])
def test_chi_square_sf_matches_closed_forms(x):
    half = x / 2
    assert chi_square_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(half)), rel=1e-9, abs=1e-300)
    assert chi_square_sf(x, 2) == pytest.approx(math.exp(-half), rel=1e-9)
    assert chi_square_sf(x, 3) == pytest.approx(
        math.erfc(math.sqrt(half)) + math.sqrt(2 * x / math.pi) * math.exp(-half), rel=1e-9)
    assert chi_square_sf(x, 4) == pytest.approx(math.exp(-half) * (1 + half), rel=1e-9)
    assert chi_square_sf(x, 20) == pytest.approx(
        math.exp(-half) * sum(half ** j / math.factorial(j) for j in range(10)), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("statistic, df, alpha", [
    (3.841, 1, 0.05), (10.828, 1, 0.001), (9.488, 4, 0.05), (18.467, 4, 0.001),
    (31.410, 20, 0.05), (45.315, 20, 0.001), (124.342, 100, 0.05), (149.449, 100, 0.001),
])
def test_chi_square_sf_matches_table_values(statistic, df, alpha):
    # Tables round the critical values to three decimals.
    assert chi_square_sf(statistic, df) == pytest.approx(alpha, rel=2e-3)


# --- the statistical setting: k = 2 drafts over a vocabulary of 5 ---------------------------------

def normalized(weights):
    total = sum(weights)
    return [w / total for w in weights]


P0 = [0.30, 0.10, 0.25, 0.15, 0.20]
# The target's rows after a draft depend on that draft, as they do in a real forward pass.
P1 = [normalized([1 + (x + t) % V for t in range(V)]) for x in range(V)]  # given d0 = x
P2 = [normalized([1 + (2 * y + 3 * t) % V for t in range(V)]) for y in range(V)]  # given d1 = y
Q0 = [0.15, 0.30, 0.20, 0.25, 0.10]
Q1 = [0.10, 0.30, 0.20, 0.15, 0.25]


def draw(dist, n, generator):
    return torch.multinomial(torch.tensor(dist).expand(n, V), 1, replacement=True, generator=generator)[:, 0]


def batch_of_trials(n, with_draft_probs, seed=0):
    """n requests with two drafts each. With draft_probs, the drafts are drawn from Q0 and Q1.
    Without, the sampler treats each draft as chosen deterministically, which is exact for any
    fixed draft, so they may come from anywhere: the first from Q0, the second from the target's
    own row, for acceptance high enough that bonus tokens are frequent."""
    generator = torch.Generator().manual_seed(seed)
    if with_draft_probs:
        d0, d1 = draw(Q0, n, generator), draw(Q1, n, generator)
    else:
        d0 = draw(Q0, n, generator)
        d1 = torch.multinomial(torch.tensor(P1)[d0], 1, generator=generator)[:, 0]
    target = torch.stack([torch.tensor(P0).expand(n, V), torch.tensor(P1)[d0], torch.tensor(P2)[d1]], dim=1)
    drafts = torch.stack([d0, d1], dim=1).tolist()
    draft_probs = torch.stack([torch.tensor(Q0).expand(n, V), torch.tensor(Q1).expand(n, V)], dim=1)
    return target.reshape(3 * n, V), drafts, draft_probs.reshape(2 * n, V) if with_draft_probs else None


def fit_p_values(sample, with_draft_probs):
    """p-values of: the first token follows P0; the second, given the first draft x was accepted,
    follows P1[x]; the third, given both drafts were accepted (the bonus), follows P2[d1]."""
    target, drafts, draft_probs = batch_of_trials(TRIALS, with_draft_probs)
    outputs = sample(target, drafts, draft_probs, [torch.Generator().manual_seed(1)] * TRIALS)
    first = {None: [0] * V}
    second = {x: [0] * V for x in range(V)}
    third = {y: [0] * V for y in range(V)}
    for out in outputs:
        first[None][out[0]] += 1
        if len(out) >= 2:
            second[out[0]][out[1]] += 1
        if len(out) == 3:
            third[out[1]][out[2]] += 1
    return (chi_square_p_value(first, {None: P0}), chi_square_p_value(second, dict(enumerate(P1))),
            chi_square_p_value(third, dict(enumerate(P2))))


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_emitted_tokens_follow_the_target_distribution(with_draft_probs):
    p_first, p_second, p_third = fit_p_values(rejection_sample, with_draft_probs)
    assert p_first > ALPHA
    assert p_second > ALPHA
    assert p_third > ALPHA


# The same verifier in plain Python, with switches that break it, to show the fit test above can fail.

def _categorical(dist, rng):
    cumulative = list(itertools.accumulate(dist))
    return min(bisect.bisect_right(cumulative, rng.random() * cumulative[-1]), len(dist) - 1)


def python_verifier(always_accept=False, resample_from_target=False, bonus_from_last_draft_row=False):
    def sample(target_probs, draft_token_ids, draft_probs, generators):
        rng = random.Random(0)
        p_rows = target_probs.tolist()
        q_rows = draft_probs.tolist() if draft_probs is not None else None
        outputs, row, draft_row = [], 0, 0
        for drafts in draft_token_ids:
            out = []
            for j, d in enumerate(drafts):
                p = p_rows[row + j]
                q = q_rows[draft_row + j] if q_rows else [float(t == d) for t in range(len(p))]
                if always_accept or rng.random() < p[d] / q[d]:
                    out.append(d)
                    continue
                out.append(_categorical(p if resample_from_target else
                                        [max(0.0, a - b) for a, b in zip(p, q)], rng))
                break
            else:
                bonus_row = row + len(drafts) - (1 if bonus_from_last_draft_row and drafts else 0)
                out.append(_categorical(p_rows[bonus_row], rng))
            outputs.append(out)
            row += len(drafts) + 1
            draft_row += len(drafts)
        return outputs
    return sample


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_the_fit_test_has_power(with_draft_probs):
    # Accepting every draft emits the draft distribution.
    assert fit_p_values(python_verifier(always_accept=True), with_draft_probs)[0] < 1e-9
    # Resampling from p instead of the residual after a rejection overweights the drafts.
    assert fit_p_values(python_verifier(resample_from_target=True), with_draft_probs)[0] < 1e-9
    # A bonus token drawn from the wrong row shows in the third token alone (the Python verifier is
    # otherwise right, and passes the first two fits).
    p_first, p_second, p_third = fit_p_values(python_verifier(bonus_from_last_draft_row=True), with_draft_probs)
    assert p_first > ALPHA and p_second > ALPHA and p_third < 1e-9


def test_no_drafts_draws_from_the_first_row():
    n = TRIALS
    outputs = rejection_sample(torch.tensor(P0).expand(n, V).contiguous(), [[] for _ in range(n)], None,
                               [torch.Generator().manual_seed(3)] * n)
    assert all(len(out) == 1 for out in outputs)
    counts = [0] * V
    for (token,) in outputs:
        counts[token] += 1
    assert chi_square_p_value({None: counts}, {None: P0}) > ALPHA


# --- determinism -----------------------------------------------------------------------------------

def random_probs(rows, seed, vocab=V):
    # exp and divide rather than softmax: on a busy two-core machine a tiny softmax's thread team
    # can take milliseconds to gather.
    weights = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).mul_(2).exp_()
    return weights / weights.sum(dim=-1, keepdim=True)


def request(k, seed, vocab=V):
    """One request: its k + 1 target rows, k drafts drawn from its k draft rows."""
    target, q = random_probs(k + 1, seed, vocab), random_probs(k, seed + 1000, vocab)
    drafts = ([] if k == 0 else
              torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed + 2000))[:, 0].tolist())
    return target, drafts, q


def run_batch(requests, seeds, with_draft_probs=True):
    targets, drafts, qs = zip(*requests)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return rejection_sample(torch.cat(targets), list(drafts),
                            torch.cat(qs) if with_draft_probs else None, generators), generators


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_same_seed_same_output_and_batch_neighbours_do_not_matter(with_draft_probs):
    requests = [request(k, seed=10 * i) for i, k in enumerate([3, 0, 8, 1, 5, 2] * 4)]
    seeds = list(range(100, 100 + len(requests)))
    first, _ = run_batch(requests, seeds, with_draft_probs)
    again, _ = run_batch(requests, seeds, with_draft_probs)
    assert first == again
    other_seeds, _ = run_batch(requests, [s + 1 for s in seeds], with_draft_probs)
    assert other_seeds != first
    # Each request alone, or among different neighbours in another order, gives what it gave in the batch.
    for i in range(len(requests)):
        alone, _ = run_batch([requests[i]], [seeds[i]], with_draft_probs)
        assert alone == [first[i]]
    neighbours = [request(4, seed=999)] + requests[::-1]
    reordered, _ = run_batch(neighbours, [7] + seeds[::-1], with_draft_probs)
    assert reordered[1:] == first[::-1]


def test_generator_advances_by_the_number_of_drafts_only():
    k = 4
    everything_accepted = (torch.eye(V)[[0, 1, 2, 3, 4]], [0, 1, 2, 3], None)  # p one-hot at the drafts
    nothing_accepted = (torch.eye(V)[[1, 1, 2, 3, 4]], [0, 1, 2, 3], None)  # p_0(d_0) = 0
    out_all, gens_all = run_batch([everything_accepted], [5], with_draft_probs=False)
    out_none, gens_none = run_batch([nothing_accepted], [5], with_draft_probs=False)
    assert len(out_all[0]) == k + 1 and len(out_none[0]) == 1
    assert torch.equal(gens_all[0].get_state(), gens_none[0].get_state())


# --- edge cases ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_a_draft_the_target_forbids_is_never_accepted(with_draft_probs):
    n, forbidden = 2000, 2
    p = torch.tensor([0.3, 0.3, 0.0, 0.2, 0.2])
    q = torch.tensor([0.02, 0.02, 0.9, 0.03, 0.03])
    target = torch.stack([p, torch.full((V,), 1 / V)]).repeat(n, 1)
    outputs = rejection_sample(target, [[forbidden]] * n, q.expand(n, V).contiguous() if with_draft_probs else None,
                               [torch.Generator().manual_seed(i) for i in range(n)])
    assert all(len(out) == 1 and out[0] != forbidden for out in outputs)
    assert {out[0] for out in outputs} == {0, 1, 3, 4}


def test_drafts_drawn_from_the_target_itself_are_always_accepted():
    requests = [request(k, seed=i) for i, k in enumerate([1, 4, 8, 2] * 50)]
    same = [(target, drafts, target[:-1]) for target, drafts, _ in requests]  # q_j == p_j
    outputs, _ = run_batch(same, range(len(same)))
    for (_, drafts, _), out in zip(same, outputs):
        assert out[:-1] == drafts


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("matching", [0, 1, 3, 4])
def test_one_hot_target_accepts_exactly_the_matching_prefix(matching, with_draft_probs):
    greedy = [4, 1, 1, 0, 3]  # the target's token at positions 0..4 (k = 4)
    drafts = greedy[:matching] + [(t + 1) % V for t in greedy[matching:4]]
    # q puts some mass on every token (a draft's q is never zero) and most on the draft.
    q = torch.full((4, V), 0.05).index_put_((torch.arange(4), torch.tensor(drafts)), torch.tensor(0.8))
    for seed in range(20):
        out = rejection_sample(torch.eye(V)[greedy], [drafts], q if with_draft_probs else None,
                               [torch.Generator().manual_seed(seed)])
        assert out == [greedy[: matching + 1]]


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_rows_that_do_not_sum_to_one_never_yield_a_forbidden_token(with_draft_probs):
    # p <= q everywhere (p sums to 0.5): a rejection leaves an all-zero residual, and the token is
    # drawn from p instead.
    n = 500
    p = torch.tensor([0.0, 0.0, 0.1, 0.4, 0.0]) if with_draft_probs else torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0])
    target = torch.stack([p, torch.full((V,), 1 / V)]).repeat(n, 1)
    outputs = rejection_sample(target, [[2]] * n, q.expand(n, V).contiguous() if with_draft_probs else None,
                               [torch.Generator().manual_seed(i) for i in range(n)])
    rejections = [out for out in outputs if len(out) == 1]
    assert 0 < len(rejections) < n
    assert {token for (token,) in rejections} == ({2, 3} if with_draft_probs else {2})


def test_inputs_are_left_unchanged():
    requests = [request(k, seed=i) for i, k in enumerate([2, 0, 5])]
    targets, drafts, qs = zip(*requests)
    target, q = torch.cat(targets), torch.cat(qs)
    target_before, q_before = target.clone(), q.clone()
    for draft_probs in (q, None):
        rejection_sample(target, list(drafts), draft_probs, [torch.Generator().manual_seed(0)] * 3)
        assert torch.equal(target, target_before) and torch.equal(q, q_before)


def test_empty_batch():
    assert rejection_sample(torch.empty(0, V), [], None, []) == []


@pytest.mark.parametrize("target_rows, drafts, draft_rows, num_generators, message", [
    (3, [[1]], None, 1, "target_probs"),
    (2, [[1]], 2, 1, "draft_probs"),
    (2, [[1]], None, 2, "generators"),
    (2, [[V]], None, 1, "vocabulary"),
    (2, [[-1]], 1, 1, "vocabulary"),
])
def test_inconsistent_inputs_are_refused(target_rows, drafts, draft_rows, num_generators, message):
    with pytest.raises(ValueError, match=message):
        rejection_sample(random_probs(target_rows, 0), drafts,
                         None if draft_rows is None else random_probs(draft_rows, 1),
                         [torch.Generator() for _ in range(num_generators)])
