"""runtime.fallbacks: why an op ran once per instance, and what to write instead."""

import operator

import pytest
import torch

import recompile
from recompile.runtime import fallbacks


@pytest.mark.parametrize("fn, why", [(operator.iadd, fallbacks.WRITES), (operator.imul, fallbacks.WRITES),
                                     (slice, fallbacks.UNVMAPPABLE), (float, fallbacks.PYTHON_VALUE),
                                     (len, fallbacks.PYTHON), (operator.getitem, fallbacks.PYTHON)],
                         ids=lambda v: getattr(v, "__name__", "why"))
def test_each_reason_says_what_to_write_instead(fn, why):
    assert fallbacks.reason(fn) is why


def prefix(x, k):
    return x[:k]  # a shape of each instance's own


def test_a_per_instance_slice_is_told_apart_from_python_code():
    f = recompile.function(prefix)
    with pytest.warns(recompile.PerInstanceWarning, match="slice runs once per instance.*shape that depends on "
                      "the values") as seen, pytest.raises(ValueError) as info:
        recompile.vmap(f)(torch.ones(3, 4), torch.tensor([1, 2, 3]))
    assert all("compile it with @recompile.function" not in str(w.message) for w in seen if "slice" in str(w.message))
    # (the results differ in shape: vmap says which)
    assert "Tensor(1,) float32, Tensor(2,) float32, Tensor(3,) float32" in str(info.value)
