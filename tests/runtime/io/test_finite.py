"""The load's finite check (runtime.io.finite.is_finite, one ``aminmax`` reduction) against its reference,
``torch.isfinite(t).all()``, on random data of every float dtype a checkpoint holds, clean and with one NaN, +Inf or
-Inf at a random place."""

import pytest
import torch

from h3_blackwell.runtime.errors import CheckpointError
from h3_blackwell.runtime.io.finite import check_finite, is_finite

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def _reference(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.to(torch.float32) if t.element_size() == 1 else t).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_is_finite_equals_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        shape = (int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g)))
        t = (torch.randn(shape, generator=g) * 3).to(dtype)
        bad = (None, float("nan"), float("inf"), float("-inf"))[trial % 4]
        if dtype == torch.float8_e4m3fn and bad in (float("inf"), float("-inf")):
            continue  # e4m3fn has NaN but no Inf
        if bad is not None:
            t.view(-1)[int(torch.randint(0, t.numel(), (1,), generator=g))] = bad
        assert is_finite(t) == _reference(t) == (bad is None), (dtype, shape, bad)
        if bad is None:
            assert check_finite("w", t) is t
        else:
            with pytest.raises(CheckpointError, match=r"'w' .* must be finite; found [01] NaN and [01] Inf"):
                check_finite("w", t)


def test_all_nan_and_mixed_infinities_and_non_float_dtypes():
    assert not is_finite(torch.full((4, 4), float("nan"), dtype=torch.bfloat16))
    assert not is_finite(torch.tensor([float("inf"), float("-inf")]))
    assert is_finite(torch.tensor([torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16))  # large, not infinite
    assert is_finite(torch.empty(0)) and is_finite(torch.randint(0, 255, (9,), dtype=torch.uint8))
    assert is_finite(torch.tensor(1.5)) and not is_finite(torch.tensor(float("nan")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_is_finite_on_the_device_equals_the_reference(dtype):
    """The load checks device tensors (block linears read onto the card) with the same reduction."""
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(4096, 1024, generator=g) * 3).to(dtype).cuda()
    assert is_finite(t) and _reference(t)
    for bad in (float("nan"),) + (() if dtype == torch.float8_e4m3fn else (float("inf"), float("-inf"))):
        u = t.clone()
        u.view(-1)[int(torch.randint(0, u.numel(), (1,), generator=g))] = bad
        assert not is_finite(u) and not _reference(u), (dtype, bad)
