"""The load's finite check (runtime.io.finite.is_finite, one ``aminmax`` reduction) against its reference,
``torch.isfinite(t).all()``, on random data of every float dtype a checkpoint holds, clean and with one NaN, +Inf or
-Inf at a random place."""

import pytest
import torch

from h3_blackwell.runtime.errors import CheckpointError
from h3_blackwell.runtime.io.finite import FiniteChecks, check_finite, is_finite

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


def test_batched_checks_name_the_first_bad_tensor_as_check_finite_does():
    """FiniteChecks reads flags back per flush: the error is the one check_finite raises for the first bad tensor
    queued, whichever later ones are bad too, and a clean batch passes. Random data, bad entries at random places."""
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        n = int(torch.randint(2, 40, (1,), generator=g))
        tensors = [(torch.randn(int(torch.randint(1, 200, (1,), generator=g)), generator=g) * 2).to(
            DTYPES[i % len(DTYPES)]) for i in range(n)]
        bad = sorted(set(int(i) for i in torch.randint(0, n, (trial % 3,), generator=g)))
        for i in bad:
            t = tensors[i]
            t.view(-1)[int(torch.randint(0, t.numel(), (1,), generator=g))] = float("nan")
        at = int(torch.randint(0, n, (1,), generator=g))  # packed bytes among them: never checked
        tensors.insert(at, torch.randint(0, 255, (7,), dtype=torch.uint8))
        bad = [i + (i >= at) for i in bad]
        checks = FiniteChecks(every=int(torch.randint(1, 50, (1,), generator=g)))
        expect = None
        if bad:
            with pytest.raises(CheckpointError) as want:
                check_finite(f"t{bad[0]}", tensors[bad[0]])
            expect = str(want.value)
        try:
            for i, t in enumerate(tensors):
                assert checks.add(f"t{i}", t) is t
            checks.flush()
            got = None
        except CheckpointError as e:
            got = str(e)
        assert got == expect, (trial, bad)


def test_batched_checks_read_back_at_their_count_and_byte_bounds():
    """What a queue keeps alive is bounded: a flush happens by itself at ``every`` tensors and at ``max_bytes``."""
    checks = FiniteChecks(every=4, max_bytes=1000)
    for i in range(3):
        checks.add(f"a{i}", torch.randn(10))
    assert len(checks._queued) == 3
    checks.add("a3", torch.randn(10))
    assert not checks._queued  # the 4th tensor flushed the queue
    checks.add("big", torch.randn(300))  # 1,200 bytes >= max_bytes
    assert not checks._queued
    bad = torch.randn(10)
    bad[3] = float("inf")
    checks.add("bad", bad)  # queued, not raised yet
    with pytest.raises(CheckpointError, match=r"'bad' .* found 0 NaN and 1 Inf"):
        checks.flush()
    assert not checks._queued
