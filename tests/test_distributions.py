"""runtime.distributions: ``torch.distributions`` of each instance's parameters, held as one distribution over the
batch under ``recompile.vmap``: values and gradients as eager's loop of instances (draws: their distribution), no
op once per instance; what the batch's distribution does not answer, each instance's own does."""

import pytest
import torch
from torch import distributions as D

import recompile
from recompile import config
from recompile.runtime import distributions
from test_segments import switched

F64 = torch.float64
W = torch.linspace(-1.0, 1.0, 12, dtype=F64).view(3, 4)


def normal_log_prob(x):
    d = D.Normal(x, x.exp())
    return d.log_prob(x * 0.5).sum() + d.entropy().sum() + d.mean.sum() + d.stddev.sum()


def normal_shared_scale(x):
    return D.Normal(x, 2.0).log_prob(torch.zeros(4, dtype=F64)).sum() + D.Laplace(0.0, x.exp()).cdf(x).sum()


def categorical(x):
    d = D.Categorical(logits=W @ x)
    return d.log_prob(torch.tensor(2)) + d.entropy() + d.probs[0]


def categorical_of_each_action(x):
    d = D.Categorical(logits=x)
    action = (x * 10).long().clamp(0, 3)[0]
    return d.log_prob(action) * d.logits.sum()


def two_parameters_of_their_own_ranks(x):
    return D.Normal(x[0], x.exp()).log_prob(x).sum()  # (a 0-d loc, a (4,) scale: broadcast within the instance)


def kl_between(x):
    p, q = D.Normal(x, 1.0 + x * x), D.Normal(x * 0.5, 2.0 + x)
    return D.kl_divergence(p, q).sum() + D.kl_divergence(D.Categorical(logits=x), D.Categorical(logits=-x))


def in_a_branch(x):
    d = D.Normal(x, 1.0 + x * x)
    if x.sum() > 0:
        out = d.log_prob(x + 1.0).sum()
    else:
        out = d.entropy().sum() * 2.0
    return out + d.batch_shape[0]


def handed_to_python(x):
    d = D.Normal(x, 1.0 + x * x)
    return tail(d) + d.scale.sum()


def tail(d):
    return d.variance.sum() * 0 + d.icdf(torch.full((4,), 0.25, dtype=F64)).sum()


BATCHED = [normal_log_prob, normal_shared_scale, categorical, categorical_of_each_action,
           two_parameters_of_their_own_ranks, kl_between, in_a_branch]


@pytest.mark.parametrize("fn", BATCHED + [handed_to_python], ids=lambda f: f.__name__)
def test_a_distribution_of_each_instances_parameters_gives_eagers_values_and_gradients(fn):
    x = torch.linspace(-0.9, 1.3, 24, dtype=F64).view(6, 4).requires_grad_()
    want = torch.stack([fn(v) for v in x])
    if fn in BATCHED:
        with switched(config, "error", "PER_INSTANCE"):  # (no op once per instance)
            got = recompile.vmap(recompile.function(fn))(x)
    else:  # (a helper reads each instance's own distribution: it runs per instance, with eager's values)
        got = recompile.vmap(recompile.function(fn))(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])


def policy(h, steps):
    logp = torch.zeros((), dtype=F64)
    actions = []
    for t in range(steps):
        d = D.Categorical(logits=W @ h)
        a = d.sample()
        logp = logp + d.log_prob(a)
        h = torch.tanh(h + a * 0.1)
        actions.append(a)
    return logp, torch.stack(actions)


def test_sampling_draws_every_instances_action_at_once_and_scores_it():
    torch.manual_seed(0)
    h = torch.randn(3000, 4, dtype=F64, requires_grad=True)
    with switched(config, "error", "PER_INSTANCE"):
        logp, actions = recompile.vmap(recompile.function(policy), in_dims=(0, None))(h, 3)
    assert actions.shape == (3000, 3) and actions.dtype is torch.long
    # (each step's draws follow each instance's probabilities: the first step's, averaged, against theirs)
    probs = torch.softmax(h.detach() @ W.t(), -1)
    counts = torch.bincount(actions[:, 0], minlength=3).double() / 3000
    torch.testing.assert_close(counts, probs.mean(0), atol=0.03, rtol=0)
    # (the scores are eager's of the actions drawn: replay each instance's actions eagerly)
    want = []
    for k in range(6):
        hk, total = h[k], torch.zeros((), dtype=F64)
        for t in range(3):
            d = D.Categorical(logits=W @ hk)
            total = total + d.log_prob(actions[k, t])
            hk = torch.tanh(hk + actions[k, t] * 0.1)
        want.append(total)
    torch.testing.assert_close(logp[:6], torch.stack(want))
    assert torch.autograd.grad(logp.sum(), h)[0].abs().sum() > 0


def reparameterized(x):
    d = D.Normal(x, 0.5 + x * x)
    return d.rsample((2,)).mean(0)


def test_rsample_draws_for_every_instance_with_a_gradient_through_its_parameters():
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)
    with switched(config, "error", "PER_INSTANCE"):
        y = recompile.vmap(recompile.function(reparameterized))(x)
    assert y.shape == (5, 4)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.abs().sum() > 0


def changed_after(x):
    loc = x * 1.0
    d = D.Normal(loc, 1.0)
    loc.add_(1.0)  # (the run changes values in place: each instance makes its own distribution, which sees it)
    return d.log_prob(x).sum()


def test_in_a_run_that_changes_values_in_place_each_instance_makes_its_own():
    x = torch.randn(4, 3, dtype=F64)
    got = recompile.vmap(recompile.function(changed_after))(x)
    torch.testing.assert_close(got, torch.stack([changed_after(v) for v in x]))


def test_bad_parameters_raise_as_eager_does():
    x = -torch.ones(3, 2, dtype=F64)
    with pytest.raises(ValueError, match="scale"):
        recompile.vmap(recompile.function(negative_scale))(x)


def negative_scale(x):
    return D.Normal(x, x).log_prob(x)


def test_the_rule_table_covers_the_methods():
    assert distributions.METHODS == {"log_prob", "cdf", "icdf", "entropy", "perplexity", "sample", "rsample"}


def kl_of_other_ranks(x):
    return D.kl_divergence(D.Normal(x[0], 1.0), D.Normal(x, 2.0))  # (batch shapes () and (4,): broadcast)


def temperature_kept(x):
    d = D.RelaxedBernoulli(x[0].exp(), logits=x)  # (its temperature kept as given: each instance's 0-d)
    return d.temperature * d.probs


@pytest.mark.parametrize("fn", [kl_of_other_ranks, temperature_kept], ids=lambda f: f.__name__)
@pytest.mark.parametrize("n", [3, 4])
def test_what_the_batchs_distribution_would_line_up_otherwise_is_each_instances(fn, n):
    x = torch.linspace(-0.9, 1.3, 4 * n, dtype=F64).view(n, 4)
    got = recompile.vmap(recompile.function(fn))(x)
    torch.testing.assert_close(got, torch.stack([fn(v) for v in x]))


TRIL = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 1.0, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0], [0.1, 0.0, 0.3, 1.5]],
                    dtype=F64)


def diagonal_gaussian(x):
    d = D.Independent(D.Normal(x, 0.5 + x * x), 1)
    return d.log_prob(x * 0.5) + d.entropy() + d.mean.sum()


def full_gaussian(x):
    d = D.MultivariateNormal(x, scale_tril=TRIL * (1.0 + x[0] * x[0]))
    return d.log_prob(torch.zeros(4, dtype=F64)) + d.entropy()


def full_gaussian_shared_covariance(x):
    d = D.MultivariateNormal(x, covariance_matrix=TRIL @ TRIL.t())
    return d.log_prob(x * 2.0) + D.kl_divergence(d, D.MultivariateNormal(x * 0.5, covariance_matrix=TRIL @ TRIL.t()))


def low_rank(x):
    return D.LowRankMultivariateNormal(x, x.view(4, 1), 1.0 + x * x).log_prob(x * 0.5)


def independent_in_a_branch(x):
    d = D.Independent(D.Normal(x, 1.0 + x * x), 1)
    if x.sum() > 0:
        return d.log_prob(x)
    return d.entropy()


@pytest.mark.parametrize("fn", [diagonal_gaussian, full_gaussian, full_gaussian_shared_covariance, low_rank,
                                independent_in_a_branch], ids=lambda f: f.__name__)
def test_distributions_of_events_give_eagers_values_and_gradients(fn):
    x = torch.linspace(-0.9, 1.3, 24, dtype=F64).view(6, 4).requires_grad_()
    want = torch.stack([fn(v) for v in x])
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(recompile.function(fn))(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
