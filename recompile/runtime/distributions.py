"""``torch.distributions`` of each instance's parameters, held as one distribution over the batch.

``d = Categorical(logits=self.out(h))``, then ``d.sample()``, ``d.log_prob(a)``, ``d.entropy()``: eager code makes a
distribution object per instance and calls its methods one instance at a time. In a run that changes nothing in
place, the batch's instances' distributions are held as one distribution of the same class whose parameters are
the batch's (``Batched``): each instance's parameters one row, their dims lined up so that torch's broadcasting
within an instance stays within it. Its methods and its tensor attributes are one call for the batch:
``log_prob`` / ``cdf`` / ``icdf`` of each instance's value (or a shared one), ``entropy()``, ``sample()`` /
``rsample()`` (every instance's draw at once: each independent of the others, as eager's), ``mean``, ``stddev``,
``probs``, ... and ``torch.distributions.kl_divergence`` of two such. Anything else (another method, the object
handed to Python code) makes each instance's own distribution from its own parameters, as eager does
(``fill``), and runs per instance.
"""

from __future__ import annotations

import torch
from torch import distributions as D

from ..ops.table import by_names
from . import batch as bt
from . import sharing
from .batch import Batch

# the classes whose parameters are alike: each of the distribution's shape (one of them its event's last dim too: a
# Categorical's classes), broadcast against each other element by element
CLASSES = (D.Normal, D.LogNormal, D.Laplace, D.Cauchy, D.Gumbel, D.Uniform, D.Bernoulli, D.Categorical,
           D.OneHotCategorical, D.Beta, D.Gamma, D.Exponential, D.Poisson, D.Geometric, D.Binomial, D.StudentT,
           D.ContinuousBernoulli, D.RelaxedBernoulli, D.Dirichlet, D.Chi2,
           D.HalfNormal, D.HalfCauchy, D.VonMises, D.Kumaraswamy, D.Weibull)
# methods of a value the instance's distribution scores, of no argument, and of a sample shape
VALUE_METHODS = frozenset({"log_prob", "cdf", "icdf"})
PLAIN_METHODS = frozenset({"entropy", "perplexity"})
DRAWING_METHODS = frozenset({"sample", "rsample"})
METHODS = VALUE_METHODS | PLAIN_METHODS | DRAWING_METHODS


class Batched(list):
    """The distributions of n instances: ``dist``, one of class ``cls`` over the batch (instance k's parameters its
    row k), made from the call's arguments ``args`` / ``kwargs`` (plain, or batches); the list holds each instance's
    own distribution once ``fill`` made them (until then, None for each)."""

    __slots__ = ("dist", "cls", "args", "kwargs", "made", "make")

    def __init__(self, dist, cls, args, kwargs, make):
        n = dist.batch_shape[0]
        super().__init__([None] * n)
        self.dist, self.cls, self.args, self.kwargs = dist, cls, args, kwargs
        self.make = make  # (the rule that built it: ``taken`` builds a part of it so)
        self.made = False

    @property
    def lengths(self):
        return [1] * len(self)  # (``bt.Views`` counts the instances by it: one distribution each)

    def fill(self):
        """Make each instance's own distribution, from its own parameters (the object eager code holds)."""
        if not self.made:
            self[:] = [self.cls(*[bt.instance(a, k) for a in self.args],
                                **{key: bt.instance(v, k) for key, v in self.kwargs.items()}) for k in range(len(self))]
            self.made = True
        return self

    def taken(self, positions):
        """The distributions of instances ``positions`` (a branch's side, a loop's instances that stay)."""
        positions = list(positions)
        index = torch.tensor(positions)
        args = [bt.take(a, index, positions) for a in self.args]
        kwargs = {key: bt.take(v, index, positions) for key, v in self.kwargs.items()}
        made = self.make(len(positions), self.cls, args, kwargs)
        return made.thunk.held if made is not NotImplemented else [self.fill()[k] for k in positions]


def of(value):
    """The ``Batched`` distributions Batch ``value`` holds, in a run that changes nothing in place, else None."""
    return bt.held(value, Batched)


def build(n, cls, args, kwargs):
    """``cls(*args, **kwargs)`` with some parameters the batch's: one distribution over the batch (``Batched``), in
    a run that changes nothing in place and where every batched parameter is a tensor of rows; else
    NotImplemented (each instance makes its own)."""
    if not sharing.state.fresh:
        return NotImplemented
    values = list(args) + list(kwargs.values())
    tensors = [bt.tensor_of(v) if type(v) is Batch else None for v in values]
    if any(type(v) is Batch and t is None for v, t in zip(values, tensors)):
        return NotImplemented
    rank = max([t.dim() - 1 for t in tensors if t is not None] +
               [v.dim() for v, t in zip(values, tensors) if t is None and isinstance(v, torch.Tensor)])
    lined = [_lined_up(t, rank) if t is not None else v.reshape((1,) * (rank - v.dim() + 1) + v.shape)
             if isinstance(v, torch.Tensor) else v for v, t in zip(values, tensors)]
    dist = cls(*lined[:len(args)], **dict(zip(kwargs, lined[len(args):])))
    if len(dist.batch_shape) == 0 or dist.batch_shape[0] != n:
        return NotImplemented  # (the batch's dim taken for an event's: each instance makes its own)
    return Batch(n, thunk=bt.Views(Batched(dist, cls, list(args), dict(kwargs), build), True))


# classes whose parameters have event dims of their own (a mean's one, a covariance's two): each parameter's
# name, in order, and its event dims
EVENT_PARAMETERS = {
    D.MultivariateNormal: {"loc": 1, "covariance_matrix": 2, "precision_matrix": 2, "scale_tril": 2,
                           "validate_args": None},
    D.LowRankMultivariateNormal: {"loc": 1, "cov_factor": 2, "cov_diag": 1, "validate_args": None},
}


def build_with_events(n, cls, args, kwargs):
    """``MultivariateNormal(loc, scale_tril=...)`` (``EVENT_PARAMETERS``) with some parameters the batch's: one
    distribution over the batch, where every batched parameter has as many batch dims of its own beyond its event
    dims as the others (each instance's broadcast as the batch's), in a run that changes nothing in place."""
    ranks = EVENT_PARAMETERS[cls]
    given = by_names(args, kwargs, tuple(ranks))
    if not sharing.state.fresh or given is None:
        return NotImplemented
    own, shared = set(), set()
    values = {}
    for name, v in given.items():
        if type(v) is Batch:
            t = bt.tensor_of(v)
            if t is None or ranks[name] is None:
                return NotImplemented
            own.add(t.dim() - 1 - ranks[name])
            values[name] = t
        else:
            values[name] = v
            if isinstance(v, torch.Tensor) and ranks[name] is not None:
                shared.add(v.dim() - ranks[name])
    if len(own) != 1 or any(k > min(own) for k in shared):
        return NotImplemented  # (each instance's of its own batch dims: broadcast each by each)
    dist = cls(**values)
    if len(dist.batch_shape) == 0 or dist.batch_shape[0] != n:
        return NotImplemented
    return Batch(n, thunk=bt.Views(Batched(dist, cls, [], dict(given), build_with_events), True))


def independent(n, cls, args, kwargs):
    """``Independent(d, k)`` of each instance's distribution d (the batch's): the batch's, its last k batch dims
    an event's, where the batch's own dim stays a batch dim."""
    found = by_names(args, kwargs, ("base_distribution", "reinterpreted_batch_ndims", "validate_args"))
    base = of(found.get("base_distribution")) if found is not None else None
    k = found.get("reinterpreted_batch_ndims") if found is not None else None
    if base is None or type(k) is not int or not 0 <= k < len(base.dist.batch_shape) or \
            type(found.get("validate_args")) is Batch:
        return NotImplemented
    dist = cls(base.dist, k, found.get("validate_args"))
    return Batch(n, thunk=bt.Views(Batched(dist, cls, list(args), dict(kwargs), independent), True))


def _lined_up(t, rank):
    """Rows ``t`` (n, *shape) with ones before an instance's shape up to ``rank`` dims: broadcasting within an
    instance, as eager's."""
    return t.reshape(t.shape[:1] + (1,) * (rank - t.dim() + 1) + t.shape[1:])


# tensor attributes of the distribution's shape (its parameters broadcast against each other as each instance's
# are, or its statistics): each instance's row of the batch's (not a parameter kept as given: a temperature)
ATTRIBUTES = frozenset({"mean", "mode", "stddev", "variance", "loc", "scale", "probs", "logits", "rate",
                        "concentration", "concentration0", "concentration1", "low", "high", "df", "total_count"})


def attribute(n, found, name):
    """``d.name`` of each instance's distribution, not a method: a tensor attribute of the batch's (``mean``,
    ``probs``: each instance's row), its shapes, or NotImplemented."""
    if name in ("batch_shape", "event_shape"):
        shape = getattr(found.dist, name)
        return shape[1:] if name == "batch_shape" else shape
    if name not in ATTRIBUTES:
        return NotImplemented
    try:
        value = getattr(found.dist, name)
    except (AttributeError, NotImplementedError):
        return NotImplemented
    dist = found.dist
    shapes = (dist.batch_shape + dist.event_shape, getattr(dist, "param_shape", None))  # (a Categorical's classes)
    return bt.from_tensor(value) if isinstance(value, torch.Tensor) and value.shape in shapes else NotImplemented


def method_rule(name):
    """The batch rule of method ``name`` of each instance's distribution (``method``)."""

    def rule(n, base, args, kwargs):
        found = of(base)
        return NotImplemented if found is None else method(n, found, name, args, kwargs)

    return rule


def method(n, found, name, args, kwargs):
    """``d.name(*args, **kwargs)`` for every instance at once, or NotImplemented."""
    dist = found.dist
    if name in PLAIN_METHODS:
        return bt.from_tensor(getattr(dist, name)()) if not args and not kwargs else NotImplemented
    if name in DRAWING_METHODS:
        shape = args[0] if len(args) == 1 and not kwargs else kwargs.get("sample_shape", torch.Size()) \
            if set(kwargs) <= {"sample_shape"} and not args else None
        if shape is None or type(shape) not in (tuple, list, torch.Size) or any(type(k) is not int for k in shape):
            return NotImplemented
        drawn = getattr(dist, name)(torch.Size(shape))
        return bt.from_tensor(drawn.movedim(len(shape), 0))  # (the batch's dim first: each instance's draws)
    if kwargs or len(args) != 1:
        return NotImplemented
    value = args[0]
    rank = len(dist.batch_shape) + len(dist.event_shape) - 1
    if type(value) is Batch:
        t = bt.tensor_of(value)
        if t is None or t.dim() - 1 > rank:
            return NotImplemented  # (a value of more dims than the instance's: its sample dims, broadcast by each)
        value = _lined_up(t, rank)
    elif isinstance(value, torch.Tensor) and value.dim() > rank:
        return NotImplemented
    return bt.from_tensor(getattr(dist, name)(value))


def kl(n, fn, args, kwargs):
    """``kl_divergence(p, q)`` of two batches of distributions: one call on the batch's."""
    found = [of(a) for a in args]
    if kwargs or len(args) != 2 or None in found or len(found[0].dist.batch_shape) != len(found[1].dist.batch_shape):
        return NotImplemented  # (instances' distributions of other ranks broadcast each by each: their own calls)
    return bt.from_tensor(fn(found[0].dist, found[1].dist))
