"""Bits per dimension against closed forms derived by hand, for a model that knows x0."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from ddpm import Diffusion, ModelConfig
from evaluate import bpd, bpd_estimate, discretized_gaussian_log_likelihood, normal_kl


def eight_bit(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, shape, generator=g).double() / 127.5 - 1
    x.view(-1)[:2] = torch.tensor([-1.0, 1.0])  # make sure both edge bins occur
    return x


def oracle(d, x0):
    """A network that returns the exact target for x0 (it 'knows x0')."""
    def model(z, t, y):
        z = z.double()
        a, s = d.alpha_bar[t].sqrt().view(-1, 1, 1, 1), (1 - d.alpha_bar[t]).sqrt().view(-1, 1, 1, 1)
        return d.target(x0, (z - a * x0) / s, t)
    return model


def decoder_nats(x, std):
    """-log P(bin) for each pixel, written with scipy: interior bins, and the open edge bins."""
    x = x.numpy()
    upper = np.where(x > 0.999, 1.0, norm.cdf((1 / 255) / std))
    lower = np.where(x < -0.999, 0.0, norm.cdf((-1 / 255) / std))
    return -np.log(upper - lower)


@pytest.mark.parametrize("prediction", ["eps", "x", "v"])
def test_bpd_of_a_model_that_knows_x0_small_variance(prediction):
    d = Diffusion(ModelConfig(timesteps=50, prediction=prediction, reverse_variance="small"))
    x0 = eight_bit((3, 3, 4, 4))
    got = bpd(d, oracle(d, x0), x0, threshold="none", generator=torch.Generator().manual_seed(0))
    ab_T = d.alpha_bar[-1].item()
    # L_T per dim: KL(N(√ᾱ_T x, 1-ᾱ_T) || N(0, 1)) = ½(-log(1-ᾱ_T) + (1-ᾱ_T) + ᾱ_T x² - 1)
    prior = 0.5 * (-math.log(1 - ab_T) + (1 - ab_T) + ab_T * x0.numpy() ** 2 - 1)
    # every L_{t-1} is 0 (same means, same variances); L_0 is the decoder at exactly x0 with var β̃_2
    std = math.sqrt(d.posterior_variance[1].item())
    nats = (prior + decoder_nats(x0, std)).reshape(3, -1).sum(1)
    np.testing.assert_allclose(got.numpy(), nats / (48 * math.log(2)), rtol=1e-6)
    # nats versus bits: bits/dim x D x ln 2 = nats
    np.testing.assert_allclose(got.numpy() * 48 * math.log(2), nats, rtol=1e-6)


def test_bpd_large_variance_adds_the_variance_mismatch_of_every_step():
    d = Diffusion(ModelConfig(timesteps=50, prediction="x", reverse_variance="large"))
    small = Diffusion(ModelConfig(timesteps=50, prediction="x", reverse_variance="small"))
    x0 = eight_bit((2, 3, 4, 4), seed=1)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    extra = bpd(d, oracle(d, x0), x0, generator=g()) - bpd(small, oracle(small, x0), x0, generator=g())
    bt, bs = d.betas[1:].numpy(), d.posterior_variance[1:].numpy()
    per_dim = 0.5 * (np.log(bt / bs) + bs / bt - 1)  # KL(N(μ, β̃_t) || N(μ, β_t)) for t = 2..T
    np.testing.assert_allclose(extra.numpy(), per_dim.sum() / math.log(2), rtol=1e-6)


def test_discretized_likelihood_and_kl_helpers():
    x = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
    mean = torch.tensor([-0.9, 0.01, 0.95], dtype=torch.float64)
    got = discretized_gaussian_log_likelihood(x, mean, 0.01).numpy()
    ref = np.log([norm.cdf((-1 + 1 / 255 + 0.9) / 0.1),
                  norm.cdf((1 / 255 - 0.01) / 0.1) - norm.cdf((-1 / 255 - 0.01) / 0.1),
                  1 - norm.cdf((1 - 1 / 255 - 0.95) / 0.1)])
    np.testing.assert_allclose(got, ref, rtol=1e-9)
    kl = normal_kl(torch.tensor(0.3, dtype=torch.float64), 0.5, torch.tensor(-0.2, dtype=torch.float64),
                   2.0).item()
    assert kl == pytest.approx(math.log(2 / 0.5) / 2 + (0.5 + 0.25) / 4 - 0.5, rel=1e-12)


def test_a_worse_model_has_more_bits():
    d = Diffusion(ModelConfig(timesteps=50, prediction="x"))
    x0 = eight_bit((2, 3, 4, 4), seed=2)
    good = bpd(d, oracle(d, x0), x0, generator=torch.Generator().manual_seed(0))
    bad = bpd(d, lambda z, t, y: torch.zeros_like(z), x0, generator=torch.Generator().manual_seed(0))
    assert (bad > good + 0.5).all()


def test_stratified_estimate_is_exact_where_the_terms_vanish_and_close_elsewhere():
    d = Diffusion(ModelConfig(timesteps=100, prediction="x", reverse_variance="small"))
    x0 = eight_bit((2, 3, 4, 4), seed=3)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    exact = bpd(d, oracle(d, x0), x0, generator=g())
    est, se = bpd_estimate(d, oracle(d, x0), x0, strata=10, generator=g())
    torch.testing.assert_close(est, exact, rtol=1e-9, atol=1e-9)  # every KL term is 0: no sampling error
    assert (se < 1e-9).all()

    def blurry(z, t, y):  # an imperfect model: the KL terms now vary with t
        return 0.8 * oracle(d, x0)(z, t, y)

    exact = bpd(d, blurry, x0, generator=g())
    est, se = bpd_estimate(d, blurry, x0, strata=20, generator=g())  # 41 calls instead of 100
    assert (se > 0).all()
    assert ((est - exact).abs() < 4 * se + 1e-3).all()


def test_reported_standard_error_matches_the_spread_over_repeats():
    """The s.e. of a batch's mean bits/dim, combined from the images' s.e. as independent errors, against the
    standard deviation of that mean over repeated estimates (shared timesteps made it ~4x too small here)."""
    d = Diffusion(ModelConfig(timesteps=100, prediction="x", reverse_variance="small"))
    x0 = eight_bit((16, 3, 4, 4), seed=4)
    g = torch.Generator().manual_seed(0)
    means, reported = [], []
    for _ in range(80):
        est, se = bpd_estimate(d, lambda z, t, y: 0.8 * oracle(d, x0)(z, t, y), x0, strata=5, generator=g)
        means.append(est.mean().item())
        reported.append((se**2).sum().sqrt().item() / len(x0))
    ratio = np.sqrt(np.mean(np.square(reported))) / np.std(means, ddof=1)
    assert 0.7 < ratio < 1.4, ratio
