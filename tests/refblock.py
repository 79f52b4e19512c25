"""One H3 block in float64 from the formulas, shared by the stack tests (W4A4), the W4A8 tests and the LoRA
tests: every linear input goes through ``act`` (the activation format under test: NVFP4 or e4m3 rowwise,
returned as exact float64 values), every weight is ``wq[name]`` (its quantized value as float64), attention
is exact, and ``side[name]`` (optional) adds the exact LoRA term on the UNquantized input."""

import torch


def rms(x, w, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def reference_block(blk, x, mod, segs, cos, sin, cfg, wq, act, side=None):
    heads, d, r = cfg.num_heads, cfg.head_dim, cfg.rope_dim
    side = side or {}
    sh1, sc1, g1, sh2, sc2, g2 = [t.double() for t in mod.chunk(6, dim=-1)]

    def lin(name, h):
        y = act(h) @ wq[name].T
        return y + h @ side[name].T if name in side else y

    def modulate(n, sh, sc):
        out = n.clone()
        for a, b, row in segs:
            out[a:b] = n[a:b] * (1 + sc[row]) + sh[row]
        return out

    def gate(x, y, gv):
        out = x.clone()
        for a, b, row in segs:
            out[a:b] = x[a:b] + gv[row] * y[a:b]
        return out

    def norm_rope(t, w):
        t = rms(t, w, cfg.eps)
        tr = t[..., :r]
        rot = torch.cat([-tr[..., r // 2:], tr[..., : r // 2]], -1)
        return torch.cat([tr * cos[:, None].double() + rot * sin[:, None].double(), t[..., r:]], -1)

    x = x.double()
    qkv = lin("qkv_proj", modulate(rms(x, blk.norm1.weight, cfg.eps), sh1, sc1))
    s = qkv.shape[0]
    q, k, v = qkv.view(s, 3, heads, d).unbind(1)
    q, k = norm_rope(q, blk.attn.q_norm.weight), norm_rope(k, blk.attn.k_norm.weight)
    att = torch.softmax(torch.einsum("shd,thd->hst", q, k) / d ** 0.5, -1)
    o = torch.einsum("hst,thd->shd", att, v).reshape(s, -1)
    x = gate(x, lin("out_proj", o), g1)
    f = lin("fc1", modulate(rms(x, blk.norm2.weight, cfg.eps), sh2, sc2))
    gt, up = f.chunk(2, -1)
    return gate(x, lin("fc2", gt * torch.sigmoid(gt) * up), g2)
