"""First-Block Cache: threshold 0 changes nothing, a forced reuse adds exactly the cached residual, the
decision follows the relative-L1 rule against the last COMPUTED step."""

import math

import pytest
import torch

from h3_blackwell.runtime.errors import H3Error
from h3_blackwell.runtime.sampling.step_cache import FirstBlockCache


def _blocks(seed=0, dim=16, n=4):
    """Toy residual blocks that update x in place like the DiT blocks (x += f(x))."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(dim, dim, generator=g) / dim ** 0.5 for _ in range(n)]

    def block(w):
        return lambda x: x.add_(torch.tanh(x @ w.to(x.dtype)))

    first = block(ws[0])

    def rest(x):
        for w in ws[1:]:
            x = block(w)(x)
        return x

    return first, rest


def _trajectory(cache, steps=5, seed=1, dtype=torch.float32):
    """A toy sampler: x_{i+1} = x_i + 0.1 * (stack(x_i) - x_i); returns the final x."""
    first, rest = _blocks()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if cache is not None:
        cache.reset()
    for i in range(steps):
        inp = x.clone()
        out = rest(first(inp)) if cache is None else cache.run(i, inp, first, rest)
        x = x + 0.1 * (out - x)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threshold_zero_is_exactly_uncached(dtype):
    cache = FirstBlockCache(0.0)
    assert torch.equal(_trajectory(cache, dtype=dtype), _trajectory(None, dtype=dtype))
    assert cache.reused_steps == [] and sorted(cache.rel_l1) == [1, 2, 3, 4]
    assert all(v > 0 for v in cache.rel_l1.values())


def test_forced_reuse_adds_exactly_the_cached_residual():
    first, rest = _blocks()
    cache = FirstBlockCache(math.inf)
    g = torch.Generator().manual_seed(4)
    x0, x1 = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    # step 0 computes: the cache keeps rest's residual
    a0 = first(x0.clone())
    expected_cached = rest(a0.clone()) - a0
    out0 = cache.run(0, x0.clone(), first, rest)
    assert torch.equal(out0, rest(first(x0.clone())))
    # step 1 reuses: first block output plus exactly that residual, rest() not called
    calls = []

    def rest_spy(x):
        calls.append(1)
        return rest(x)

    out1 = cache.run(1, x1.clone(), first, rest_spy)
    assert calls == [] and cache.reused_steps == [1]
    assert torch.equal(out1, first(x1.clone()) + expected_cached)


def test_decision_compares_with_the_last_computed_step():
    """rel-L1 below the threshold reuses; the reference residual stays the last computed step's."""
    first = lambda x: x.add_(1.0)                      # noqa: E731  residual change exactly 1 everywhere
    rest = lambda x: x.mul_(2.0)                       # noqa: E731
    cache = FirstBlockCache(0.3)
    x = torch.ones(4, 4)
    cache.run(0, x.clone(), first, rest)               # computes, r1 = 1
    scaled = lambda f: (lambda x: x.add_(f))           # noqa: E731
    cache.run(1, x.clone(), scaled(1.2), rest)         # rel 0.2 < 0.3: reuse (reference stays 1)
    cache.run(2, x.clone(), scaled(1.25), rest)        # rel 0.25 vs step 0's r1: reuse
    cache.run(3, x.clone(), scaled(1.5), rest)         # rel 0.5: compute, reference becomes 1.5
    cache.run(4, x.clone(), scaled(1.6), rest)         # rel 0.0667 vs 1.5: reuse
    assert cache.reused_steps == [1, 2, 4]
    assert cache.rel_l1 == pytest.approx({1: 0.2, 2: 0.25, 3: 0.5, 4: 0.1 / 1.5})
    assert cache.summary()["reused_steps"] == [1, 2, 4]


def test_threshold_must_be_a_nonnegative_number():
    for bad in (-0.1, float("nan")):
        with pytest.raises(H3Error, match="threshold"):
            FirstBlockCache(bad)
