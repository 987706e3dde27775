"""The diffusion maths against closed forms and against independent float64 references."""
import math
import re

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ddpm
from ddpm import Diffusion, ModelConfig, dynamic_threshold, sample


def test_linear_schedule_matches_closed_form():
    d = Diffusion(ModelConfig())
    betas = np.linspace(1e-4, 0.02, 1000)
    alpha_bar = np.cumprod(1 - betas)
    assert d.alpha_bar.shape == (1000,)
    np.testing.assert_allclose(d.betas.numpy(), betas, rtol=1e-12)
    np.testing.assert_allclose(d.alpha_bar.numpy(), alpha_bar, rtol=1e-12)
    assert d.alpha_bar[0].item() == pytest.approx(1 - 1e-4, rel=1e-12)  # t = 0 is the least noisy
    assert d.alpha_bar[-1].item() == pytest.approx(4.0358e-5, rel=1e-3)  # Ho et al.'s ᾱ_T


def test_cosine_schedule_matches_closed_form():
    T, s = 1000, 0.008
    d = Diffusion(ModelConfig(schedule="cosine", timesteps=T))
    f = lambda t: math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    ref = np.array([f(t + 1) / f(0) for t in range(T)])
    # identical wherever the 0.999 clip on β is inactive (all but the last few steps)
    np.testing.assert_allclose(d.alpha_bar[:990].numpy(), ref[:990], rtol=1e-10)
    assert d.betas.max().item() <= 0.999


def test_q_sample_statistics():
    d = Diffusion(ModelConfig())
    n = 200_000
    for t in (0, 250, 999):
        x0 = torch.full((n, 1, 1, 1), 0.7, dtype=torch.float64)
        tt = torch.full((n,), t)
        z = d.q_sample(x0, tt, torch.randn_like(x0))
        ab = d.alpha_bar[t].item()
        assert z.mean().item() == pytest.approx(math.sqrt(ab) * 0.7, abs=5e-3)
        assert z.var().item() == pytest.approx(1 - ab, rel=2e-2, abs=1e-5)


@pytest.mark.parametrize("prediction", ["eps", "x", "v", "edm"])
def test_prediction_round_trip(prediction):
    d = Diffusion(ModelConfig(prediction=prediction))
    x0 = torch.rand(64, 3, 4, 4, dtype=torch.float64) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.randint(0, 1000, (64,))
    z = d.q_sample(x0, t, noise)
    x0_hat, eps_hat = d.predict_x0_eps(d.target(x0, noise, t), z, t, threshold="none")
    torch.testing.assert_close(x0_hat, x0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(eps_hat, noise, rtol=1e-9, atol=1e-9)
    # clipping keeps x̂₀ in range and ε̂ consistent with z_t
    x0_c, eps_c = d.predict_x0_eps(d.target(3 * x0, noise, t), z, t)
    assert x0_c.abs().max() <= 1
    sa, so = d.alpha_bar[t].sqrt().view(-1, 1, 1, 1), (1 - d.alpha_bar[t]).sqrt().view(-1, 1, 1, 1)
    torch.testing.assert_close(sa * x0_c + so * eps_c, z)


def test_v_definition():
    d = Diffusion(ModelConfig(prediction="v"))
    x0, noise = torch.randn(8, 3, 2, 2, dtype=torch.float64), torch.randn(8, 3, 2, 2, dtype=torch.float64)
    t = torch.arange(8) * 100
    ab = d.alpha_bar[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(d.target(x0, noise, t), ab.sqrt() * noise - (1 - ab).sqrt() * x0)


def noise_of(d, x0, z, t):
    """The ε that produced z_t from x₀."""
    a, s = d.alpha_bar[t].sqrt().view(-1, 1, 1, 1), (1 - d.alpha_bar[t]).sqrt().view(-1, 1, 1, 1)
    return (z - a * x0) / s


@pytest.mark.parametrize("weighting", ["none", "sqrt_snr", "min_snr", "edm"])
def test_loss_weighting(weighting):
    """Weights are defined on the x₀-MSE, so the same x̂₀ error costs the same under ε, x, v and EDM's F;
    EDM's λ(σ) = (σ² + σ_d²)/(σ σ_d)² written out from Karras et al. 2022 Table 1 with numpy's σ."""
    x0 = torch.rand(32, 3, 4, 4, dtype=torch.float64) * 2 - 1
    delta = 0.05 * torch.randn_like(x0)
    mse_x = delta.pow(2).flatten(1).mean(1)
    losses = {}
    for prediction in ("eps", "x", "v", "edm"):
        d = Diffusion(ModelConfig(prediction=prediction, loss_weighting=weighting, timesteps=100))

        def model(u, t, y):  # predicts x̂₀ = x₀ + δ, expressed in the configured target
            z = u / d.net_input(torch.ones_like(u), t)  # the network's input back to z_t (edm scales it)
            return d.target(x0 + delta, noise_of(d, x0 + delta, z, t), t)

        torch.manual_seed(1)  # the same t and ε for every prediction type
        losses[prediction], t = d.loss(model, x0)
        losses[prediction] = losses[prediction].double()
    snr = d.alpha_bar[t] / (1 - d.alpha_bar[t])
    betas = np.linspace(1e-4, 0.02, 100)
    sigma = torch.from_numpy(np.sqrt(1 / np.cumprod(1 - betas) - 1))[t]  # σ_t = √((1 − ᾱ_t)/ᾱ_t)
    edm = (sigma**2 + 0.5**2) / (sigma * 0.5) ** 2
    if weighting == "none":  # L_simple: the plain MSE of each target
        torch.testing.assert_close(losses["x"], mse_x, rtol=1e-5, atol=0)
        torch.testing.assert_close(losses["eps"], snr * mse_x, rtol=1e-5, atol=0)
        torch.testing.assert_close(losses["v"], (snr + 1) * mse_x, rtol=1e-5, atol=0)
        torch.testing.assert_close(losses["edm"], edm * mse_x, rtol=1e-5, atol=0)  # 1/c_out² = λ_EDM
    else:
        lam = {"sqrt_snr": snr.sqrt(), "min_snr": snr.clamp(max=5.0), "edm": edm}[weighting]
        for prediction in ("eps", "x", "v", "edm"):
            torch.testing.assert_close(losses[prediction], lam * mse_x, rtol=1e-5, atol=0)
    if weighting == "edm":  # EDM's loss, eq. 8: λ c_out² = 1 on F
        assert torch.allclose(d.loss_weight, torch.ones_like(d.loss_weight), rtol=1e-12)


@pytest.mark.parametrize("split", [0, 300])
def test_lognormal_timesteps_follow_karras_et_al(split):
    """t_sampling='lognormal': ln σ_t of the drawn timesteps is N(P_mean, P_std²) (Karras et al. 2022 Table
    1) put on the discrete grid. Each t's frequency in 400k draws against scipy's normal CDF between the
    midpoints of neighbouring ln σ_t (numpy's schedule); a split expert draws only its own range."""
    stats = pytest.importorskip("scipy.stats")
    mc = ModelConfig(t_sampling="lognormal", p_mean=-1.0, p_std=1.4, split_timestep=split, split_part="high")
    d = Diffusion(mc)
    torch.manual_seed(0)
    n = 400_000
    t, _, _ = d.draw(torch.zeros(n, 1, 1, 1), False)
    lo = split
    assert t.min().item() >= lo and t.max().item() <= 999
    log_sigma = 0.5 * np.log(1 / np.cumprod(1 - np.linspace(1e-4, 0.02, 1000)) - 1)
    edges = np.concatenate([[-np.inf], (log_sigma[1:] + log_sigma[:-1]) / 2, [np.inf]])
    p = np.diff(stats.norm.cdf(edges, loc=-1.0, scale=1.4))[lo:]
    p = p / p.sum()
    freq = np.bincount(t.numpy(), minlength=1000)[lo:] / n
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) <= 5 * se + 1e-6), np.abs(freq - p).max()
    if not split:  # the whole grid: the moments of ln σ are the normal's, to the grid's resolution
        ls = torch.from_numpy(log_sigma)[t]
        assert ls.mean().item() == pytest.approx(-1.0, abs=0.02)
        assert ls.std().item() == pytest.approx(1.4, abs=0.02)


def test_uniform_timesteps_draw_as_before():
    """The default draws t with torch.randint, as every earlier run did: runs stay bitwise reproducible."""
    d = Diffusion(ModelConfig(timesteps=100))
    torch.manual_seed(3)
    t, _, _ = d.draw(torch.zeros(64, 1, 1, 1), False)
    torch.manual_seed(3)
    assert torch.equal(t, torch.randint(0, 100, (64,)))


def test_rsqrt_learning_rate_is_edm2s():
    """lr_schedule='rsqrt': the warm-up, then α_ref / √max(t / t_ref, 1) (Karras et al. 2024), written out."""
    tc = ddpm.TrainerConfig(lr=1e-3, warmup_steps=100, lr_schedule="rsqrt", lr_decay_steps=400)
    assert ddpm.lr_at(49, tc) == pytest.approx(1e-3 * 50 / 100)
    for step, want in [(100, 1e-3), (400, 1e-3), (1600, 1e-3 / 2), (40_000, 1e-3 / 10)]:
        assert ddpm.lr_at(step, tc) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ddpm.UserError, match="lr_decay_steps"):
        ddpm.validate(ModelConfig(), ddpm.TrainerConfig(warmup_steps=500, lr_schedule="rsqrt",
                                                        lr_decay_steps=400))


@pytest.mark.parametrize("prediction", ["eps", "x", "v"])
def test_perfect_model_has_zero_loss(prediction):
    d = Diffusion(ModelConfig(prediction=prediction, timesteps=100))
    x0 = torch.rand(16, 3, 4, 4, dtype=torch.float64)
    losses, _ = d.loss(lambda z, t, y: d.target(x0, noise_of(d, x0, z, t), t), x0)
    assert losses.shape == (16,) and losses.max().item() < 1e-10


def test_timestep_sequence():
    d = Diffusion(ModelConfig(timesteps=1000))
    assert d.timestep_sequence() == list(range(999, -1, -1))
    seq = d.timestep_sequence(10)
    assert len(seq) == 10 and seq[0] == 999 and seq[-1] == 0 and seq == sorted(seq, reverse=True)


def eps_model(z, t, y):  # an arbitrary smooth deterministic "network"
    return 0.3 * torch.tanh(z) * (t.view(-1, 1, 1, 1).to(z.dtype) + 1) / 50


def test_ddpm_matches_algorithm_2():
    """Our posterior-based ancestral step equals Ho et al. Algorithm 2 written out in float64."""
    for variance in ("large", "small"):
        d = Diffusion(ModelConfig(timesteps=50, reverse_variance=variance))
        shape = (4, 3, 4, 4)
        ours = sample(d, eps_model, shape, generator=torch.Generator().manual_seed(3), threshold="none")
        g = torch.Generator().manual_seed(3)
        b = d.betas
        ab = d.alpha_bar
        x = torch.randn(shape, generator=g).double()
        for t in range(49, -1, -1):
            eps = eps_model(x, torch.full((4,), t), None)
            sigma2 = b[t] if variance == "large" else (1 - ab[t - 1]) / (1 - ab[t]) * b[t] if t > 0 else 0
            noise = torch.randn(shape, generator=g).double() if t > 0 else 0
            x = (x - b[t] / (1 - ab[t]).sqrt() * eps) / (1 - b[t]).sqrt() + math.sqrt(sigma2) * noise
        torch.testing.assert_close(ours.double(), x.clamp(-1, 1), rtol=1e-4, atol=1e-4)


def test_ddim_matches_song_eq_12():
    d = Diffusion(ModelConfig(timesteps=100))
    shape = (4, 3, 4, 4)
    ours = sample(d, eps_model, shape, sampler="ddim", steps=10, generator=torch.Generator().manual_seed(5),
                  threshold="none")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).double()
    seq = d.timestep_sequence(10)
    ab = d.alpha_bar
    for i, t in enumerate(seq):
        a_prev = ab[seq[i + 1]] if i + 1 < len(seq) else torch.tensor(1.0, dtype=torch.float64)
        eps = eps_model(x, torch.full((4,), t), None)
        x0 = (x - (1 - ab[t]).sqrt() * eps) / ab[t].sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    torch.testing.assert_close(ours.double(), x.clamp(-1, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampler,steps,variance", [("ddpm", None, "small"), ("ddpm", None, "large"),
                                                    ("ddim", None, "large")])
def test_samplers_recover_gaussian_data(sampler, steps, variance):
    """With the exact denoiser of N(μ, s²) data, sampling over all T steps returns N(μ, s²).
    (DDIM at 50 steps contracts the std to ~0.18: discretisation error, which vanishes as steps -> T.)"""
    mu, s = 0.3, 0.2
    d = Diffusion(ModelConfig(prediction="x", reverse_variance=variance))

    def x0_model(z, t, y):  # E[x0 | z_t] for Gaussian data
        ab = d.alpha_bar[t].view(-1, 1, 1, 1).float()
        return mu + ab.sqrt() * s**2 / (ab * s**2 + 1 - ab) * (z - ab.sqrt() * mu)

    x = sample(d, x0_model, (20000, 1, 1, 1), sampler=sampler, steps=steps,
               generator=torch.Generator().manual_seed(0))
    assert x.mean().item() == pytest.approx(mu, abs=0.01)
    assert x.std().item() == pytest.approx(s, rel=0.05)


def test_sampler_determinism_and_guidance_identity():
    mc = tiny_model(num_classes=4)
    d = Diffusion(mc)
    calls = []

    def model(z, t, y):
        calls.append(len(z))
        return torch.sin(z + y.view(-1, 1, 1, 1).float())

    y = torch.arange(4)
    a = sample(d, model, (4, 3, 16, 16), sampler="ddim", steps=5, y=y,
               generator=torch.Generator().manual_seed(1))
    b = sample(d, model, (4, 3, 16, 16), sampler="ddim", steps=5, y=y, guidance=1.0,
               generator=torch.Generator().manual_seed(1))
    c = sample(d, model, (4, 3, 16, 16), sampler="ddim", steps=5, y=y,
               generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= -1 and a.max() <= 1
    assert set(calls) == {4}  # w = 1 never evaluates the unconditional branch
    calls.clear()
    sample(d, model, (4, 3, 16, 16), sampler="ddim", steps=5, y=y, guidance=2.0,
           generator=torch.Generator().manual_seed(1))
    assert set(calls) == {8}  # guided: conditional and null-class halves in one batch


def gaussian_denoiser(d, mu, s):
    def x0_model(z, t, y):  # E[x0 | z_t] for N(μ, s²) data
        ab = d.alpha_bar[t].view(-1, 1, 1, 1).to(z.dtype)
        return mu + ab.sqrt() * s**2 / (ab * s**2 + 1 - ab) * (z - ab.sqrt() * mu)
    return x0_model


def test_dpm_solver_at_20_steps_recovers_gaussian_data_like_ddpm_at_1000():
    mu, s = 0.3, 0.2
    d = Diffusion(ModelConfig(prediction="x"))
    model = gaussian_denoiser(d, mu, s)
    dpm = sample(d, model, (20000, 1, 1, 1), sampler="dpm++", steps=20,
                 generator=torch.Generator().manual_seed(0))
    ancestral = sample(d, model, (20000, 1, 1, 1), sampler="ddpm", generator=torch.Generator().manual_seed(0))
    for x in (dpm, ancestral):
        assert x.mean().item() == pytest.approx(mu, abs=0.01)
        assert x.std().item() == pytest.approx(s, rel=0.03)


def test_dpm_solver_matches_lu_et_al_written_out():
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2) in float64, on our λ-spaced timesteps."""
    d = Diffusion(ModelConfig(timesteps=200, prediction="x"))
    model = lambda z, t, y: 0.5 * torch.tanh(z) * (1 - t.view(-1, 1, 1, 1).to(z.dtype) / 400)  # noqa: E731
    shape = (3, 2, 4, 4)
    ours = sample(d, model, shape, sampler="dpm++", steps=12, threshold="none",
                  generator=torch.Generator().manual_seed(7))
    ts = d.timestep_sequence(12, spacing="logsnr")
    ab = d.alpha_bar
    alpha, sigma = ab.sqrt(), (1 - ab).sqrt()
    lam = torch.log(alpha / sigma)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).double()
    prev = None
    for i, t in enumerate(ts[:-1]):
        s = ts[i + 1]
        h = lam[s] - lam[t]
        x0 = model(x, torch.full((3,), t), None)
        if prev is None:
            D = x0
        else:
            r = prev[1] / h
            D = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * prev[0]
        x = sigma[s] / sigma[t] * x + alpha[s] * (1 - torch.exp(-h)) * D
        prev = (x0, h)
    x = model(x, torch.zeros(3, dtype=torch.long), None)
    torch.testing.assert_close(ours.double(), x.clamp(-1, 1), rtol=1e-4, atol=1e-4)


def test_first_dpm_solver_step_is_ddim():
    d = Diffusion(ModelConfig(timesteps=100))
    g = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    a = sample(d, eps_model, (2, 3, 4, 4), sampler="dpm++", steps=2, generator=g())
    b = sample(d, eps_model, (2, 3, 4, 4), sampler="ddim", steps=2, generator=g())
    torch.testing.assert_close(a, b)


def test_dynamic_thresholding_matches_its_definition():
    x0 = torch.stack([torch.linspace(-3, 3, 1000), torch.linspace(-0.5, 0.5, 1000)]).view(2, 1, 10, 100)
    out = dynamic_threshold(x0, 0.995)
    s = np.quantile(np.abs(x0[0].numpy()), 0.995)  # > 1: clip to ±s, then divide by s
    np.testing.assert_allclose(out[0].numpy(), np.clip(x0[0].numpy(), -s, s) / s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1], x0[1])  # s < 1 is raised to 1: in-range samples stay untouched
    assert out.abs().max() <= 1
    d = Diffusion(ModelConfig(prediction="x"))
    z, t = torch.randn(2, 1, 10, 100), torch.tensor([500, 500])
    x_hat, _ = d.predict_x0_eps(x0, z, t, threshold="dynamic")
    torch.testing.assert_close(x_hat, out)


def test_split_experts_train_and_sample_only_their_timesteps():
    from ddpm import SplitModel, split_timestep

    low = Diffusion(ModelConfig(split_timestep=300, split_part="low"))
    high = Diffusion(ModelConfig(split_timestep=300, split_part="high"))
    seen = {}
    for name, d in (("low", low), ("high", high)):
        _, seen[name] = d.loss(lambda z, t, y: torch.zeros_like(z), torch.zeros(4096, 1, 1, 1))
    assert seen["low"].max() == 299 and seen["low"].min() == 0
    assert seen["high"].min() == 300 and seen["high"].max() == 999
    # SNR threshold: S is the first t with SNR(t) < 0.25
    mc = ModelConfig(split_snr=0.25)
    S = split_timestep(mc)
    snr = low.alpha_bar / (1 - low.alpha_bar)
    assert snr[S] < 0.25 <= snr[S - 1]
    # routing: every t goes to the right expert, also within one mixed batch
    model = SplitModel(lambda z, t, y: torch.zeros_like(z), lambda z, t, y: torch.ones_like(z), 300)
    t = torch.arange(1000)
    out = model(torch.randn(1000, 1, 1, 1), t)
    assert torch.equal(out.view(-1), (t >= 300).float())
    calls = []
    routed = SplitModel(lambda z, t, y: calls.append(("low", t.max().item())) or torch.zeros_like(z),
                        lambda z, t, y: calls.append(("high", t.min().item())) or torch.zeros_like(z), 300)
    sample(high, routed, (2, 1, 2, 2), sampler="ddim", steps=10)
    assert all((part == "low") == (t < 300) for part, t in calls) and {p for p, _ in calls} == {"low", "high"}


def heun_closed_form(d, z, ts, mu, s):
    """What Heun approximates for N(μ, s²) data: the probability-flow ODE solved exactly from σ(ts[0]) to
    σ(ts[-1]), x(σ) - μ = (x_start - μ) √(s² + σ²)/√(s² + σ_start²) in x = z/√ᾱ, then x̂₀ = E[x₀ | x]
    there."""
    ab = d.alpha_bar
    var = lambda t: (1 - ab[t]) / ab[t]  # noqa: E731  σ(t)²
    x_start = z.double() / ab[ts[0]].sqrt()
    return mu + (x_start - mu) * s**2 / ((s**2 + var(ts[-1])).sqrt() * (s**2 + var(ts[0])).sqrt())


def test_heun_solves_the_gaussian_probability_flow_ode_to_second_order():
    """Karras et al. 2022 Algorithm 1 without churn: 2N - 1 network calls on N timesteps, and an error
    against the closed form that falls ~4x when the steps double (DDIM, first order: ~2x)."""
    mu, s, shape = 0.3, 0.2, (2000, 1, 1, 1)
    d = Diffusion(ModelConfig(prediction="x"))
    denoiser, errors = gaussian_denoiser(d, mu, s), {}
    for sampler in ("heun", "ddim"):
        for steps in (20, 40):
            calls = []
            model = lambda z, t, y: calls.append(1) or denoiser(z, t, y)  # noqa: E731
            x = sample(d, model, shape, sampler=sampler, steps=steps, threshold="none",
                       generator=torch.Generator().manual_seed(0))
            ts = d.timestep_sequence(steps, spacing=ddpm.SAMPLERS[sampler].spacing)
            exact = heun_closed_form(d, torch.randn(shape, generator=torch.Generator().manual_seed(0)), ts,
                                     mu, s)
            errors[sampler, steps] = (x.double() - exact.clamp(-1, 1)).abs().max().item()
            assert len(calls) == (2 * len(ts) - 1 if sampler == "heun" else len(ts))
    assert errors["heun", 40] < 0.02
    assert errors["heun", 20] / errors["heun", 40] > 3.5  # second order
    assert 1.6 < errors["ddim", 20] / errors["ddim", 40] < 2.5  # first order
    assert errors["heun", 40] < errors["ddim", 40] / 5


def test_karras_spacing_follows_eq_5():
    d = Diffusion(ModelConfig())
    ts = d.timestep_sequence(18, spacing="karras")
    assert ts[0] == 999 and ts[-1] == 0 and ts == sorted(set(ts), reverse=True)
    sigma = ((1 - d.alpha_bar) / d.alpha_bar).sqrt()
    hi, lo, rho = sigma[-1].item(), sigma[0].item(), 7
    want = [(hi ** (1 / rho) + i / 17 * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho for i in range(18)]
    got = sigma[ts].tolist()
    assert len(got) == 18 and all(abs(math.log(g / w)) < 0.1 for g, w in zip(got, want))


def test_a_registered_sampler_is_a_valid_choice_everywhere(monkeypatch):
    """One function and one entry: Diffusion.sample runs it and TrainerConfig.sampler accepts it."""
    def first_guess(d, denoise, z, ts, noise, eta):
        """Returns the first x̂₀: one network call."""
        return denoise(z, ts[0])[0]

    monkeypatch.setitem(ddpm.SAMPLERS, "first", ddpm.Sampler(first_guess, "time", "one call", 5, None))
    d = Diffusion(tiny_model())
    calls = []
    x = sample(d, lambda z, t, y: calls.append(1) or torch.zeros_like(z), (2, 3, 16, 16), sampler="first",
               steps=5, threshold="none")
    assert len(calls) == 1 and x.shape == (2, 3, 16, 16)
    ddpm.validate(tiny_model(), ddpm.TrainerConfig(sampler="first"))
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        sample(d, lambda z, t, y: z, (1, 3, 16, 16), sampler="nope")


def test_the_readme_sampler_table_is_the_registry():
    """README.md's sampler table lists exactly the registered samplers, each with its summary line."""
    import os

    from conftest import ROOT

    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme.split("| `--sampler` | default steps | eta | what |\n|---|---|---|---|\n", 1)[1]
    rows = {r[0]: r[1:] for r in re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \| (.+) \|$",
                                            table.split("\n\n", 1)[0], re.M)}

    def cells(s):
        return (str(s.steps) if s.steps else "all T", "none" if s.eta is None else f"{s.eta:g}", s.summary)
    assert rows == {name: cells(s) for name, s in ddpm.SAMPLERS.items()}
