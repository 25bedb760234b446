"""Tests for router.py: the hard-concrete gate, boundary pooling, the Lagrangian, training plumbing.

Convention under test: z = 1 means FULL attention, z = 0 means SPARSE. Run from the repository
root (`python -m pytest tests/test_router.py`); everything is CPU and takes a few seconds.
"""
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from elastic_attention import router
from elastic_attention.model import Routing
from elastic_attention.router import (AttentionRouter, SparsityLagrangian, boundary_pool, build_optimizer, count_gate,
                    deterministic_gate, freeze_backbone, gumbel_softmax_gate, hard_concrete_gate,
                    hard_concrete_sample, omega_msr, prob_full, prob_gradient, prob_nonzero, prob_one,
                    prob_zero)

FAST = settings(max_examples=40, deadline=None)

log_alphas = st.floats(-1e4, 1e4, allow_nan=False, width=32)
uniforms = st.floats(0.0, 1.0, width=32)   # includes 0 and 1: the sampler must clamp them to [ε, 1 − ε]

# -----------------------------------------------------------------------------
# 1. The hard-concrete gate


@FAST
@given(st.lists(st.tuples(log_alphas, log_alphas, uniforms), min_size=1, max_size=64))
def test_sample_in_unit_interval_finite_and_monotone(rows):
    a, b, u = (torch.tensor(c, dtype=torch.float32) for c in zip(*rows))
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    z_lo, z_hi = hard_concrete_sample(lo, u), hard_concrete_sample(hi, u)
    for z in (z_lo, z_hi):
        assert torch.isfinite(z).all(), f"non-finite z̃ {z} for log α {lo}, {hi}, u {u}"
        assert ((z >= 0) & (z <= 1)).all(), f"z̃ out of [0, 1]: {z}"
    worse = z_lo > z_hi
    assert not worse.any(), (f"z̃ not monotone in log α: log α {lo[worse]} -> {z_lo[worse]}, "
                             f"{hi[worse]} -> {z_hi[worse]} (u {u[worse]})")


def test_closed_forms_match_paper_numbers():
    zero = torch.tensor(0.0)
    # METHOD.md §5: at log α = 0 both ends have probability ≈ 0.168, and P(FULL) = ½.
    assert abs(prob_zero(zero).item() - 0.168) < 1e-3, prob_zero(zero).item()
    assert abs(prob_one(zero).item() - 0.168) < 1e-3, prob_one(zero).item()
    assert prob_full(zero).item() == 0.5
    la = torch.linspace(-5, 5, 11)
    torch.testing.assert_close(prob_nonzero(la), 1 - prob_zero(la))


@pytest.mark.parametrize("la", [-3.0, -1.0, 0.0, 0.5, 2.0])
def test_empirical_probabilities_match_closed_forms(la, restore_rng):
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    before = torch.random.get_rng_state()
    log_alpha = torch.full((n,), la)
    z_soft = hard_concrete_sample(log_alpha, generator=gen)
    z = hard_concrete_gate(log_alpha, generator=gen)
    assert torch.equal(torch.random.get_rng_state(), before), "a seeded generator must leave the global RNG alone"
    t = torch.tensor(la)
    for name, hits, p in (("P(z̃=0)", z_soft == 0, prob_zero(t)), ("P(z̃=1)", z_soft == 1, prob_one(t)),
                          ("P(z̃>0)", z_soft > 0, prob_nonzero(t)), ("P(hard=FULL)", z == 1, prob_full(t)),
                          ("P(0<z̃<1)", (z_soft > 0) & (z_soft < 1), prob_gradient(t))):
        emp, p = hits.double().mean().item(), p.item()
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(emp - p) < 5 * sd, f"log α={la}: {name} empirical {emp:.5f} vs closed form {p:.5f} (sd {sd:.5f})"


def test_gradient_passes_exactly_where_the_sample_is_not_clamped():
    """∂z̃/∂log α is nonzero on the draws with 0 < z̃ < 1 and zero on the clamped ones; their share
    is prob_gradient, which all but vanishes for a saturated logit."""
    gen = torch.Generator().manual_seed(7)
    log_alpha = torch.full((20_000,), 2.5, requires_grad=True)
    z_soft = hard_concrete_sample(log_alpha, generator=gen)
    (grad,) = torch.autograd.grad(z_soft.sum(), log_alpha)
    inside = (z_soft > 0) & (z_soft < 1)
    assert inside.any() and (~inside).any()
    assert (grad[inside] > 0).all() and (grad[~inside] == 0).all()
    # Far from 0 the share falls like e^−|log α|·2·sinh(β·log 11): ~1e-4 at 10, ~1e-20 at 47.
    for la in (10.0, -10.0):
        want = math.exp(-abs(la)) * 2 * math.sinh(2 / 3 * math.log(11))
        assert prob_gradient(torch.tensor(la, dtype=torch.float64)).item() == pytest.approx(want, rel=0.01)


def test_gate_convention_one_is_full():
    big = torch.tensor([40.0, -40.0])   # beyond the noise's reach (|logistic noise| <= 13.8)
    for _ in range(3):
        assert hard_concrete_gate(big).tolist() == [1.0, 0.0]
        assert gumbel_softmax_gate(big, tau=1.0).tolist() == [1.0, 0.0]
    assert deterministic_gate(big).tolist() == [1.0, 0.0]


@FAST
@given(st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=1, max_size=32))
def test_eval_gate_deterministic_and_leaves_rng_alone(vals):
    la = torch.tensor(vals)
    before = torch.random.get_rng_state()
    z1, z2 = deterministic_gate(la), deterministic_gate(la)
    assert torch.equal(torch.random.get_rng_state(), before), "deterministic_gate consumed RNG"
    assert torch.equal(z1, z2)
    assert z1.dtype == torch.float32
    assert torch.equal(z1, (la > 0).float()), f"log α {la} -> z {z1}"


@FAST
@given(st.lists(st.tuples(st.floats(-8, 8, width=32), uniforms),
                min_size=1, max_size=64))
def test_straight_through_gradient(rows):
    la_vals, u_vals = zip(*rows)
    u = torch.tensor(u_vals)
    la = torch.tensor(la_vals, requires_grad=True)
    z = hard_concrete_gate(la, u)
    z_soft = hard_concrete_sample(la.detach(), u)
    assert torch.equal(z.detach(), (z_soft > 0.5).float()), f"forward is not the hard decision: {z} vs {z_soft}"
    z.sum().backward()
    inside = (z_soft > 0) & (z_soft < 1)           # 0 < s̄ < 1: not clamped
    assert (la.grad[inside] > 0).all(), f"zero STE gradient where 0 < s̄ < 1: z̃ {z_soft[inside]}, grad {la.grad[inside]}"
    assert (la.grad[~inside] == 0).all(), f"gradient where z̃ is clamped: {la.grad[~inside]}"


def test_gate_noise_must_be_uniforms_of_the_logits_shape():
    """u outside [0, 1] would be clamped into a confident draw, and a (1,) u would give every head
    the same draw: both refused, naming what was wrong."""
    la = torch.zeros(2, 3)
    for u, message in ((torch.full((2, 3), 5.0), "values outside"), (torch.full((2, 3), float("nan")), "or NaN"),
                       (torch.rand(1), r"shape \(2, 3\), got \(1,\)")):
        for gate in (hard_concrete_gate, lambda la, u: gumbel_softmax_gate(la, tau=1.0, u=u)):
            with pytest.raises(ValueError, match=message):
                gate(la, u)

# --- the paper's alternative ------------------------------------------------------------------


@pytest.mark.parametrize("logit,tau", [(-1.5, 1.5), (0.0, 1.0), (0.0, 0.3), (1.0, 1.2)])
def test_gumbel_gate_full_probability_is_sigmoid_for_any_tau(logit, tau, restore_rng):
    n = 200_000
    gen = torch.Generator().manual_seed(7)
    z = gumbel_softmax_gate(torch.full((n,), logit), tau, generator=gen)
    emp, p = (z == 1).double().mean().item(), torch.sigmoid(torch.tensor(logit)).item()
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(emp - p) < 5 * sd, f"logit {logit}, tau {tau}: P(hard=1) {emp:.5f} vs σ(logit) {p:.5f} (sd {sd:.5f})"
    # The authors' single-Gumbel sigmoid would give 1 − exp(−e^logit): at logit 0 that is 0.632, far outside.
    if logit == 0.0:
        assert abs(emp - (1 - math.exp(-1))) > 50 * sd


def test_gumbel_gate_is_two_logit_softmax_and_has_ste_gradient():
    u = torch.tensor([0.2, 0.5, 0.9])
    logit = torch.tensor([0.3, -0.4, 1.0], requires_grad=True)
    z = gumbel_softmax_gate(logit, tau=0.7, u=u)
    # noise log u − log(1 − u) plays g1 − g0; softmax over (logit + g1, g0) gives the same soft value
    g1, g0 = torch.log(u) - torch.log1p(-u), torch.zeros(3)
    soft = torch.softmax(torch.stack([logit.detach() + g1, g0], -1) / 0.7, -1)[:, 0]
    assert torch.equal(z.detach(), (soft > 0.5).float()), f"hard {z} vs two-logit softmax {soft}"
    z.sum().backward()
    assert (logit.grad > 0).all(), logit.grad
    with pytest.raises(ValueError, match="tau"):
        gumbel_softmax_gate(logit, tau=0.0)


@FAST
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 4), st.floats(0.1, 30), st.integers(0, 2 ** 16))
def test_count_gate_deploys_the_expected_number_of_sparse_heads_by_rank(L, B, Hkv, scale, seed):
    """Layer by layer with the carried rounding: each layer makes its lowest-log-α heads SPARSE, and
    over the layers an input gets Σ(1 − σ(log α)) SPARSE heads to within half a head."""
    g = torch.Generator().manual_seed(seed)
    la = torch.randn(L, B, Hkv, generator=g) * scale
    la[0, 0] = 0.0   # ties: the stable ranking still gives a whole count
    debt = torch.zeros(B)
    before = torch.random.get_rng_state()
    z = torch.stack([count_gate(la[i], debt) for i in range(L)])            # (L, B, Hkv)
    assert torch.equal(torch.random.get_rng_state(), before), "count_gate consumed RNG"
    assert set(z.unique().tolist()) <= {0.0, 1.0}
    expected = (1 - torch.sigmoid(la)).sum((0, 2))                          # (B,)
    deployed = (1 - z).sum((0, 2))                                          # (B,)
    assert ((deployed - expected).abs() <= 0.5 + 1e-4).all(), (deployed, expected)
    assert (debt.abs() <= 0.5 + 1e-4).all() and torch.allclose(debt, expected - deployed, atol=1e-4)
    for i in range(L):
        for b in range(B):
            sparse, full = la[i, b][z[i, b] == 0], la[i, b][z[i, b] == 1]
            if len(sparse) and len(full):
                assert sparse.max() <= full.min(), f"layer {i}: SPARSE {sparse} above FULL {full}"


def test_count_gate_matches_threshold_where_the_logits_are_far_from_zero():
    la = torch.tensor([[30.0, -30.0, -25.0], [-30.0, 40.0, 30.0]])          # σ is 0 or 1 to 1e-13
    assert torch.equal(count_gate(la, torch.zeros(2)), deterministic_gate(la))
    with pytest.raises(ValueError, match="debt"):
        count_gate(la, torch.zeros(3))


@pytest.mark.parametrize("gate", [deterministic_gate, hard_concrete_gate,
                                  lambda la: gumbel_softmax_gate(la, tau=1.0),
                                  lambda la: count_gate(la.view(-1, 2), torch.zeros(la.numel() // 2)).view(la.shape)])
def test_gates_refuse_nan_log_alpha(gate):
    """NaN > 0 is False: without the check the evaluation gate would call a NaN router SPARSE and
    the training gates would hand NaN on as z."""
    la = torch.tensor([[0.5, float("nan")], [-1.0, 2.0]])
    with pytest.raises(ValueError, match="NaN"):
        gate(la)
    assert gate(torch.tensor([float("inf"), -float("inf")])).tolist() == [1.0, 0.0]   # ±inf is a decision


@pytest.mark.parametrize("tau", [0.0, -1.0, float("inf"), float("nan"), None])
def test_gumbel_gate_refuses_bad_temperature(tau):
    """τ = inf makes σ((logit + noise)/τ) = ½ exactly, never > ½: every head SPARSE, not P(FULL) = σ(logit)."""
    with pytest.raises(ValueError, match="tau"):
        gumbel_softmax_gate(torch.zeros(4), tau=tau)


def test_temperature_schedule():
    assert router.tau_cosine(0.0) == 1.5
    assert abs(router.tau_cosine(0.3) - 1.25) < 1e-12, router.tau_cosine(0.3)
    assert router.tau_cosine(0.6) == 1.0 and router.tau_cosine(0.9) == 1.0
    with pytest.raises(ValueError, match="progress"):
        router.tau_cosine(1.5)

# -----------------------------------------------------------------------------
# 2. Boundary pooling and the router


def reference_pool(k, lengths, P, skip=0):
    """Plain loop: the positions {skip..skip+P−1} ∪ {L−P..L−1} inside [skip, L), each counted once."""
    out = []
    for b, L in enumerate(lengths.tolist()):
        positions = sorted(set(range(skip, min(skip + P, L))) | set(range(max(skip, L - P), L)))
        out.append(k[b, :, positions].double().mean(1))          # (Hkv, D)
    return torch.stack(out)                                      # (B, Hkv, D)


@st.composite
def keys_and_lengths(draw, P=5):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    S = draw(st.integers(1, 4 * P))
    lengths = torch.tensor(draw(st.lists(st.integers(1, S), min_size=B, max_size=B)))
    seed = draw(st.integers(0, 2 ** 16))
    k = torch.randn(B, Hkv, S, 8, generator=torch.Generator().manual_seed(seed))
    return k, lengths


@FAST
@given(keys_and_lengths())
def test_boundary_pool_matches_explicit_mean(kl):
    k, lengths = kl
    got, want = boundary_pool(k, lengths, 5), reference_pool(k, lengths, 5)
    err = (got.double() - want).abs().max().item()
    assert got.dtype == torch.float32 and err < 1e-5, f"lengths {lengths.tolist()}: max diff {err}"


@FAST
@given(keys_and_lengths(), st.integers(0, 6))
def test_boundary_pool_skips_the_shared_preamble(kl, skip):
    """pool_skip leaves the first `skip` tokens out: the head range starts after them."""
    k, lengths = kl
    if bool((lengths <= skip).any()):
        with pytest.raises(ValueError, match="preamble"):
            boundary_pool(k, lengths, 5, skip)
        return
    got, want = boundary_pool(k, lengths, 5, skip), reference_pool(k, lengths, 5, skip)
    err = (got.double() - want).abs().max().item()
    assert err < 1e-5, f"lengths {lengths.tolist()}, skip {skip}: max diff {err}"


def test_fit_input_norm_standardises_the_pooled_keys():
    """After fitting on pooled keys, those keys reach the MLPs with mean 0 and sd 1 per feature
    (over prompts and heads); before fitting the router sees them unchanged."""
    from elastic_attention.router import fit_input_norm
    g = torch.Generator().manual_seed(0)
    k = 5.0 + 3.0 * torch.randn(16, 3, 12, 8, generator=g)         # a large shared offset, as real keys have
    lengths = torch.full((16,), 12)
    r = AttentionRouter(8, hidden_mult=2, pool_tokens=4)
    pooled = boundary_pool(k, lengths, 4)                              # (16, 3, 8)
    seen = []
    hook = r.task_mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        r(k, lengths)
        assert torch.equal(seen[-1], pooled)
        fit_input_norm(r, pooled)
        r(k, lengths)
    hook.remove()
    x = seen[-1].flatten(0, 1)
    assert x.mean(0).abs().max() < 1e-5 and (x.std(0) - 1).abs().max() < 1e-5
    with pytest.raises(ValueError, match="at least two"):
        fit_input_norm(r, pooled[:1, :1])


def test_fit_whitening_decorrelates_the_count_routers_input():
    """After fit_whitening on (N, C) vectors, those vectors reach the readout centred, with covariance
    R (R + SHRINK·I)⁻¹ in the standardised frame: the correlation matrix's eigenvalues λ become
    λ / (λ + SHRINK), so a direction in which the inputs vary a lot is scaled down the most. Before
    fitting the router sees them unchanged; a zero readout starts every input at init_logit."""
    from elastic_attention.router import CountRouter, fit_whitening
    g = torch.Generator().manual_seed(0)
    C, N = 6, 4000
    mix = torch.randn(C, C, generator=g, dtype=torch.float64)
    x = 3.0 + torch.randn(N, C, generator=g, dtype=torch.float64) @ mix          # correlated, offset
    r = CountRouter(C, init_logit=-0.5)
    seen = []
    hook = r.readout.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().double()))
    with torch.no_grad():
        torch.testing.assert_close(r.logits(x[:5, None].float()), torch.full((5, 1), -0.5))
        assert torch.allclose(seen[-1][:, 0], x[:5], atol=1e-5)
        fit_whitening(r, x.float())
        r.logits(x[:, None].float())
    hook.remove()
    y = seen[-1][:, 0]
    sd = x.std(0)
    corr = torch.corrcoef(x.T)
    want = corr @ torch.linalg.inv(corr + r.SHRINK * torch.eye(C, dtype=torch.float64))
    assert y.mean(0).abs().max() < 1e-3
    torch.testing.assert_close(torch.cov(y.T), want, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="at least two"):
        fit_whitening(r, x[:1].float())


def test_fit_readout_direction_reads_one_probe_direction():
    """fit_readout_direction: after it the count router's log α is gain · s + bias, where s is a
    logistic probe's score of the whitened input, standardised over the calibration inputs (mean 0,
    sd 1), higher for the sensitive ones; only the readout's gain (weight[0]) and bias receive a
    gradient. On two classes that differ along one direction among large nuisance ones, the score
    separates them and ignores the nuisance."""
    from elastic_attention.router import CountRouter, fit_whitening, fit_readout_direction
    g = torch.Generator().manual_seed(0)
    C, N = 8, 600
    sensitive = (torch.arange(N) % 2).double()
    x = 5.0 * torch.randn(N, C, generator=g, dtype=torch.float64)          # nuisance: large, in every direction
    x[:, 3] = x[:, 3] / 5.0 + 4.0 * sensitive                              # the class shows in one small direction
    r = CountRouter(C)
    with torch.no_grad():
        fit_whitening(r, x.float())
        fit_readout_direction(r, x.float(), sensitive, gain=0.7)
        s = r.logits(x[:, None].float())[:, 0].double()
    assert abs(s.mean()) < 1e-4 and abs(s.std() - 0.7) < 1e-3              # gain · (unit-sd, centred score)
    lo, hi = s[sensitive == 0], s[sensitive == 1]
    assert (hi.mean() - lo.mean()) / s.std() > 1.5                          # sensitive scores high
    assert (lo[:, None] < hi[None]).double().mean() > 0.97                  # the per-input AUC
    assert torch.equal(r.whiten[:, 1:], torch.zeros(C, C - 1))              # one column reaches the readout
    r.logits(x[:, None].float()).sum().backward()
    grad = r.readout.weight.grad[0]
    assert grad[0] != 0 and torch.equal(grad[1:], torch.zeros(C - 1)) and r.readout.bias.grad is not None


@FAST
@given(st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=40),
       st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=40), st.floats(0.01, 0.99),
       st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=40))
def test_fail_safe_sends_what_is_not_placed_as_robust_to_the_dense_side(robust, sensitive, at, prompts):
    """fit_fail_safe and fail_safe: `above` lies the fraction `at` of the way from the robust
    calibration prompts' median shift to the sensitive ones', `floor` is the sensitive median.
    Deployed, a prompt at or below `above` keeps its shift; any other gets at least the floor. The
    map never lowers a shift (never sparser) and keeps the prompts' order."""
    from elastic_attention.router import fail_safe, fit_fail_safe
    above, floor = fit_fail_safe(torch.tensor(robust + sensitive),
                                 torch.tensor([0] * len(robust) + [1] * len(sensitive)), at)
    r, s = torch.tensor(robust, dtype=torch.float64), torch.tensor(sensitive, dtype=torch.float64)
    assert floor == float(s.median())
    # between the two medians, the fraction `at` of the way from the robust one
    lo, hi = sorted((float(r.median()), floor))
    assert lo - 1e-9 <= above <= hi + 1e-9
    assert above == pytest.approx(float(r.median()) + at * (floor - float(r.median())), abs=1e-9)
    if len(robust) > 1:   # the point of medians: the robust prompts' tail does not move the threshold
        far = robust[:]
        far[max(range(len(far)), key=far.__getitem__)] = 1e4
        assert fit_fail_safe(torch.tensor(far + sensitive),
                             torch.tensor([0] * len(far) + [1] * len(sensitive)), at) == (above, floor)
    x = torch.tensor(prompts)
    y = fail_safe(x, above, floor)
    placed = x <= above
    assert torch.equal(y[placed], x[placed]) and torch.equal(y[~placed], x[~placed].clamp(min=floor))
    assert (y >= x).all()
    order = x.argsort()
    assert (y[order].diff() >= 0).all()


def test_fit_fail_safe_refuses_what_it_cannot_fit():
    from elastic_attention.router import check_fail_safe, fit_fail_safe
    x, cats = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 1, 1])
    for at in (0.0, 1.0, float("nan"), -0.5):
        with pytest.raises(ValueError, match=f"fail-safe threshold must lie strictly between the medians, "
                                             f"in \\(0, 1\\), got {at}"):
            fit_fail_safe(x, cats, at)
    with pytest.raises(ValueError, match="needs finite shifts of both categories, got \\(3,\\) shifts and 3 sensitive"):
        fit_fail_safe(x, torch.ones(3), 0.1)
    with pytest.raises(ValueError, match="needs finite shifts"):
        fit_fail_safe(torch.tensor([0.0, float("nan"), 1.0]), cats, 0.1)
    assert check_fail_safe(None, "here") is None and check_fail_safe([1.0, 2.0], "here") == (1.0, 2.0)
    for bad in ((1.0,), (1.0, float("inf")), ("1", 2.0), 3.0):
        with pytest.raises(ValueError, match="here: fail_safe must be two finite floats"):
            check_fail_safe(bad, "here")


@FAST
@given(keys_and_lengths())
def test_router_ignores_middle_tokens_and_padding(kl):
    k, lengths = kl
    P = 5
    r = AttentionRouter(8, hidden_mult=2, pool_tokens=P)
    S = k.shape[2]
    pos = torch.arange(S).view(1, 1, S, 1)
    L = lengths.view(-1, 1, 1, 1)
    middle = (pos >= P) & (pos < L - P)       # strictly between the first P and the last P real tokens
    padding = pos >= L
    with torch.no_grad():
        base = r(k, lengths)
        for name, where in (("middle", middle), ("padding", padding)):
            k2 = torch.where(where, 100 * torch.randn_like(k), k)
            out = r(k2, lengths)
            assert torch.equal(out, base), (f"changing {name} tokens (lengths {lengths.tolist()}, S {S}) moved "
                                            f"log α by {(out - base).abs().max().item()}")


@pytest.mark.parametrize("lengths", [[0, 5], [11, 5], [5, -1]])
def test_boundary_pool_refuses_lengths_outside_one_to_s(lengths):
    """Length 0 divided by zero (NaN); a length above S gathered clamped rows, the wrong tokens."""
    with pytest.raises(ValueError, match=r"lengths must be in \[1, S=10\]"):
        boundary_pool(torch.randn(2, 2, 10, 8), torch.tensor(lengths), 3)
    with pytest.raises(ValueError, match="integer tensor"):
        boundary_pool(torch.randn(2, 2, 10, 8), torch.tensor([5.0, 5.0]), 3)


def test_short_sample_uses_each_token_once():
    P, D = 6, 8
    r = AttentionRouter(D, hidden_mult=2, pool_tokens=P)
    k = torch.randn(2, 3, 20, D, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([9, 20])          # 9 < 2P: head [0, 6) and tail [3, 9) overlap
    with torch.no_grad():
        got = r(k, lengths)
        explicit = k[0, :, :9].mean(1)       # (Hkv, D): every real token exactly once
        want = r.router_mlp(r.task_mlp(explicit)).squeeze(-1)
    err = (got[0] - want).abs().max().item()
    assert err < 1e-6, f"short sample: log α {got[0].tolist()} vs explicit mean {want.tolist()} (diff {err})"
    # Sanity: double-counting the overlap [3, 6) would pool a different vector.
    double = torch.cat([k[0, :, :6], k[0, :, 3:9]], 1).mean(1)
    assert (double - explicit).abs().max() > 1e-3


@FAST
@given(st.integers(1, 5), st.integers(0, 2 ** 16))
def test_permuting_heads_permutes_log_alpha(Hkv, seed):
    gen = torch.Generator().manual_seed(seed)
    r = AttentionRouter(8, hidden_mult=2, pool_tokens=4)
    k = torch.randn(2, Hkv, 11, 8, generator=gen)
    perm = torch.randperm(Hkv, generator=gen)
    with torch.no_grad():
        a, b = r(k)[:, perm], r(k[:, perm])
    err = (a - b).abs().max().item()
    assert err < 1e-6, f"perm {perm.tolist()}: max diff {err}"


def test_router_init_is_undecided_but_trainable(restore_rng):
    torch.manual_seed(0)
    r = AttentionRouter(16, pool_tokens=4)
    k = torch.randn(8, 4, 32, 16)
    la = r(k)
    p = torch.sigmoid(la)
    assert la.shape == (8, 4) and la.dtype == torch.float32
    assert ((p > 0.45) & (p < 0.55)).all(), f"initial P(FULL) not near ½: {p.min().item()}..{p.max().item()}"
    la.sum().backward()
    first = r.task_mlp[0].weight.grad
    assert first is not None and first.abs().max() > 0, "no gradient reaches the router's first layer at init"


@pytest.mark.parametrize("init", [-1.5, 2.0])
def test_router_init_logit_sets_the_starting_decisions(init, restore_rng):
    torch.manual_seed(0)
    la = AttentionRouter(16, pool_tokens=4, init_logit=init)(torch.randn(8, 4, 32, 16))
    assert (la - init).abs().max() < 0.1, f"log α {la.min().item()}..{la.max().item()}, want ≈ {init}"
    for bad in (float("nan"), float("inf"), "0", True):
        with pytest.raises(ValueError, match="init_logit must be a finite number"):
            AttentionRouter(16, init_logit=bad)
    static = router.StaticGate(3, init_logit=init)    # one log α per head, whatever the keys
    assert torch.equal(static(torch.randn(2, 3, 5, 16)), torch.full((2, 3), float(init)))


@given(st.floats(0, 1))
def test_log_alpha_for_omega_starts_gates_at_that_sparsity(omega):
    """The trained static gates start here: SPARSE with probability Ω (clipped to [0.01, 0.99])."""
    la = router.log_alpha_for_omega(omega)
    p_sparse = 1 - router.prob_full(torch.tensor(la, dtype=torch.float64)).item()
    assert math.isfinite(la) and abs(p_sparse - min(max(omega, 0.01), 0.99)) < 1e-9, (omega, la, p_sparse)


@pytest.mark.parametrize("bad", [float("nan"), -0.1, 1.5])
def test_log_alpha_for_omega_names_a_bad_omega(bad):
    with pytest.raises(ValueError, match=f"Ω must be in \\[0, 1\\], got {bad}"):
        router.log_alpha_for_omega(bad)


def test_router_computes_in_float32_for_bf16_keys(restore_rng):
    torch.manual_seed(0)
    r = AttentionRouter(8, pool_tokens=3)
    k = torch.randn(2, 2, 10, 8).bfloat16()
    out = r(k)
    ref = r(k.float())
    assert out.dtype == torch.float32
    assert torch.equal(out, ref), f"bf16 keys: {out} vs fp32 of the same keys {ref}"


def test_router_rejects_bad_input():
    r = AttentionRouter(8, pool_tokens=3)
    k = torch.randn(2, 2, 10, 8)
    with pytest.raises(ValueError, match="lengths must be in"):
        r(k, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="lengths must be in"):
        r(k, torch.tensor([11, 5]))
    with pytest.raises(ValueError, match="integer tensor"):
        r(k, torch.tensor([5.0, 5.0]))
    with pytest.raises(ValueError, match="D=8"):
        r(torch.randn(2, 2, 10, 4))
    with pytest.raises(ValueError, match="pool_tokens"):
        AttentionRouter(8, pool_tokens=0)

# -----------------------------------------------------------------------------
# 3. Ω_MSR and the Lagrangian


def test_omega_msr_value_and_gradient():
    zs = [torch.tensor([[1.0, 0.0], [1.0, 1.0]], requires_grad=True),
          torch.tensor([[0.0, 0.0], [1.0, 0.0]], requires_grad=True)]   # L=2 layers of (B=2, Hkv=2)
    om = omega_msr(zs)
    assert om.tolist() == [0.75, 0.25], om
    om[0].backward()
    assert zs[0].grad[0].tolist() == [-0.25, -0.25] and zs[0].grad[1].tolist() == [0.0, 0.0], zs[0].grad
    assert torch.equal(omega_msr(torch.stack(zs).detach()), om.detach())   # (L, B, Hkv) tensor, same answer
    with pytest.raises(ValueError, match="same shape"):
        omega_msr([torch.zeros(2, 2), torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"\(L, B, Hkv\)"):
        omega_msr(torch.zeros(2, 2))


@pytest.mark.parametrize("bad", [-1.0, 2.0, float("nan")])
def test_omega_msr_refuses_gates_outside_unit_interval(bad):
    z = torch.ones(2, 3, 4)
    z[1, 2, 0] = bad
    with pytest.raises(ValueError, match=r"z must be in \[0, 1\]"):
        omega_msr(z)


@FAST
@given(st.lists(st.floats(0, 1, width=32), min_size=1, max_size=8), st.floats(0, 1), st.booleans())
def test_lagrangian_gradients_in_lambda(omegas, target, abs_variant):
    lag = SparsityLagrangian(1, [target], abs_variant=abs_variant)
    omega = torch.tensor(omegas)
    lag(omega, torch.zeros(len(omegas), dtype=torch.long)).backward()
    gap = omega.double() - torch.tensor(target, dtype=torch.float32).double()
    want1 = (gap.abs() if abs_variant else gap).mean().item()
    want2 = (gap ** 2).mean().item()
    g1, g2 = lag.lambda1.grad.item(), lag.lambda2.grad.item()
    assert abs(g1 - want1) < 1e-6 and abs(g2 - want2) < 1e-6, f"dλ1 {g1} vs {want1}, dλ2 {g2} vs {want2}"


def test_lagrangian_averages_per_task_then_over_tasks():
    lag = SparsityLagrangian(3, [router.SENSITIVE_TARGET, router.ROBUST_TARGET, 0.5])
    with torch.no_grad():
        lag.lambda1.copy_(torch.tensor([1.0, 2.0, 5.0]))
        lag.lambda2.copy_(torch.tensor([0.5, 0.0, 5.0]))
    omega = torch.tensor([0.5, 0.6, 0.9, 0.8], requires_grad=True)
    task = torch.tensor([0, 0, 0, 1])                      # task 2 absent: it must not count
    term = lag(omega, task)
    t0 = sum(1.0 * (o - 0.7) + 0.5 * (o - 0.7) ** 2 for o in (0.5, 0.6, 0.9)) / 3
    t1 = 2.0 * (0.8 - 1.0)
    assert abs(term.item() - (t0 + t1) / 2) < 1e-6, f"term {term.item()} vs hand {(t0 + t1) / 2}"
    term.backward()
    # ∂/∂Ω of sample 3 (alone in task 1) = λ1/2; Ω carries gradient to the routers
    assert abs(omega.grad[3].item() - 1.0) < 1e-6, omega.grad
    assert lag.lambda1.grad[2].item() == 0.0


def test_lagrangian_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SparsityLagrangian(2, [0.7, 1.2])
    with pytest.raises(ValueError, match="one target per task"):
        SparsityLagrangian(2, [0.7])
    lag = SparsityLagrangian(2, [0.7, 1.0])
    with pytest.raises(ValueError, match=r"task ids must be in \[0, 2\), got \[2\]"):
        lag(torch.tensor([0.5, 0.5]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="integer"):
        lag(torch.tensor([0.5]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"\(B,\)"):
        lag(torch.tensor([0.5, 0.5]), torch.tensor([0]))
    with pytest.raises(ValueError, match="empty batch"):
        lag(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"task_counts must be \(2,\), got \(1,\)"):   # not broadcast
        lag(torch.tensor([0.5, 0.5]), torch.tensor([0, 1]), torch.tensor([2]))

# -----------------------------------------------------------------------------
# 4. Optimizer, min-max, freezing


@pytest.mark.parametrize("gap_sign", [+1, -1])
def test_one_step_descends_for_routers_and_ascends_for_lambda(gap_sign):
    """build_optimizer's min-max: router parameters step against their gradient, λ1 and λ2 along
    theirs (∂term/∂λ1 = Ω − t, ∂term/∂λ2 = (Ω − t)²), whatever the sign of the gap."""
    r = AttentionRouter(8, pool_tokens=3)
    lag = SparsityLagrangian(1, [0.5])
    opt, _ = build_optimizer(r.parameters(), lag, total_steps=10, warmup_frac=0.0, weight_decay=0.0)
    k = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    omega = torch.full((2,), 0.5 + 0.25 * gap_sign)                     # Ω − t = ±0.25
    with torch.no_grad():
        lag.lambda1.fill_(0.1)                                           # a non-zero gradient into Ω
    (r(k).sum() + lag(omega, torch.zeros(2, dtype=torch.long))).backward()
    before = [p.detach().clone() for p in r.parameters()]
    lam1, lam2 = lag.lambda1.item(), lag.lambda2.item()
    grads = [p.grad.clone() for p in r.parameters()]
    opt.step()
    for p, p0, g in zip(r.parameters(), before, grads):
        moved = (p.detach() - p0)[g != 0]
        assert (moved * g[g != 0] < 0).all(), "a router parameter stepped along its gradient"
    assert math.copysign(1, lag.lambda1.item() - lam1) == gap_sign, (lam1, lag.lambda1.item())
    assert lag.lambda2.item() > lam2, "λ2's gradient (Ω − t)² > 0 must make it grow"


@pytest.mark.parametrize("name", ["router_lr", "lambda_lr"])
@pytest.mark.parametrize("lr", [-1.0, 0.0, float("nan"), float("inf"), "1e-3"])
def test_build_optimizer_refuses_bad_learning_rates(name, lr):
    r = AttentionRouter(8, pool_tokens=3)
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0, got {lr!r}"):
        build_optimizer(r.parameters(), SparsityLagrangian(1, [0.5]), 10, **{name: lr})


def test_build_optimizer_groups_and_schedule():
    r = AttentionRouter(8, pool_tokens=3)
    lag = SparsityLagrangian(2, [0.7, 1.0])
    opt, sched = build_optimizer(r.parameters(), lag, total_steps=100)
    groups = {g["name"]: g for g in opt.param_groups}
    assert (groups["router"]["weight_decay"], groups["router"]["maximize"]) == (0.1, False)
    assert (groups["router_bias"]["weight_decay"], groups["lambda"]["weight_decay"]) == (0.0, 0.0)
    assert groups["lambda"]["maximize"] is True and groups["router"]["betas"] == (0.9, 0.95)
    n_router = sum(len(groups[n]["params"]) for n in ("router", "router_bias"))
    assert n_router == len(list(r.parameters())) and len(groups["lambda"]["params"]) == 2
    lrs = []
    for _ in range(100):
        lrs.append({n: g["lr"] for n, g in groups.items()})
        opt.step()
        sched.step()
    # warm-up over the first 20 steps to the peak (5e-4 / 1e-3), then cosine down to ~0
    assert abs(lrs[0]["router"] - 5e-4 / 21) < 1e-12, lrs[0]
    assert abs(lrs[20]["router"] - 5e-4) < 1e-12 and abs(lrs[20]["lambda"] - 1e-3) < 1e-12, lrs[20]
    assert abs(lrs[60]["router"] - 2.5e-4) < 1e-12, lrs[60]
    assert lrs[99]["router"] < 1e-6, lrs[99]
    peak = [x["router"] for x in lrs]
    assert peak.index(max(peak)) == 20


def test_build_optimizer_constant_lambda_schedule_holds_lambda_at_its_peak():
    """lambda_schedule="constant": λ warms up with the routers, then keeps its peak lr while theirs decays."""
    r = AttentionRouter(8, pool_tokens=3)
    opt, sched = build_optimizer(r.parameters(), SparsityLagrangian(2, [0.7, 1.0]), total_steps=100,
                                 lambda_lr=2e-3, lambda_schedule="constant")
    groups = {g["name"]: g for g in opt.param_groups}
    lrs = []
    for _ in range(100):
        lrs.append({n: g["lr"] for n, g in groups.items()})
        opt.step()
        sched.step()
    assert abs(lrs[0]["lambda"] - 2e-3 / 21) < 1e-12 and abs(lrs[0]["router"] - 5e-4 / 21) < 1e-12, lrs[0]
    assert all(abs(x["lambda"] - 2e-3) < 1e-12 for x in lrs[20:]), [x["lambda"] for x in lrs[20:]]
    assert abs(lrs[60]["router"] - 2.5e-4) < 1e-12 and lrs[99]["router"] < 1e-6, (lrs[60], lrs[99])
    with pytest.raises(ValueError, match="lambda_schedule must be 'cosine' or 'constant', got 'linear'"):
        build_optimizer(r.parameters(), SparsityLagrangian(1, [0.5]), 10, lambda_schedule="linear")


def test_toy_min_max_reaches_target_sparsity():
    """Free logits for 5 layers × 8 heads; an "LM loss" that charges c_h for every sparse head
    (some heads matter more) pulls towards FULL; the Lagrangian with target 0.7 pushes back."""
    gen = torch.Generator().manual_seed(0)
    L, H, B, steps = 5, 8, 32, 300
    logits = nn.Parameter(torch.zeros(L, H))
    cost = torch.linspace(0.5, 1.5, L * H).view(L, H)     # (L, Hkv) how much each head helps the LM
    lag = SparsityLagrangian(1, [router.SENSITIVE_TARGET])
    # Free logits need a much larger lr than an MLP's weights to move within 300 steps.
    opt, sched = build_optimizer([logits], lag, steps, router_lr=0.05, lambda_lr=0.05, weight_decay=0.0)
    train_omega = []
    for _ in range(steps):
        z = hard_concrete_gate(logits.expand(B, L, H), generator=gen)   # (B, L, Hkv)
        om = omega_msr(list(z.transpose(0, 1)))                          # (B,)
        lm = ((1 - z) * cost).mean(dim=(1, 2))                           # (B,)
        loss = lm.mean() + lag(om, torch.zeros(B, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        train_omega.append(om.mean().item())
    final = omega_msr(list(deterministic_gate(logits.detach()).unsqueeze(1))).item()
    late = sum(train_omega[-50:]) / 50
    lam1 = lag.lambda1.item()
    assert abs(final - 0.7) < 0.05, f"eval Ω_MSR {final:.3f}, last-50 train Ω_MSR {late:.3f}, λ1 {lam1:.3f}"
    assert abs(late - 0.7) < 0.06, f"last-50 train Ω_MSR {late:.3f}, eval {final:.3f}"
    assert lam1 < 0, f"λ1 should have turned negative (a reward for sparsity), got {lam1}"
    # the sparse heads should be the cheap ones
    sparse_cost = cost[deterministic_gate(logits.detach()) == 0].mean().item()
    assert sparse_cost < cost.mean().item(), f"mean cost of sparse heads {sparse_cost} vs all {cost.mean().item()}"


class TinyLayer(nn.Module):
    def __init__(self, D):
        super().__init__()
        self.router = AttentionRouter(D, hidden_mult=2, pool_tokens=3)


class TinyModel(nn.Module):
    """A stand-in with the two things freeze_backbone relies on: a backbone, and routers named
    like the model's (layers.{i}.….router.*) and listed by `routers`."""

    def __init__(self, Hkv=2, D=8, n_layers=2):
        super().__init__()
        self.Hkv, self.D = Hkv, D
        self.backbone = nn.Linear(4, Hkv * D)
        self.head = nn.Linear(Hkv * D, 1)
        self.layers = nn.ModuleList(TinyLayer(D) for _ in range(n_layers))

    @property
    def routers(self):
        return [layer.router for layer in self.layers]

    def forward(self, x, gate):
        B, S, _ = x.shape
        k = self.backbone(x).view(B, S, self.Hkv, self.D).transpose(1, 2)    # (B, Hkv, S, D)
        zs = [gate(r(k)) for r in self.routers]                               # L x (B, Hkv)
        z = torch.stack(zs).mean(0)                                           # (B, Hkv)
        feats = (k * z[:, :, None, None]).transpose(1, 2).reshape(B, S, -1)   # (B, S, Hkv·D)
        return self.head(feats).pow(2).mean(), zs


def test_freeze_backbone_trains_only_routers_and_lambdas(restore_rng):
    torch.manual_seed(0)
    model = TinyModel()
    params = freeze_backbone(model)
    assert {id(p) for p in params} == {id(p) for r in model.routers for p in r.parameters()}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." not in n}
    lag = SparsityLagrangian(1, [0.7])
    with torch.no_grad():
        lag.lambda1.fill_(0.3)    # so that λ2's and the routers' gradients are not trivially zero
    opt, sched = build_optimizer(params, lag, total_steps=10, weight_decay=0.1)
    x = torch.randn(3, 10, 4)
    loss, zs = model(x, hard_concrete_gate)
    (loss + lag(omega_msr(zs), torch.zeros(3, dtype=torch.long))).backward()
    for n, p in model.named_parameters():
        if ".router." in n:
            assert p.grad is not None, f"router param {n} got no gradient"
        else:
            assert p.grad is None and not p.requires_grad, f"backbone param {n} is trainable"
    assert any(p.grad.abs().max() > 0 for p in params), "all router gradients are zero"
    assert lag.lambda1.grad is not None and lag.lambda2.grad is not None
    before = [p.detach().clone() for p in params]
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"backbone param {n} changed"
    assert any(not torch.equal(a, b) for a, b in zip(before, params)), "router params did not move"
    with pytest.raises(ValueError, match="routers"):
        freeze_backbone(nn.Linear(2, 2))


# -----------------------------------------------------------------------------
# 5. With the real model (elastic_attention/model.py)


def test_frozen_tiny_transformer_trains_only_routers(restore_rng):
    import elastic_attention as ea
    torch.manual_seed(0)
    cfg = ea.Config.shape("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=64,
                           sink=2, window=8, pool_tokens=4)
    model = ea.Transformer(cfg)
    model.attach_routers()
    params = freeze_backbone(model)
    lag = SparsityLagrangian(2, [router.SENSITIVE_TARGET, router.ROBUST_TARGET])
    opt, _ = build_optimizer(params, lag, total_steps=10)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." not in n}
    idx = torch.randint(0, cfg.vocab_size, (2, 40))
    logits, info = model.train()(idx, lengths=torch.tensor([40, 30]))   # train(): the hard-concrete gate
    lm = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1))
    omega = omega_msr(info["z"])
    torch.testing.assert_close(omega, info["omega_msr"])
    (lm + lag(omega, torch.tensor([0, 1]))).backward()
    for n, p in model.named_parameters():
        if ".router." in n:
            assert p.grad is not None, f"router param {n} got no gradient"
        else:
            assert p.grad is None, f"backbone param {n} got a gradient"
    # every layer's router is reached: through its own gate, and (layer 0) through later layers too
    for i, r in enumerate(model.routers):
        g = r.router_mlp[-1].weight.grad.abs().max().item()
        assert g > 0, f"router {i} last-layer grad is {g}"
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"backbone param {n} changed"


def test_ranked_routers_shift_one_shared_ranking_per_input(tmp_path, restore_rng):
    """attach_routers(ranked=True): every layer's log α is its learned per-head logit plus one shift
    per input, read from layer 0's keys; the shift router and every layer's logits train, the
    backbone does not, the logits get their own optimizer group, and a checkpoint reloads them."""
    import elastic_attention as ea
    torch.manual_seed(0)
    cfg = ea.Config.shape("tiny", n_layers=3, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=64,
                           sink=2, window=8, pool_tokens=4)
    model = ea.Transformer(cfg)
    model.attach_routers(ranked=True, init_logit=-1.0)
    with torch.no_grad():
        for r in model.routers:
            r.log_alpha.normal_()
        model.shift_router.router_mlp[-1].weight.normal_()   # a shift that differs between inputs
    params = freeze_backbone(model)
    rank = [p for r in model.routers for p in r.parameters()]
    assert {id(p) for p in params} == {id(p) for p in rank} | {id(p) for p in model.shift_router.parameters()}
    idx = torch.randint(0, cfg.vocab_size, (2, 40))
    lengths = torch.tensor([40, 30])
    logits, info = model.train()(idx, lengths=lengths)
    offsets = torch.stack([la - r.log_alpha for la, r in zip(info["log_alpha"], model.routers)])  # (L, B, Hkv)
    assert offsets.std(0).max() < 1e-5 and offsets.std(2).max() < 1e-5      # one shift per input
    assert (offsets[0, 0, 0] - offsets[0, 1, 0]).abs() > 1e-3                # that differs between inputs
    first = model.layers[0]
    k0 = first.self_attn.project(first.input_layernorm(model.embed_tokens(idx)), model.rope_cos[:40],
                                 model.rope_sin[:40])[3]      # the keys layer 0 itself computes
    torch.testing.assert_close(offsets[0, :, 0], model.shift_router(k0, lengths).mean(1))
    lag = SparsityLagrangian(2, [router.SENSITIVE_TARGET, router.ROBUST_TARGET])
    opt, _ = build_optimizer([p for p in params if all(p is not q for q in rank)], lag, total_steps=10,
                             rank_params=rank, rank_lr=0.01)
    assert [g["lr"] for g in opt.param_groups if g["name"] == "rank"] == [pytest.approx(0.01 / 3)]  # warm-up
    lm = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1))
    (lm + lag(info["omega_msr"], torch.tensor([0, 1]))).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().max() > 0, f"router param {n} got no gradient"
        else:
            assert p.grad is None, f"backbone param {n} got a gradient"
    ea.save_checkpoint(str(tmp_path / "m.pt"), model.eval())
    loaded, _ = ea.load_checkpoint(str(tmp_path / "m.pt"))
    assert loaded.shift_router is not None
    torch.testing.assert_close(loaded.eval()(idx, lengths=lengths)[1]["z"], model(idx, lengths=lengths)[1]["z"])
    with pytest.raises(ValueError, match="exclude"):
        model.attach_routers(static=True, ranked=True)


def test_balanced_answer_loss_weighs_every_task_alike():
    """Per sample the mean cross-entropy of its answer tokens, per task the mean over its samples,
    then the mean over tasks; shards of a batch (given the whole batch's task counts) add up to it."""
    from elastic_attention.router import balanced_answer_loss
    g = torch.Generator().manual_seed(0)
    B, S, V = 6, 7, 11
    logits = torch.randn(B, S, V, generator=g)
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[torch.rand(B, S, generator=g) < 0.5] = -100
    targets[:, 0] = 3                                                  # every row scores at least one token
    task_ids = torch.tensor([0, 0, 0, 2, 2, 0])                        # task 1 absent from the batch
    counts = torch.bincount(task_ids, minlength=3)
    per_sample = [torch.nn.functional.cross_entropy(logits[b][targets[b] != -100].double(),
                                                    targets[b][targets[b] != -100]) for b in range(B)]
    want = (sum(per_sample[b] for b in (0, 1, 2, 5)) / 4 + (per_sample[3] + per_sample[4]) / 2) / 2
    got = balanced_answer_loss(logits, targets, task_ids, counts)
    assert abs(got.item() - want.item()) < 1e-5
    shards = sum(balanced_answer_loss(logits[r::2], targets[r::2], task_ids[r::2], counts) for r in range(2))
    assert abs(shards.item() - want.item()) < 1e-5
    from elastic_attention.tasks import scored_positions   # as training computes it: the logits at the answer positions alone
    pos, answers = scored_positions(targets)
    at = balanced_answer_loss(logits[torch.arange(B)[:, None], pos], answers, task_ids, counts)
    assert abs(at.item() - want.item()) < 1e-5


@FAST
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 3), st.integers(1, 4), st.integers(0, 2 ** 16))
def test_consistency_penalty_is_the_spread_of_each_task(L, B, Hkv, T, seed):
    """Per input Σ over layers and heads of (σ(log α) − its task's batch mean)², checked by a loop in
    float64; 0 when every input of a task routes alike, and the gradient pulls towards the task's mean."""
    from elastic_attention.router import consistency_penalty
    g = torch.Generator().manual_seed(seed)
    la = (3 * torch.randn(L, B, Hkv, generator=g)).requires_grad_()
    tid = torch.randint(0, T, (B,), generator=g)
    got = consistency_penalty(la, tid, T)
    p = torch.sigmoid(la.detach().double())
    for b in range(B):
        mean = p[:, tid == tid[b]].mean(1)                            # (L, Hkv)
        assert abs(got[b].item() - (p[:, b] - mean).pow(2).sum().item()) < 1e-5
    same = la.detach()[:, :1].expand(L, B, Hkv)                       # every input routed like the first
    assert consistency_penalty(same, tid, T).abs().max() < 1e-10     # the mean of equal numbers, rounded
    got.sum().backward()
    step = p - 1e-3 * la.grad.double() * (p * (1 - p))                # a small descent step in P(FULL) terms
    before = sum(((p[:, tid == t] - p[:, tid == t].mean(1, keepdim=True)) ** 2).sum() for t in tid.unique())
    after = sum(((step[:, tid == t] - step[:, tid == t].mean(1, keepdim=True)) ** 2).sum() for t in tid.unique())
    assert after <= before + 1e-12


@pytest.mark.parametrize("prompt_len", [40, 11, 6])   # long; shorter than skip + 2P; barely past the preamble
def test_prepass_reads_only_the_prompts_boundaries(prompt_len, restore_rng):
    """Config.prepass_layers: the count router reads the residual stream at the last prompt token
    after n layers of a pass over the preamble, the first and the last pool_tokens prompt tokens
    (each token once), run as one short sequence. So its shift equals that of the model run on
    exactly those tokens, does not move when the middle of the prompt or the answer changes, and
    trains; Ω_ESR counts the pre-pass's pairs as work done."""
    import elastic_attention as ea
    torch.manual_seed(0)
    skip, P = 2, 4
    cfg = ea.Config.shape("tiny", n_layers=3, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=64, sink=2, window=8,
                           pool_tokens=P, pool_skip=skip, prepass_layers=2)
    model = ea.Transformer(cfg)
    model.attach_routers(ranked=True, init_logit=-1.0)
    with torch.no_grad():
        model.shift_router.readout.weight.normal_()   # a shift that differs between inputs
    assert model.shift_router.head_dim == cfg.dim
    idx = torch.randint(0, cfg.vocab_size, (2, 48))
    prompt_lengths = torch.tensor([prompt_len, 40])
    read = sorted(set(range(min(skip + P, prompt_len))) | set(range(max(prompt_len - P, skip + P), prompt_len)))
    h, n = model.prepass(idx, prompt_lengths)
    assert n.tolist() == [len(read), skip + 2 * P] and h.shape == (2, cfg.dim)
    # The same residual stream as the model run on the read tokens alone, stopped after 2 layers.
    alone = model.embed_tokens(idx[:1, read])
    for layer in model.layers[:2]:
        alone, _ = layer(alone, model.rope_cos[:len(read)], model.rope_sin[:len(read)], Routing(routed=False))
    torch.testing.assert_close(h[0], alone[0, -1])
    shift = lambda ids: torch.stack(model.eval()(ids, prompt_lengths=prompt_lengths)[1]["log_alpha"])  # (L, B, Hkv)
    changed = idx.clone()
    changed[0, prompt_len:] = (changed[0, prompt_len:] + 1) % cfg.vocab_size          # the answers
    changed[1, 40:] = (changed[1, 40:] + 1) % cfg.vocab_size
    changed[1, skip + P:40 - P] = (changed[1, skip + P:40 - P] + 1) % cfg.vocab_size  # the middle of row 1
    torch.testing.assert_close(shift(changed), shift(idx))
    other = idx.clone()
    other[:, prompt_len - 1] = (other[:, prompt_len - 1] + 1) % cfg.vocab_size        # a read token
    assert (shift(other)[0, 0] - shift(idx)[0, 0]).abs().max() > 1e-4
    full = torch.full((2,), 48)
    torch.testing.assert_close(model.prepass(idx, None)[0], model.prepass(idx, full)[0])  # None: every token
    _, info = model.train()(idx, prompt_lengths=prompt_lengths)
    info["omega_msr"].sum().backward()
    assert model.shift_router.readout.weight.grad.abs().max() > 0
    model.eval()
    modes = torch.full((cfg.n_layers, 2, cfg.n_kv_heads), ea.FULL, dtype=torch.int32)
    plain = model(idx, modes=modes)[1]["omega_esr"]          # no routing, no pre-pass: nothing pruned
    assert torch.equal(plain, torch.zeros(2, dtype=plain.dtype))
    _, info = model(idx, prompt_lengths=prompt_lengths)
    m, S = n.double(), 48
    layers = sum(ea.masks.omega_esr_closed_form(S, mo, cfg.sink, cfg.window) for mo in info["modes"])
    torch.testing.assert_close(info["omega_esr"].double() * cfg.n_layers,
                               layers - cfg.prepass_layers * m * (m + 1) / (S * (S + 1)))
