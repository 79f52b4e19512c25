"""Blackwell attention entries on a real GPU (run: python3 -m pytest -m gpu tests/gpu/test_blackwell_guards.py -s).

Needs CUDA; skipped otherwise. On a device that is not a backend's target (sage3: sm_120/sm_121; fa4: sm_100/
sm_103), its guard must refuse with the capability reason, import nothing and make bind raise that reason: on
the H200 (sm_90) that is all that runs. On the target architecture with the package importable (sageattn3 built
from SageAttention's sageattention3_blackwell/; ``pip install flash-attn-4``), the real kernel runs on strided
views of a fused qkv buffer: within TOLERANCE of the fp32 reference, the caller's buffer unchanged, and compared
with the emulation (sage3: much closer to its emulation than to the reference, since both quantize the same
values the same way; fa4: within tolerance of its emulation). -s prints the measured values. No timing here.
"""

import pytest
import torch

from h3_blackwell.runtime.ops import blackwell_attention as B
from h3_blackwell.runtime.ops.attention import exact_attention_reference, qkv_views, rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else None
ARCHS = {"sage3": B.SAGE3_ARCHS, "fa4": B.FA4_ARCHS}
WHAT = {"sage3": "SageAttention3 FP4 kernels", "fa4": "FlashAttention-4 SM100 kernels"}


def _cc():
    return tuple(torch.cuda.get_device_capability(DEV))


def _qkv(s, h, d, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(s, 3 * h * d, generator=g, device=DEV, dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["sage3", "fa4"])
def test_guard_refuses_off_target_architecture_without_importing(name, monkeypatch):
    cc = _cc()
    if cc in ARCHS[name]:
        pytest.skip(f"sm_{cc[0]}{cc[1]} is {name}'s target")
    imported = []
    monkeypatch.setattr(B, "_import", lambda mod: imported.append(mod))
    check, bind, _ = B.BLACKWELL_BACKENDS[name]
    names = "/".join(f"sm_{a}{b}" for a, b in ARCHS[name])
    expected = f"{name}: needs {names} ({WHAT[name]}); this device is sm_{cc[0]}{cc[1]}"
    for dev in (DEV, torch.device("cuda"), "cuda:0"):
        assert check(dev, 128, torch.bfloat16) == (False, expected)
    with pytest.raises(RuntimeError) as e:
        bind(DEV, 128)
    assert str(e.value) == expected
    assert imported == []
    print(f"\n{name} on sm_{cc[0]}{cc[1]}: {expected}")


def _run_target(name, s, h, d, seed, scale=None, offset=0.0):
    check, bind, emulate = B.BLACKWELL_BACKENDS[name]
    ok, why = check(DEV, d, torch.bfloat16)
    if not ok:
        pytest.skip(why)
    qkv = _qkv(s, h, d, seed)
    if offset:
        qkv = (qkv.float() + offset).to(torch.bfloat16)
    before = qkv.clone()
    q, k, v = qkv_views(qkv, h, d)
    out = bind(DEV, d, scale)(q, k, v)
    torch.cuda.synchronize()
    assert out.shape == (1, s, h, d) and out.dtype == torch.bfloat16
    assert torch.equal(qkv, before), f"{name} changed the caller's qkv buffer"
    ref = exact_attention_reference(q, k, v, scale=scale)
    emu = emulate(*(t.cpu() for t in (q, k, v)), scale=scale).reshape(s, -1).float()
    got = out.reshape(s, -1).float()
    return rel_l2(got, ref), rel_l2(got.cpu(), emu), rel_l2(emu, ref.cpu())


@pytest.mark.parametrize("name", ["sage3", "fa4"])
@pytest.mark.parametrize("s,h,d", [(300, 4, 128), (1024, 8, 128), (517, 4, 64), (2048, 2, 128)])
def test_kernel_vs_reference_and_emulation(name, s, h, d, record_property):
    err, to_emu, emu_err = _run_target(name, s, h, d, seed=s)
    tol, why = B.TOLERANCE[name]
    print(f"\n{name} S={s} H={h} D={d}: kernel vs ref {err:.4g}, kernel vs emulation {to_emu:.4g}, "
          f"emulation vs ref {emu_err:.4g} (tol {tol:g}: {why})")
    record_property("rel_l2", err)
    record_property("rel_l2_to_emulation", to_emu)
    assert err <= tol
    if name == "sage3":  # same FP4 codes on both sides: the kernel sits near its emulation, far from exact
        assert to_emu < 0.5 * err
    else:
        assert to_emu <= tol


@pytest.mark.parametrize("name", ["sage3", "fa4"])
def test_kernel_with_another_scale_and_k_offset(name):
    """A softmax scale other than D**-0.5 (sage3 folds it into q) and an offset on q/k/v (K's in-place mean
    subtraction inside SageAttention3 must not reach the caller's buffer)."""
    d = 128
    scale = 0.6 * d ** -0.5
    err, to_emu, _ = _run_target(name, 640, 4, d, seed=5, scale=scale, offset=0.5)
    print(f"\n{name} scale {scale:.4f}, offset 0.5: kernel vs ref {err:.4g}, vs emulation {to_emu:.4g}")
    assert err <= B.TOLERANCE[name][0]
