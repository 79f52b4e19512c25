"""Curve-form AdaLN and PDD head banks against their closed forms (h3-comfyui-facts.md §1)."""

import math

import torch

from h3_blackwell.runtime.model.config import TINY
from h3_blackwell.runtime.model.layout import build_layout, latent_shapes, step_times
from h3_blackwell.runtime.model.conditioning import H3Conditioning
from h3_blackwell.runtime.model.h3 import pdd_head_weights, pdd_span
from h3_blackwell.runtime.model.tiny import tiny_model


def test_canonical_geometry():
    v, a = latent_shapes(1344, 768, 124)
    assert v == (1, 24, 37, 48, 84) and a == (1, 32, 2, 207)
    lay = build_layout(100, 37, 48, 84, 207)
    assert lay.seq_len == 37810
    assert lay.segment("video") == (100 + 414, 37810) and lay.segment("audio") == (100, 514)


def test_curve_form_time_embedding_is_linear_interpolation_without_silu():
    cfg = TINY.replace(adaln_curve_grid=9, time_embed_dim=8)
    m = tiny_model(cfg, seed=4)
    table = m.adaln_t_table
    for t in (0.0, 0.3, 0.61, 0.999, 1.0):
        pos = t * 8
        i0 = min(int(math.floor(pos)), 7)
        frac = pos - i0
        expect = table[i0] * (1 - frac) + table[i0 + 1] * frac
        got = m.time_embedding([t])[0]
        assert torch.allclose(got, expect, atol=1e-6), t
    # block AdaLN in curve form: W @ t_emb + b, no SiLU, fp32
    temb = m.time_embedding([0.3, 0.7])
    lin = m.blocks[0].adaln_proj.linear
    assert lin.weight.dtype == torch.float32 and lin.weight.shape[1] == 8
    expect = (temb @ lin.weight.T + lin.bias).reshape(2 * 3, -1)
    assert torch.allclose(m.blocks[0].adaln_proj(temb), expect, atol=1e-6)


def _shift(sig, s):
    return s * sig / (1 + (s - 1) * sig)


def test_pdd_head_bank_closed_form():
    n = 6
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n * 5, 7, generator=g, dtype=torch.float64)
    b = torch.randn(n * 5, generator=g, dtype=torch.float64)
    for sigma, nxt, shift in [(1.0, 0.93, 12.0), (0.9, 0.5, 12.0), (0.4, 0.0, 3.0)]:
        start, stop = pdd_span(sigma, nxt, n, 12.0)
        base = lambda s: s / (12.0 - 11.0 * s)  # noqa: E731  sigma -> base grid, shift 12
        assert start == min(round((1 - base(sigma)) * n), n - 1)
        assert stop == max(round((1 - base(nxt)) * n), start + 1)
        grid = [1 - k / n for k in range(n + 1)]
        dts = [(1 - _shift(grid[j + 1], shift)) - (1 - _shift(grid[j], shift)) for j in range(n)]
        span = dts[start:stop]
        tot = sum(span)
        ew = w[0:5].clone()
        eb = b[0:5].clone()
        for j in range(max(start, 1), stop):
            ew += dts[j] / tot * w[5 * j:5 * j + 5]
            eb += dts[j] / tot * b[5 * j:5 * j + 5]
        gw, gb = pdd_head_weights(w, b, n, start, stop, shift)
        assert torch.allclose(gw, ew, atol=1e-12) and torch.allclose(gb, eb, atol=1e-12)


def test_pdd_bank_in_the_forward_uses_the_step_heads():
    """A bank model's output equals a plain-head model carrying the closed-form heads of that step."""
    n = 4
    bank = tiny_model(TINY.replace(head_bank=n), seed=5)
    plain = tiny_model(TINY, seed=5)
    with torch.no_grad():
        fl = plain.final_layer
        for name in ("video_out", "audio_out"):
            getattr(fl, name).weight.copy_(getattr(bank.final_layer, name).weight[: getattr(fl, name).weight.shape[0]])
    g = torch.Generator().manual_seed(1)
    video = torch.randn(1, 24, 2, 4, 4, generator=g)
    audio = torch.randn(1, 32, 2, 3, generator=g)
    text = torch.randn(1, 5, TINY.text_dim, generator=g)
    sigmas = [1.0, 0.8, 0.4, 0.0]
    out_bank = bank(video, audio, text, 0.8, cond=H3Conditioning(sample_sigmas=torch.tensor(sigmas)))
    start, stop = pdd_span(0.8, 0.4, n, 12.0)
    for name, shift in (("video_out", 12.0), ("audio_out", 3.0)):
        lin = getattr(bank.final_layer, name)
        ww, bb = pdd_head_weights(lin.weight, lin.bias, n, start, stop, shift)
        with torch.no_grad():
            getattr(plain.final_layer, name).weight.copy_(ww)
            getattr(plain.final_layer, name).bias.copy_(bb)
    out_plain = plain(video, audio, text, 0.8)
    assert torch.allclose(out_bank[0], out_plain[0], atol=1e-5)
    assert torch.allclose(out_bank[1], out_plain[1], atol=1e-5)


def test_step_times_segments_and_tags():
    lay = build_layout(6, 2, 4, 4, 3)
    st = step_times(lay, 0.6, (12.0, 3.0), text_tags=[1, 1, 0, 0, 1, 1])
    t_v, t_a = 0.4, 1 - _shift(0.6 / (12 - 11 * 0.6), 3.0)
    assert st.t_values == sorted([t_v, t_a])
    iv, ia = st.t_values.index(t_v), st.t_values.index(t_a)
    assert st.mod_segments == [(0, 2, iv * 3 + 1), (2, 4, iv * 3 + 0), (4, 6, iv * 3 + 1),
                               (6, 12, ia * 3 + 2), (12, lay.seq_len, iv * 3 + 0)]
