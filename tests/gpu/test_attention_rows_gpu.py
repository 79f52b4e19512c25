"""Query-row chunks of attention on the GPU (issue 37): row-exact backends (runtime.ops.attention.ROW_EXACT) give the
unchunked bytes at H3's head size on 128-row chunk boundaries; the others are within their stated tolerance of it,
and the test prints the rel-L2 for the record."""

import pytest
import torch

from h3_blackwell.runtime.ops.attention import (TOLERANCE, bind_attention, bind_attention_qkv,
                                                choose_attention_backend, rel_l2, row_exactness)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
S, H, D = 9_000, 8, 128  # not a multiple of 128: the last chunk is partial


@pytest.mark.parametrize("backend", ["sage2", "sdpa_cudnn", "sdpa_flash", "fa3"])
def test_row_chunks_on_the_device(backend):
    dev = torch.device("cuda")
    name, why = choose_attention_backend(dev, backend, head_dim=D)
    if name != backend:
        pytest.skip(why)
    qkv = torch.randn(S, 3 * H * D, device=dev, generator=torch.Generator(dev).manual_seed(0)).bfloat16()
    v = "fused" if backend == "sage2" else "none"
    from h3_blackwell.runtime.ops.sage import v_handling_status

    if backend == "sage2":
        v = v_handling_status("fused", dev, D)[0]
    whole = bind_attention(backend, D, device=dev, v_handling=v)(qkv)
    rows = bind_attention_qkv(backend, D, device=dev, v_handling=v)
    q, k, vv = qkv.unflatten(1, (3, -1)).unbind(1)
    for c in (1024, 4096):
        got = torch.cat([rows(q[a:a + c], k, vv) for a in range(0, S, c)])
        err = rel_l2(got.float(), whole.float())
        print(f"{backend} chunk {c}: equal={torch.equal(got, whole)} rel_l2={err:.3g}")
        if row_exactness(backend)[0]:
            assert torch.equal(got, whole), (backend, c, err)
        else:
            assert err <= TOLERANCE[backend][0], (backend, c, err)
