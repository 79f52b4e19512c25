"""The Fun ControlNet tower on a real GPU (run: python3 -m pytest -m gpu tests/gpu/test_control_gpu.py).

* The tiny model with a tower, bf16 on CUDA through the plan's fast stack (NVFP4 block linears, W4A8 on Hopper,
  the tower's linears quantized like the base's), against the fp32 dense reference on the CPU: the controlled
  output stays within the stack's usual bound of the reference, the tower's effect is seen, and the bf16 dense
  GPU evaluation is close to fp32 as well.
* With the base's attention sparse (LOSSY), the tower still runs its dense backend (core removes the sparse
  override for the tower): its ops are the base's with the dense attention bound.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.tiny_control import save_tiny_control  # noqa: E402

from h3_blackwell.runtime import RuntimeOptions, bind_control, conditioning_from_payload, load_control  # noqa: E402
from h3_blackwell.runtime import load_model  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CFG = TINY.replace(text_dim=64)


def _rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def _evaluate(rt, tower, case, with_control=True):
    video, audio, text, hint = case
    payload = {"control": {"hint": hint, "strength": 0.8, "sigma_start": 1.0, "sigma_end": 0.0}} \
        if with_control else {}
    cond = conditioning_from_payload(payload)
    with torch.no_grad():
        plan = rt.model.plan(text, video.shape, audio.shape, [0.8], cond=cond)
        if with_control:
            sparse = getattr(rt, "sparse", None)
            bind_control(rt.model, tower, cond.control, plan, [0.8],
                         ops=None if sparse is None else rt.ops.with_attention(sparse.dense))
        return rt.model.evaluate(plan, 0, video, audio, rt.ops)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ctlgpu")
    return (save_tiny(d / "m.safetensors", CFG, seed=1, dtype=torch.bfloat16),
            save_tiny_control(d / "c.safetensors", CFG, (0, 2), seed=11, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 24, 7, 16, 16, generator=g), torch.randn(1, 32, 2, 37, generator=g),
            torch.randn(1, 40, 64, generator=g), torch.randn(1, 49, 7, 16, 16, generator=g))


def test_tower_on_the_fast_stack_tracks_the_reference(files, case):
    model, ctl = files
    ref = load_model(str(model), RuntimeOptions(device="cpu", dtype="float32", quantize=False, attention="reference"))
    ref_tower = load_control(ctl, ref.plan, ref.config)
    rv, ra = _evaluate(ref, ref_tower, case)
    pv, _ = _evaluate(ref, ref_tower, case, with_control=False)
    fast = load_model(str(model), RuntimeOptions(device="cuda"))
    tower = load_control(ctl, fast.plan, fast.config)
    assert type(tower.control_blocks[0].mlp.fc1).__name__ == "Nvfp4Linear"
    fv, fa = _evaluate(fast, tower, case)
    dense = load_model(str(model), RuntimeOptions(device="cuda", quantize=False))
    dv, da = _evaluate(dense, load_control(ctl, dense.plan, dense.config), case)
    print(f"tower effect {_rel(pv, rv):.3g}; fast vs ref video {_rel(fv, rv):.3g} audio {_rel(fa, ra):.3g}; "
          f"bf16 dense vs ref video {_rel(dv, rv):.3g}; act {fast.plan.act_format}")
    assert _rel(pv, rv) > 0.05  # the tower moves the output well beyond the bounds below
    assert _rel(dv, rv) < 0.02 and _rel(da, ra) < 0.02  # bf16 rounding through 3 blocks + 2 control blocks
    assert _rel(fv, rv) < 0.1 and _rel(fa, ra) < 0.1  # NVFP4 weights (+ e4m3 or NVFP4 activations)


def test_tower_runs_dense_under_sparse_attention(files, case):
    pytest.importorskip("comfy_kitchen")
    model, ctl = files
    try:
        rt = load_model(str(model), RuntimeOptions(device="cuda", attention="sparse", sparse_min_tokens=0))
    except Exception as e:  # no sol_attn kernel on this GPU / install
        pytest.skip(f"sparse attention unavailable: {e}")
    tower = load_control(ctl, rt.plan, rt.config)
    video, audio, text, hint = case
    cond = conditioning_from_payload({"control": {"hint": hint}})
    with torch.no_grad():
        plan = rt.model.plan(text, video.shape, audio.shape, [0.8], cond=cond)
        run = bind_control(rt.model, tower, cond.control, plan, [0.8], ops=rt.ops.with_attention(rt.sparse.dense))
    assert run is not None and run.ops is not None and run.ops is not rt.ops
