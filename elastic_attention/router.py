"""router.py — the Attention Router: which KV heads stay full, per input (METHOD.md §4–§6).

Read top to bottom, this file follows the paper's Section 3 and Appendix F:

    1. the gate       a router logit log α per (sample, KV head) -> a hard 0/1 decision that still
                      passes a gradient (hard-concrete, Louizos et al. 2018; the paper's
                      Gumbel-sigmoid with a temperature schedule as the alternative)
    2. the router     boundary-pooled pre-RoPE keys -> task MLP -> router MLP -> log α  (§4)
    3. the objective  Ω_MSR and the per-task Lagrangian λ1·(Ω − t) + λ2·(Ω − t)²    (§6)
    4. training       freeze the backbone, AdamW with a maximising λ group, cosine schedule

Convention (tested): z = 1 means FULL attention (a retrieval head), z = 0 means SPARSE.
A model's training step mixes O = z·O_full + (1 − z)·O_sparse per KV head; at inference
z = 1[log α > 0] (or count_gate, by rank) picks one kernel mode per head.

Shape letters: B batch, S sequence length, Hkv KV heads, D head dim, L layers, T tasks,
P = pool_tokens (tokens pooled at each end of a sample).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import masks
from .masks import check_lengths

# -----------------------------------------------------------------------------
# 1. The hard-concrete gate (Louizos, Welling, Kingma 2018), as pure functions of log α.
#
# u ~ U(0, 1) gives logistic noise log u − log(1 − u); the concrete relaxation squashes
# (noise + log α) / β through a sigmoid, the "stretch" maps (0, 1) to (γ, ζ), and the clamp folds
# the overhang back onto exactly 0 and exactly 1, so z̃ has point masses at both ends.

BETA = 2 / 3    # temperature of the relaxation: smaller -> z̃ closer to binary, noisier gradients
GAMMA = -0.1    # left end of the stretch; below 0 so that P(z̃ = 0) > 0
ZETA = 1.1      # right end of the stretch; above 1 so that P(z̃ = 1) > 0 (γ + ζ = 1: symmetric)
EPS = 1e-6      # u lives in [ε, 1 − ε] so log u and log(1 − u) stay finite (|noise| <= 13.8)

# β·log(ζ / −γ) = (2/3)·log 11 ≈ 1.5986: how far log α must move to make an end point likely.
_SHIFT = BETA * math.log(ZETA / -GAMMA)


def _check_log_alpha(log_alpha):
    """A NaN router logit is a broken router, not a decision: NaN > 0 is False, so a gate would
    silently call the head SPARSE. ±inf is a decision and passes. One host sync: the model calls the
    gates with check=False and checks every layer's log α once, after its layers."""
    if torch.isnan(log_alpha).any():
        raise ValueError(f"log α has {int(torch.isnan(log_alpha).sum())} NaN entries of "
                         f"{log_alpha.numel()}: the router's output is not a number")


def _logistic_noise(shape, like, u=None, generator=None, check=True):
    """log u − log(1 − u) for u ~ U(ε, 1 − ε): a standard logistic sample, P(noise <= x) = σ(x)."""
    if u is None:
        u = torch.rand(shape, generator=generator, device=like.device, dtype=torch.float32)
    elif tuple(u.shape) != tuple(shape):
        raise ValueError(f"u must have log α's shape {tuple(shape)}, got {tuple(u.shape)}")
    elif check and not bool(((u >= 0) & (u <= 1)).all()):   # a host sync
        raise ValueError("u must be uniforms in [0, 1], got values outside it (or NaN)")
    u = u.to(device=like.device, dtype=torch.float32).clamp(EPS, 1 - EPS)
    return torch.log(u) - torch.log1p(-u)


def hard_concrete_sample(log_alpha, u=None, generator=None, check=True):
    """The relaxed gate z̃ ∈ [0, 1], same shape as log_alpha, differentiable where 0 < s̄ < 1.

    u: optional uniforms of log_alpha's shape (tests pass them for reproducibility); otherwise drawn
    from `generator` (or the global RNG). Computed in float32 whatever log_alpha's dtype.
    """
    log_alpha = log_alpha.float()
    noise = _logistic_noise(log_alpha.shape, log_alpha, u, generator, check)
    s = torch.sigmoid((noise + log_alpha) / BETA)     # concrete sample in (0, 1)
    s_bar = s * (ZETA - GAMMA) + GAMMA                # stretched to (γ, ζ)
    return s_bar.clamp(0.0, 1.0)                      # z̃: exactly 0 or 1 with finite probability


# Closed forms. noise is standard logistic, so each event "s̄ ≷ c" is "noise ≷ some x" and has
# probability σ(±x). The tests check the sampler against them.

def prob_zero(log_alpha):
    """P(z̃ = 0) = σ(−β·log(ζ/−γ) − log α): s̄ <= 0 ⇔ s <= 1/12 ⇔ noise <= −β·log 11 − log α."""
    return torch.sigmoid(-_SHIFT - log_alpha)


def prob_one(log_alpha):
    """P(z̃ = 1) = σ(log α − β·log(ζ/−γ)): s̄ >= 1 ⇔ s >= 11/12."""
    return torch.sigmoid(log_alpha - _SHIFT)


def prob_nonzero(log_alpha):
    """P(z̃ > 0) = 1 − P(z̃ = 0) = σ(log α + β·log(ζ/−γ))."""
    return torch.sigmoid(log_alpha + _SHIFT)


def prob_gradient(log_alpha):
    """P(0 < z̃ < 1) = 1 − P(z̃ = 0) − P(z̃ = 1): the share of draws whose z̃ passes a gradient to
    log α (a clamped z̃ passes none). It falls like e^−|log α| once |log α| > ~2: a router whose
    logits run far from 0 stops learning, whatever its loss says."""
    return 1.0 - prob_zero(log_alpha) - prob_one(log_alpha)


def prob_full(log_alpha):
    """P(z = 1[z̃ > 0.5] = FULL) = σ(log α) exactly.

    Because γ + ζ = 1 the stretch maps s = ½ to s̄ = ½, so z̃ > ½ ⇔ s > ½ ⇔ noise > −log α.
    β drops out: the temperature shapes the gradient, not the decision's probability.
    """
    return torch.sigmoid(log_alpha)


def log_alpha_for_omega(omega):
    """The log α whose gates are SPARSE with probability Ω: σ(log α) = 1 − Ω (Ω clipped to [0.01, 0.99])."""
    if not 0 <= omega <= 1:  # also NaN
        raise ValueError(f"Ω must be in [0, 1], got {omega}")
    omega = min(max(omega, 0.01), 0.99)
    return math.log((1 - omega) / omega)


def hard_concrete_gate(log_alpha, u=None, generator=None, check=True):
    """Training gate: forward value exactly 0. or 1. (1 = FULL), gradient that of z̃ (straight-through).

    z = hard + (z̃ − z̃.detach()) is exactly `hard` but differentiates like z̃, so the model trains
    on exactly the hybrid it will run at inference. (Without the brackets, (1 + z̃) − z̃ rounds to
    1 − 2⁻²⁴ for about a fifth of draws in float32.) Where z̃ is clamped (s̄ <= 0 or s̄ >= 1, about a
    third of draws at log α = 0) the gradient is zero for that draw — the price of point masses.
    check=False (every gate): skip the host syncs that look for NaN in log α and u outside [0, 1]; the
    model checks u at its entry and log α after its layers.
    """
    if check:
        _check_log_alpha(log_alpha)
    z_soft = hard_concrete_sample(log_alpha, u, generator, check)
    z_hard = (z_soft > 0.5).float()
    return z_hard + (z_soft - z_soft.detach())  # parenthesised: exactly z_hard in any dtype


def deterministic_gate(log_alpha, check=True):
    """Evaluation gate: z = 1[log α > 0] (the more likely hard decision), no RNG, no gradient."""
    if check:
        _check_log_alpha(log_alpha)
    return (log_alpha > 0).float()


def count_gate(log_alpha, debt, check=True):
    """Evaluation gate that deploys the sparsity training paid for: log α (B, Hkv) of one layer,
    debt (B,) float32 carried from layer to layer (zeros before the first; updated in place)
    -> z (B, Hkv), no RNG, no gradient.

    A training draw makes a head SPARSE with probability 1 − σ(log α); the threshold rule makes it
    SPARSE whenever log α <= 0. The two agree on average only when the logits are spread evenly
    around 0, and a router's are not (a head at log α = −1 is FULL in 27 % of draws, never at
    deployment). Here a layer makes its k lowest-log-α heads SPARSE, with k the training draws'
    expected count Σ(1 − σ(log α)) plus the rounding left over from the layers before, rounded: over
    all layers the count is the expected one to within half a head, and the ranking is the routers'.
    """
    if log_alpha.dim() != 2 or not isinstance(debt, torch.Tensor) or debt.shape != log_alpha.shape[:1]:
        raise ValueError(f"count_gate takes log α (B, Hkv) and debt (B,), got {tuple(log_alpha.shape)} and "
                         f"{tuple(debt.shape) if isinstance(debt, torch.Tensor) else type(debt)}")
    if check:
        _check_log_alpha(log_alpha)
    expected = (1 - prob_full(log_alpha.float())).sum(1)                 # (B,)
    k = (debt + expected).round().clamp(0, log_alpha.shape[1])            # (B,) sparse heads in this layer
    debt += expected - k                                                  # stays in [−½, ½]
    rank = log_alpha.argsort(dim=1, stable=True).argsort(dim=1, stable=True)  # (B, Hkv) 0 = lowest log α
    return (rank >= k[:, None]).float()


# --- The paper's alternative: a Gumbel-softmax gate with a temperature schedule ----------------
#
# The router emits ONE logit per head. A two-class Gumbel-softmax over logits (log α, 0) is all the
# information there is: softmax is shift-invariant, so only the difference of the two logits
# matters, and fixing the second at 0 loses nothing. With Gumbel noises g1, g0:
#     softmax([log α + g1, g0] / τ)[FULL] = σ((log α + g1 − g0) / τ),
# and g1 − g0 is exactly standard logistic. So the two-logit Gumbel-softmax IS a sigmoid with
# logistic noise, and P(hard = FULL) = P(g1 − g0 > −log α) = σ(log α) for every τ.
# (Pitfall in the authors' sigmoid variant, METHOD.md §5: a single Gumbel g1 inside the sigmoid
# gives P(hard = 1) = 1 − exp(−e^{log α}), 0.632 at log α = 0, a built-in bias towards FULL.)

def gumbel_softmax_gate(logit, tau, u=None, generator=None, check=True):
    """Two-logit Gumbel-softmax (logits (logit, 0)) with hard forward and straight-through gradient.

    Forward exactly 0. or 1. (1 = FULL); P(1) = σ(logit); gradient that of σ((logit + noise) / τ).
    τ must be finite: at τ = inf the soft value is ½ for every draw and the hard gate never says FULL.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < math.inf:
        raise ValueError(f"temperature tau must be a finite number > 0, got {tau!r}")
    if check:
        _check_log_alpha(logit)
    logit = logit.float()
    noise = _logistic_noise(logit.shape, logit, u, generator, check)   # = g1 − g0 in distribution
    z_soft = torch.sigmoid((logit + noise) / tau)
    z_hard = (z_soft > 0.5).float()
    return z_hard + (z_soft - z_soft.detach())  # parenthesised: exactly z_hard in any dtype


def _check_progress(progress):
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress must be the fraction of training done, in [0, 1], got {progress!r}")


def tau_cosine(progress, tau_start=1.5, tau_end=1.0, anneal_frac=0.6):
    """The authors' code: cosine from 1.5 to 1.0 over the first 60 % of training, then flat. (The
    paper writes an exponential decay, METHOD.md §5; the code is what their results come from.)"""
    _check_progress(progress)
    p = min(1.0, progress / anneal_frac)
    return tau_end + (tau_start - tau_end) * 0.5 * (1.0 + math.cos(math.pi * p))

# -----------------------------------------------------------------------------
# 2. The Attention Router (one per layer, ≈ 0.26 M parameters at D = 128, hidden ×4).

def boundary_pool(k, prompt_lengths, pool_tokens, skip=0, check=True):
    """Mean of each sample's first P prompt tokens after `skip` and its last P prompt tokens:
    (B, Hkv, S, D) -> (B, Hkv, D) float32.

    The instructions sit at the start of a prompt and the question at its end; the document in the
    middle is noise for telling tasks apart (paper App. H.5). `skip` leaves out a fixed preamble that
    every prompt shares (a chat model's system turn), which would otherwise dilute the instruction.
    A sample shorter than skip + 2P is pooled over each of its tokens after `skip` once (the union
    of the two ranges). Tokens at or after prompt_lengths[b] (the answer, or padding) are never read;
    each length must be in [skip + 1, S].

    Vectorised by gathering 2P slots per sample rather than weighting all S positions: at 64K
    tokens that reads 200 keys instead of 64K and never makes an fp32 copy of the whole K.
    """
    B, Hkv, S, D = k.shape
    if check:
        check_lengths(prompt_lengths, B, S, name="prompt_lengths")
        if skip and bool((prompt_lengths <= skip).any()):
            raise ValueError(f"every prompt length must exceed the {skip} skipped preamble tokens, got "
                             f"{prompt_lengths.tolist()}")
    P = pool_tokens
    slot = torch.arange(P, device=k.device).view(1, P)                # (1, P)
    L = prompt_lengths.to(k.device).view(B, 1)                        # (B, 1)
    head = skip + slot.expand(B, P)                                   # (B, P)  positions skip .. skip+P−1
    tail = L - P + slot                                               # (B, P)  positions L−P .. L−1
    pos = torch.cat([head, tail], dim=1)                              # (B, 2P)
    # A head slot counts if it is a real token; a tail slot only if the head range did not already
    # take it (positions < skip + P), so a short sample counts every token exactly once.
    valid = torch.cat([head < L, tail >= skip + P], dim=1)            # (B, 2P)
    weight = valid.float() / valid.sum(1, keepdim=True)               # (B, 2P), each row sums to 1
    pos = pos.clamp(0, S - 1)                                         # invalid slots read a real row, weight 0
    idx = pos.view(B, 1, 2 * P, 1).expand(B, Hkv, 2 * P, D)           # (B, Hkv, 2P, D)
    k_slots = k.gather(2, idx).float()                                # (B, Hkv, 2P, D) fp32 for the mean
    return (k_slots * weight.view(B, 1, 2 * P, 1)).sum(2)             # (B, Hkv, D)


class AttentionRouter(nn.Module):
    """Pre-RoPE key states of one layer -> one logit log α per (sample, KV head).

    Both MLPs are shared by all KV heads of the layer (head-agnostic): only a head's pooled key
    vector tells heads apart, so permuting heads permutes the output. Nothing but the keys reaches
    the router — no task id — so at inference it must infer the task from the prompt itself.
    """

    def __init__(self, head_dim, hidden_mult=4, pool_tokens=100, pool_skip=0, init_logit=0.0):
        super().__init__()
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
        if not isinstance(hidden_mult, int) or hidden_mult < 1:
            raise ValueError(f"hidden_mult must be an int >= 1, got {hidden_mult!r}")
        if not isinstance(pool_tokens, int) or pool_tokens < 1:
            raise ValueError(f"pool_tokens must be an int >= 1, got {pool_tokens!r}")
        if not isinstance(pool_skip, int) or pool_skip < 0:
            raise ValueError(f"pool_skip must be an int >= 0, got {pool_skip!r}")
        if isinstance(init_logit, bool) or not isinstance(init_logit, (int, float)) or not math.isfinite(init_logit):
            raise ValueError(f"init_logit must be a finite number, got {init_logit!r}")
        D, hidden = head_dim, hidden_mult * head_dim
        self.head_dim, self.pool_tokens, self.pool_skip = head_dim, pool_tokens, pool_skip
        # The pooled keys are standardised before the MLPs: (x − shift) / scale per feature, with the
        # layer's statistics over calibration prompts and KV heads (fit_input_norm). Keys share a large
        # common component; centred and scaled, what differs between inputs is what the MLP first sees.
        # The defaults (0, 1) leave the keys as they are.
        self.register_buffer("in_shift", torch.zeros(D))                  # (D,)
        self.register_buffer("in_scale", torch.ones(D))                   # (D,)
        # Task MLP: turns the pooled key into a "what kind of input is this" feature.
        self.task_mlp = nn.Sequential(nn.Linear(D, hidden), nn.SiLU(), nn.Linear(hidden, D))
        # Router MLP: from that feature to the FULL-vs-SPARSE logit.
        self.router_mlp = nn.Sequential(nn.Linear(D, hidden), nn.SiLU(), nn.Linear(hidden, D), nn.SiLU(),
                                        nn.Linear(D, 1))
        # Initial decisions: log α ≈ init_logit for every head and input; the default 0 gives
        # P(FULL) ≈ ½ — neither all-full nor all-sparse by accident. A zero last layer (weights 0,
        # bias init_logit) would give exactly that, but then the gradient into every earlier layer
        # (∂log α/∂h = W_last) is exactly zero, and AdamW turns a zero gradient into a zero step,
        # so for the first steps only the last layer would learn. We shrink PyTorch's default init
        # of the last layer's weights by 100 instead: log α starts within a few hundredths of
        # init_logit, and Adam's per-parameter normalisation makes the small (but non-zero)
        # gradients to earlier layers move them at full speed from step one.
        last = self.router_mlp[-1]
        with torch.no_grad():
            last.weight.mul_(0.01)
            last.bias.fill_(init_logit)

    def forward(self, k, prompt_lengths=None, check=True):
        """k (B, Hkv, S, D) key states before RoPE, prompt_lengths (B,) int: the tokens it may read
        (None = all S). check=False: the caller has checked prompt_lengths (boundary_pool).

        Returns log α (B, Hkv) float32. The MLPs run in float32 whatever k's dtype (bf16 keys are
        fine); keep the router's parameters float32 too, e.g. cast the backbone before attaching.
        """
        if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[-1] != self.head_dim:
            raise ValueError(f"k must be (B, Hkv, S, D={self.head_dim}), got "
                             f"{tuple(k.shape) if isinstance(k, torch.Tensor) else type(k)}")
        B, Hkv, S, D = k.shape
        if prompt_lengths is None:
            prompt_lengths = torch.full((B,), S, dtype=torch.long, device=k.device)

        pooled = boundary_pool(k, prompt_lengths, self.pool_tokens, self.pool_skip, check)  # (B, Hkv, D) fp32
        return self.logits(pooled)

    def logits(self, x):
        """What the router decides from one vector per (sample, head): x (B, H, D) → log α (B, H)
        float32. forward() gives it the pooled keys; a count router on the pre-pass, the residual
        stream at the last prompt token (Transformer.prepass)."""
        with torch.autocast(device_type=x.device.type, enabled=False):   # a logit near 0 needs fp32
            x = ((x.float() - self.in_shift) / self.in_scale).to(self.router_mlp[0].weight.dtype)
            x = self.task_mlp(x)                                           # (B, H, D)
            log_alpha = self.router_mlp(x).squeeze(-1)                     # (B, H)
        return log_alpha.float()


@torch.no_grad()
def fit_input_norm(router, pooled):
    """Set a router's input standardisation from pooled keys of calibration prompts: pooled
    (N, Hkv, D) → in_shift = their mean, in_scale = their standard deviation, per feature, over
    prompts and heads alike (per-head statistics would erase what tells the heads apart)."""
    x = pooled.float().flatten(0, 1)                                      # (N·Hkv, D)
    if x.shape[0] < 2:
        raise ValueError(f"fit_input_norm needs at least two pooled vectors, got {tuple(pooled.shape)}")
    router.in_shift.copy_(x.mean(0))
    router.in_scale.copy_(x.std(0).clamp(min=1e-6))


class CountRouter(nn.Module):
    """The count router on the routing pre-pass (Transformer.prepass): one residual vector per prompt
    (B, H, C) → one log α shift per prompt (B, H). It whitens the vector, then reads it linearly.

    Why whitened and linear, where the per-layer routers standardise and use two MLPs: prompts of
    one kind differ most in their wording and their text, and those directions dominate the raw
    residual. Whitening (with shrinkage) scales them down, so the readout follows what separates the
    kinds, much as linear discriminant analysis does. On the development prompts, a linear readout of
    the whitened residual told the kinds apart better than one of the standardised residual, and the
    MLP of AttentionRouter, trained on the same prompts, learned their wordings (METHOD.md §4).
    """

    SHRINK = 1.0   # added to the eigenvalues of the inputs' correlation matrix before whitening

    def __init__(self, width, init_logit=0.0):
        super().__init__()
        masks.check_int("width", width, 1)
        if isinstance(init_logit, bool) or not isinstance(init_logit, (int, float)) or not math.isfinite(init_logit):
            raise ValueError(f"init_logit must be a finite number, got {init_logit!r}")
        self.head_dim = width
        self.register_buffer("in_shift", torch.zeros(width))         # (C,)
        self.register_buffer("whiten", torch.eye(width))             # (C, C); fit_whitening sets it
        self.readout = nn.Linear(width, 1)
        with torch.no_grad():   # a zero readout starts every prompt at init_logit; its gradient is x, not 0
            self.readout.weight.zero_()
            self.readout.bias.fill_(init_logit)

    def logits(self, x):
        """x (B, H, C) → log α (B, H) float32."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = (x.float() - self.in_shift) @ self.whiten                  # (B, H, C)
            return self.readout(x).squeeze(-1)                             # (B, H)


@torch.no_grad()
def fit_whitening(router, x):
    """Set a CountRouter's whitening from its inputs on calibration prompts, x (N, C):
    W = diag(1/sd) · V (Λ + SHRINK)^(−1/2) Vᵀ, with V Λ Vᵀ the correlation matrix of x."""
    x = x.double()
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"fit_whitening needs at least two (N, C) vectors, got {tuple(x.shape)}")
    sd = x.std(0).clamp(min=1e-6)
    z = (x - x.mean(0)) / sd
    evals, evecs = torch.linalg.eigh(z.T @ z / (len(z) - 1))
    w = (evecs * (evals.clamp(min=0) + router.SHRINK).rsqrt()) @ evecs.T
    router.in_shift.copy_(x.mean(0))
    router.whiten.copy_(w / sd[:, None])


def fit_logistic(x, y, l2=1e-2, steps=200):
    """Logistic regression by L-BFGS: x (N, F), y (N,) in {0, 1} → (w (F,), b ()) minimising the mean
    log loss + l2·|w|²."""
    x, y = x.float(), y.float()
    w = torch.zeros(x.shape[1], device=x.device, requires_grad=True)
    b = torch.zeros((), device=x.device, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w ** 2).sum()
        loss.backward()
        return loss
    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


@torch.no_grad()
def fit_readout_direction(router, x, sensitive, gain=0.5):
    """Fix a whitened CountRouter (fit_whitening first) to read one direction of its input: a
    logistic probe of the category on the whitened calibration inputs x (N, C), sensitive (N,) 1 or 0.
    The probe's score, centred and scaled to unit sd over x, is folded into `whiten` as its first
    column, so the readout's first weight is a gain and its bias an offset, and those two train: no
    other input reaches the readout. shift = gain · score + bias: a sensitive prompt scores high,
    more heads go FULL. Why: METHOD.md §4."""
    W = router.whiten.double().cpu()
    z = (x.double().cpu() - router.in_shift.double().cpu()) @ W              # (N, C) whitened
    u = fit_logistic(z, sensitive.cpu())[0].double()
    score = z @ u                                                             # (N,)
    router.whiten.zero_()
    router.whiten[:, 0] = (W @ u / score.std().clamp(min=1e-12)).to(router.whiten)
    router.readout.weight.zero_()
    router.readout.weight[0, 0] = gain
    router.readout.bias.fill_(-gain * float(score.mean() / score.std().clamp(min=1e-12)))


# --- Fail-safe deployment (ranked routers) ----------------------------------------------------
#
# A count router places a prompt it has not seen by how much it resembles the prompts it trained on,
# and a sensitive prompt in a new wording tends to land between the two categories, where a count
# that interpolates sends it halfway to sparse. Deployed with a fail-safe, only a prompt placed on the
# robust side of a threshold between the categories keeps its own count; any other gets at least the
# sensitive prompts' typical one (METHOD.md §7). The threshold rests on the two categories' medians:
# the tail of a few dozen calibration prompts moves with their text, the medians hardly do.


def fit_fail_safe(shift, sensitive, at):
    """(above, floor) from the shifts (N,) a ranked router gives calibration prompts and their
    categories (N,) 1 = sensitive: `above` lies the fraction `at` of the way from the robust prompts'
    median shift to the sensitive prompts', `floor` is the sensitive prompts' median. Shifts grow
    toward FULL."""
    if not 0 < at < 1:
        raise ValueError(f"fail-safe threshold must lie strictly between the medians, in (0, 1), got {at}")
    shift, sensitive = shift.double().flatten(), torch.as_tensor(sensitive).flatten().bool()
    if shift.shape != sensitive.shape or sensitive.all() or not sensitive.any() or shift.isnan().any():
        raise ValueError(f"fit_fail_safe needs finite shifts of both categories, got {tuple(shift.shape)} shifts "
                         f"and {int(sensitive.sum())} sensitive of {sensitive.numel()}")
    robust, floor = float(shift[~sensitive].median()), float(shift[sensitive].median())
    return robust + at * (floor - robust), floor


def fail_safe(shift, above, floor):
    """shift (B,) → shift (B,): any input above `above` gets at least `floor` (fit_fail_safe)."""
    return torch.where(shift > above, shift.clamp(min=floor), shift)


def check_fail_safe(value, where):
    """A saved fail-safe as a tuple (above, floor) of finite floats, or None; else a ValueError."""
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, float) and math.isfinite(v) for v in value)):
        raise ValueError(f"{where}: fail_safe must be two finite floats (above, floor) or None, got {value!r}")
    return tuple(value)


class StaticGate(nn.Module):
    """The trained static baseline (DuoAttention / PruLong): one learned log α per KV head, the same
    for every input. It has AttentionRouter's interface, so it trains through the same gate,
    Lagrangian and loop; only its output ignores the keys."""

    def __init__(self, n_kv_heads, init_logit=0.0):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.full((n_kv_heads,), float(init_logit)))  # the routers' start

    def forward(self, k, prompt_lengths=None, check=True):
        return self.log_alpha.float().expand(k.shape[0], -1)     # (B, Hkv)

# -----------------------------------------------------------------------------
# 3. The objective: model sparsity Ω_MSR and the per-task Lagrangian (METHOD.md §6).

SENSITIVE_TARGET = 0.7   # QA / retrieval: accuracy collapses past ~0.7 sparse heads (paper; authors' script 0.6)
ROBUST_TARGET = 1.0      # summarisation, code, ICL: let the model go as sparse as it likes


def omega_msr(z, check=True):
    """Ω_MSR per sample = 1 − mean z over layers and KV heads: z (L, B, Hkv), or a list of L
    per-layer (B, Hkv), -> (B,) float32.

    With the hard z of the training gate this is the exact fraction of SPARSE heads, and it
    carries the straight-through gradient back to every router's log α. z must lie in [0, 1]
    (1 = FULL): outside it the "fraction" could be −1 or 2 (check=False: the caller knows it does).
    """
    if isinstance(z, (list, tuple)):
        if len(z) == 0:
            raise ValueError("omega_msr needs the gates of at least one layer, got an empty list")
        shapes = {tuple(zi.shape) for zi in z}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"every layer's z must be (B, Hkv) with the same shape, got {sorted(shapes)}")
        z = torch.stack(list(z))                                      # (L, B, Hkv)
    if not isinstance(z, torch.Tensor) or z.dim() != 3 or z.numel() == 0:
        raise ValueError(f"z must be a non-empty (L, B, Hkv) tensor or a list of (B, Hkv), got "
                         f"{tuple(z.shape) if isinstance(z, torch.Tensor) else type(z)}")
    z = z.float()
    if check and not ((z >= 0) & (z <= 1)).all():   # also catches NaN; one host sync
        raise ValueError(f"z must be in [0, 1] (1 = FULL), got values from {z.min().item()} to "
                         f"{z.max().item()}{' and NaN' if z.isnan().any() else ''}")
    return 1.0 - z.mean(dim=(0, 2))                                   # (B,)


class SparsityLagrangian(nn.Module):
    """Per-task multipliers: term = λ1[t]·(Ω − t_t) + λ2[t]·(Ω − t_t)², mean per task, then over tasks.

    The routers *minimise* LM loss + term; λ1, λ2 *maximise* it (gradient ascent, see
    build_optimizer). ∂term/∂λ1 = Ω − t, so λ1 falls while the model is denser than its target
    and, once negative, rewards sparsity; it settles where the LM loss's pull towards FULL heads
    balances it. ∂term/∂λ2 = (Ω − t)² >= 0, so λ2 only grows: a quadratic penalty that damps the
    oscillation of the pure Lagrangian. abs_variant=True is the authors' code, λ1·|Ω − t|, which
    makes λ1 only grow too (a penalty rather than a multiplier).
    Averaging per task first keeps a task with many samples in the batch from owning the term.
    """

    def __init__(self, num_tasks, targets, abs_variant=False):
        super().__init__()
        if not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"num_tasks must be an int >= 1, got {num_tasks!r}")
        targets = [float(t) for t in targets]
        if len(targets) != num_tasks:
            raise ValueError(f"need one target per task: num_tasks={num_tasks}, got {len(targets)} targets")
        bad = [t for t in targets if not 0.0 <= t <= 1.0]
        if bad:
            raise ValueError(f"sparsity targets must be in [0, 1], got {bad}")
        self.num_tasks, self.abs_variant = num_tasks, abs_variant
        self.register_buffer("targets", torch.tensor(targets))   # (T,)
        # Start at 0: the first steps are pure LM loss, and λ grows only as far as the gap demands.
        self.lambda1 = nn.Parameter(torch.zeros(num_tasks))      # (T,)
        self.lambda2 = nn.Parameter(torch.zeros(num_tasks))      # (T,)

    def forward(self, omega, task_ids, task_counts=None, check=True):
        """omega (B,) Ω_MSR per sample, task_ids (B,) long -> scalar term. B >= 1.

        task_counts (T,): samples per task in the whole batch when this call sees only a shard of
        it (data parallel). The result is then this shard's share: the shares of all shards add up
        to the term of the whole batch, exactly (an empty shard's share is 0). check=False: the caller
        has checked task_ids' values (a host sync; elastic_lab.runs.StepGraph records the step)."""
        if omega.dim() != 1 or not isinstance(task_ids, torch.Tensor) or task_ids.shape != omega.shape:
            raise ValueError(f"omega and task_ids must both be (B,), got {tuple(omega.shape)} and "
                             f"{tuple(task_ids.shape) if isinstance(task_ids, torch.Tensor) else task_ids!r}")
        if omega.numel() == 0 and task_counts is None:   # the mean over tasks present would be 0 / 0
            raise ValueError("the Lagrangian needs at least one sample, got an empty batch (B = 0)")
        if task_ids.dtype.is_floating_point or task_ids.dtype == torch.bool:
            raise ValueError(f"task_ids must be an integer tensor, got dtype {task_ids.dtype}")
        if task_counts is not None and tuple(task_counts.shape) != (self.num_tasks,):   # would broadcast
            raise ValueError(f"task_counts must be ({self.num_tasks},), got {tuple(task_counts.shape)}")
        bad = (task_ids < 0) | (task_ids >= self.num_tasks)
        if check and bad.any():
            raise ValueError(f"task ids must be in [0, {self.num_tasks}), got {task_ids[bad].unique().tolist()}")
        gap = omega - self.targets[task_ids]                                   # (B,)
        first = gap.abs() if self.abs_variant else gap
        per_sample = self.lambda1[task_ids] * first + self.lambda2[task_ids] * gap ** 2   # (B,)
        # Mean per task, then over the tasks present, without a Python loop over tasks.
        onehot = F.one_hot(task_ids, self.num_tasks).to(per_sample.dtype)     # (B, T)
        count = onehot.sum(0) if task_counts is None else task_counts.to(per_sample)  # (T,)
        per_task = (onehot * per_sample[:, None]).sum(0) / count.clamp(min=1)  # (T,)
        present = (count > 0).to(per_task.dtype)                               # (T,)
        return (per_task * present).sum() / present.sum()


def consistency_penalty(log_alpha, task_ids, num_tasks):
    """Per input, Σ over layers and heads of (P(FULL) − its mean over the batch's inputs of the same
    task)²: how far the input's head set strays from its task's. log_alpha (L, B, Hkv), task_ids (B,)
    -> (B,) float32; an input alone of its task in the batch gets 0.

    The routers still see only the prompt; the task label enters training only, as it does through
    the per-task targets. What routing learns from one input that it cannot learn from its task is
    noise in which heads stay FULL (METHOD.md §6)."""
    p = prob_full(log_alpha.float())                                           # (L, B, Hkv)
    onehot = F.one_hot(task_ids, num_tasks).to(p.dtype)                        # (B, T)
    mean = torch.einsum("lbh,bt->lth", p, onehot) / onehot.sum(0).clamp(min=1)[None, :, None]  # (L, T, Hkv)
    return (p - mean[:, task_ids]).pow(2).sum(dim=(0, 2))                      # (B,)


def balanced_answer_loss(logits, targets, task_ids, task_counts):
    """Each sample's mean cross-entropy over its answer tokens, averaged per task, then over the
    tasks of the global batch (task_counts (T,)): a task with long answers (a 64-token continuation)
    weighs as much as one with a five-digit one. Shards' losses add up to the global value.
    logits (B, K, V), targets (B, K) with -100 where nothing is scored: the answer positions
    (tasks.scored_positions), or every position. No host sync (a CUDA graph can hold it)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                         reduction="none").view(targets.shape)                 # (B, K), 0 where not scored
    per_sample = ce.sum(1) / (targets != -100).sum(1).clamp(min=1)             # (B,)
    weight = 1.0 / (task_counts[task_ids] * (task_counts > 0).sum())           # (B,)
    return (per_sample * weight).sum()

# -----------------------------------------------------------------------------
# 4. Training plumbing: frozen backbone, the paper's AdamW groups and schedule.

def is_router_param(name):
    """Whether a model parameter (or state_dict key) belongs to the routers: layers.{i}.self_attn.router.*,
    and the ranked routers' shift_router.*."""
    return ".router." in name or name.startswith("shift_router.")


def freeze_backbone(model):
    """Only the routers (`is_router_param`: each layer's router, and a ranked model's shift router)
    stay trainable; returns their parameters.

    Activations still carry gradients through the frozen layers (autograd needs them to reach the
    routers of earlier layers); only the backbone's weights get no .grad and no optimizer state.
    """
    if not getattr(model, "routers", None):
        raise ValueError(f"{type(model).__name__} has no routers; call attach_routers() before freezing")
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(is_router_param(name))
        if p.requires_grad:
            trainable.append(p)
    if not trainable:
        raise ValueError("model.routers has no parameters to train")
    return trainable


def build_optimizer(router_params, lagrangian, total_steps, router_lr=5e-4, lambda_lr=1e-3,
                    betas=(0.9, 0.95), weight_decay=0.1, warmup_frac=0.2, rank_params=(), rank_lr=None,
                    lambda_schedule="cosine"):
    """One AdamW with three groups (four with rank_params), and a LambdaLR: linear warm-up over
    warmup_frac, then cosine to 0.

    Groups (paper Table 6): router weight matrices (lr 5e-4, wd 0.1), router biases (lr 5e-4, no
    decay, as nanoGPT and HF Trainer do), and λ (lr 1e-3, no decay, maximize=True: gradient ascent).
    torch's AdamW reads `maximize` per param group, so one optimizer and one scheduler serve both
    players of the min-max. Learning rates must be finite and > 0: a negative λ lr would silently
    turn the ascent into a descent. rank_params (ranked routers' per-head logits; not in
    router_params) get a group of their own at rank_lr, no decay. The schedule scales every group
    alike, but for lambda_schedule="constant": λ then stays at its peak after the warm-up, so the
    multipliers keep tracking their targets while the routers' steps shrink.
    """
    rank_params = list(rank_params)
    lrs = dict(router_lr=router_lr, lambda_lr=lambda_lr, **(dict(rank_lr=rank_lr) if rank_params else {}))
    for name, lr in lrs.items():
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ValueError(f"{name} must be a finite number > 0, got {lr!r}")
    if lambda_schedule not in ("cosine", "constant"):
        raise ValueError(f"lambda_schedule must be 'cosine' or 'constant', got {lambda_schedule!r}")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if not 0.0 <= warmup_frac < 1.0:
        raise ValueError(f"warmup_frac must be in [0, 1), got {warmup_frac!r}")
    router_params = list(router_params)
    groups = [
        dict(params=[p for p in router_params if p.dim() >= 2], lr=router_lr, weight_decay=weight_decay,
             maximize=False, name="router"),
        dict(params=[p for p in router_params if p.dim() < 2], lr=router_lr, weight_decay=0.0,
             maximize=False, name="router_bias"),
        dict(params=list(lagrangian.parameters()), lr=lambda_lr, weight_decay=0.0,
             maximize=True, name="lambda"),
        dict(params=rank_params, lr=rank_lr, weight_decay=0.0, maximize=False, name="rank"),
    ]
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.AdamW(groups, betas=betas)

    warmup = round(warmup_frac * total_steps)

    def lr_scale(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)                # linear warm-up to the peak at step `warmup`; never 0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))   # cosine from 1 to 0

    def held(step):   # the warm-up, then the peak's 1
        return lr_scale(min(step, warmup))

    hold_lambda = lambda_schedule == "constant"
    scales = [held if hold_lambda and g["name"] == "lambda" else lr_scale for g in groups]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, scales)

