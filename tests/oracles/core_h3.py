"""A float64 oracle of ComfyUI core's MiniMax H3 model output, written from core's semantics, not from ours.

Plain and slow on purpose: rows are built one by one, every row carries its own (t, h, w) position, timestep
and modality tag, and every linear layer is a float64 matmul. It imports only torch, so it shares no code
with the runtime (not its layout, rope, mod rows, masks or heads) and can also run next to a ComfyUI
checkout (``tests/oracles/check_core.py`` compares it with core's own ``MiniMaxH3Model``).

What it computes (ComfyUI core, ``comfy/ldm/minimax/model.py`` of Comfy-Org/ComfyUI 01a56b76 and the
``MiniMaxH3`` class of ``comfy/model_base.py`` 094c74c1), with the audio in its own stream (audio_scale 1):

- sequence ``[text | keyframe rows | ref rows | target audio | target video]``; a keyframe gives video rows
  (``cond``) then audio rows (``cond_audio``); refs in order: image -> ``ref_img``, audio -> ``ref_audio``,
  video -> its audio rows (``ref_audio``) then its video rows (``ref_img``)
- time axis: text token i at i; refs from L on, an image spans 1, an audio ref its ref_audio_t, a video
  max(ref_audio_t, sum of 5/3 * (1,4,4,4,4)[k % 5]); the targets start after all refs; a keyframe at pixel
  frame f starts at target origin + 5/3 * f
- positions are rounded to float32 before the rope (core casts them), the rope angle uses core's fp32
  inv_freq; the video is circularly padded to even H / W
- timesteps: sigma goes through core's timestep round trip (fp32 sigma*1000/1000, clamped at 1e-6);
  t_v = 1 - sigma, t_a = 1 - shift(sigma; video -> audio); condition rows max(t, aug); masked target rows
  ``min(1 - m * sigma_stream, max(t_stream, pin))`` with pin 0.999 (video) / 1.0 (audio), m the pooled mask
- condition noise: visual rows ``aug * r + (1 - aug) * randn`` from a CPU generator seeded ``seed`` per
  condition block (float32 noise of the block's row shape), audio rows likewise from ``seed + 1``, only
  when aug < 1
- masks pooled as core: amax per 2x2 patch (replicated odd edge) for video, amax over channels for audio,
  ceil(256 m)/256, dropped when their minimum is >= 1 - 1e-3; the output is multiplied by the pooled mask
- PDD head bank (video_out rows = n * C * 4, n > 1): the step [sigma, sigma_next] from the nearest entry of
  sample_sigmas, start/stop = round((1 - shift(s; video -> 1)) * n), weights dt of linspace(1, 0, n+1)
  under each stream's shift; head = block 0 + sum over j in [max(start, 1), stop) of w_j * block j
- the output is negated (core's CONST velocity)
- text states go through condition_proj and the token refiner unless they are as wide as hidden_size: core takes
  those as refined by their width alone (extra_conds refines once per run), so with text_dim == hidden_size the
  two are never run
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0


def time_shift(sigma: float, from_shift: float, to_shift: float) -> float:
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def core_sigma(sigma: float) -> float:
    """The video sigma core's DiT sees: timestep = fp32(sigma) * 1000 in fp32, then / 1000 in fp32, >= 1e-6."""
    t = torch.tensor(float(sigma), dtype=torch.float32) * 1000.0
    return float((t / 1000.0).clamp(min=1e-6))


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# geometry, written out row by row
# ---------------------------------------------------------------------------------------------

def spatial_coords(dim: int, other: int, is_h: bool) -> list[float]:
    """Area-normalised coordinates of one axis of `dim` latent pixels (2 per patch); `other` is the other axis."""
    n = dim // 2
    ratio = dim / math.sqrt(dim * other)
    return [(i * ratio / n + (1.0 - ratio) / 2.0) * 32.0 for i in range(n)]


def frame_positions(lat_h: int, lat_w: int) -> list[tuple[float, float]]:
    hs = spatial_coords(lat_h, lat_w, True)
    ws = spatial_coords(lat_w, lat_h, False)
    return [(h, w) for h in hs for w in ws]


def frame_times(n_frames: int, origin: float) -> list[float]:
    out, t = [], origin
    for k in range(n_frames):
        out.append(t)
        t += FRAME_RESCALE * FRAME_PER_TOKEN[k % 5]
    return out


def video_span(n_frames: int) -> float:
    return sum(FRAME_RESCALE * FRAME_PER_TOKEN[k % 5] for k in range(n_frames))


def ref_span(ref: dict) -> float:
    if ref["kind"] == "image":
        return 1.0
    if ref["kind"] == "audio":
        return float(ref["ref_audio_t"])
    return max(float(ref["ref_audio_t"]), video_span(int(ref["latent_t"])))


def video_rows(latent: torch.Tensor) -> torch.Tensor:
    """[1, C, T, H, W] (H, W even) -> [T*(H/2)*(W/2), C*4] float64, rows (t, h, w), features (c, ph, pw)."""
    _, c, t, h, w = latent.shape
    rows = []
    for ti in range(t):
        for hi in range(h // 2):
            for wi in range(w // 2):
                feats = [latent[0, ci, ti, 2 * hi + a, 2 * wi + b] for ci in range(c) for a in range(2) for b in range(2)]
                rows.append(torch.stack(feats))
    return torch.stack(rows).to(F64)


def video_from_rows(rows: torch.Tensor, c: int, t: int, h: int, w: int) -> torch.Tensor:
    out = torch.zeros(1, c, t, h, w, dtype=F64)
    r = 0
    for ti in range(t):
        for hi in range(h // 2):
            for wi in range(w // 2):
                f = 0
                for ci in range(c):
                    for a in range(2):
                        for b in range(2):
                            out[0, ci, ti, 2 * hi + a, 2 * wi + b] = rows[r, f]
                            f += 1
                r += 1
    return out


def audio_rows(latent: torch.Tensor) -> torch.Tensor:
    """[1, C, 2, Ta] -> [2*Ta, C] float64: stereo channel 0 frames 0..Ta-1, then channel 1."""
    return torch.stack([latent[0, :, ch, j] for ch in range(2) for j in range(latent.shape[3])]).to(F64)


def audio_from_rows(rows: torch.Tensor, ta: int) -> torch.Tensor:
    out = torch.zeros(1, rows.shape[1], 2, ta, dtype=F64)
    for ch in range(2):
        for j in range(ta):
            out[0, :, ch, j] = rows[ch * ta + j]
    return out


def pad_circular_even(latent: torch.Tensor) -> torch.Tensor:
    if latent.shape[3] % 2:
        latent = torch.cat([latent, latent[:, :, :, :1]], dim=3)
    if latent.shape[4] % 2:
        latent = torch.cat([latent, latent[:, :, :, :, :1]], dim=4)
    return latent


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------

def _quant(m: float) -> float:
    return math.ceil(m * 256.0) / 256.0


def pooled_video_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """[1, 1|C, T, H, W] -> pooled [1, 1, T, H, W] float64 (channel 0, as core), or None if dropped."""
    if mask is None:
        return None
    m = mask[0, 0].to(F64)
    t, h, w = m.shape
    out = torch.zeros(1, 1, t, h, w, dtype=F64)
    for ti in range(t):
        for i in range(0, h, 2):
            for j in range(0, w, 2):
                v = _quant(float(m[ti, i:i + 2, j:j + 2].max()))
                out[0, 0, ti, i:i + 2, j:j + 2] = v
    return None if float(out.min()) >= 1.0 - 1e-3 else out


def pooled_audio_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    m = mask[0].to(F64)  # [C, 2, Ta]
    out = torch.zeros(1, 1, 2, m.shape[2], dtype=F64)
    for ch in range(2):
        for j in range(m.shape[2]):
            out[0, 0, ch, j] = _quant(float(m[:, ch, j].max()))
    return None if float(out.min()) >= 1.0 - 1e-3 else out


# ---------------------------------------------------------------------------------------------
# the layout: one entry per row
# ---------------------------------------------------------------------------------------------

class Rows:
    """Per row: kind, (t, h, w) position, modality tag; plus the input features of each segment."""

    def __init__(self):
        self.kind, self.pos, self.tag = [], [], []
        self.parts = []  # (kind, features [n, f] float64 or None for text)

    def add(self, kind: str, positions, tag: int, feats):
        for p in positions:
            self.kind.append(kind)
            self.pos.append(p)
            self.tag.append(tag)
        self.parts.append((kind, feats))


def _aug(rows: torch.Tensor, aug: float, seed: int) -> torch.Tensor:
    if aug >= 1.0:
        return rows
    noise = torch.randn(tuple(rows.shape), generator=torch.Generator("cpu").manual_seed(int(seed)), dtype=torch.float32)
    return aug * rows + (1.0 - aug) * noise.to(F64)


def audio_positions(origin: float, n: int, w_lo: float, w_hi: float):
    return [(origin + j, 0.0, w_lo) for j in range(n)] + [(origin + j, 0.0, w_hi) for j in range(n)]


def build_rows(text_len, tags, video, audio, payload) -> Rows:
    _, _, t, h, w = video.shape
    frame = frame_positions(h, w)
    w_lo, w_hi = frame[0][1], frame[-1][1]
    vis_aug = float(payload.get("visual_cond_noise_aug", 0.999))
    aud_aug = float(payload.get("audio_cond_noise_aug", 1.0))
    seed = int(payload.get("seed", 0))
    refs = payload.get("refs") or []
    r = Rows()
    r.add("text", [(float(i), 0.0, 0.0) for i in range(text_len)], None, None)
    r.tag[:text_len] = [int(v) for v in tags] if tags is not None else [1] * text_len
    origin = float(text_len) + sum(ref_span(x) for x in refs)
    for kf in payload.get("keyframes") or []:
        at = origin + FRAME_RESCALE * int(kf["resolved_frame_index"])
        if kf.get("latent") is not None:
            lat = kf["latent"]
            pos = [(tt, hh, ww) for tt in frame_times(lat.shape[2], at) for hh, ww in frame]
            r.add("cond", pos, 0, _aug(video_rows(lat), vis_aug, seed))
        if kf.get("audio_latent") is not None:
            lat = kf["audio_latent"]
            r.add("cond_audio", audio_positions(at, lat.shape[3], w_lo, w_hi), 2, _aug(audio_rows(lat), aud_aug, seed + 1))
    cursor = float(text_len)
    for ref in refs:
        if ref["kind"] in ("video", "video_audio", "audio") and int(ref["ref_audio_t"]) > 0:
            if ref["kind"] == "audio":
                lo, hi = w_lo, w_hi
            else:
                rf = frame_positions(int(ref["latent_h"]), int(ref["latent_w"]))
                lo, hi = rf[0][1], rf[-1][1]
            lat = ref["audio_latent"]
            r.add("ref_audio", audio_positions(cursor, int(ref["ref_audio_t"]), lo, hi), 2,
                  _aug(audio_rows(lat), aud_aug, seed + 1))
        if ref["kind"] != "audio":
            rf = frame_positions(int(ref["latent_h"]), int(ref["latent_w"]))
            n_t = 1 if ref["kind"] == "image" else int(ref["latent_t"])
            pos = [(tt, hh, ww) for tt in frame_times(n_t, cursor) for hh, ww in rf]
            r.add("ref_img", pos, 0, _aug(video_rows(ref["latent"]), vis_aug, seed))
        cursor += ref_span(ref)
    ta = audio.shape[3]
    r.add("audio", audio_positions(origin, ta, w_lo, w_hi), 2, audio_rows(audio))
    r.add("video", [(tt, hh, ww) for tt in frame_times(t, origin) for hh, ww in frame], 0, video_rows(video))
    return r


def row_times(r: Rows, sigma: float, shifts, payload, vmask, amask) -> list[float]:
    t_v = 1.0 - sigma
    t_a = 1.0 - time_shift(sigma, shifts[0], shifts[1])
    vis = float(payload.get("visual_cond_noise_aug", 0.999))
    aud = float(payload.get("audio_cond_noise_aug", 1.0))
    fixed = {"text": t_v, "cond": max(t_v, vis), "ref_img": max(t_v, vis), "cond_audio": max(t_a, aud),
             "ref_audio": max(t_a, aud), "video": t_v, "audio": t_a}
    out = [fixed[k] for k in r.kind]
    if vmask is not None:
        rows = vmask[0, 0, :, ::2, ::2].reshape(-1)
        first = r.kind.index("video")
        for i, m in enumerate(rows.tolist()):
            out[first + i] = min(1.0 - m * sigma, max(t_v, 0.999))
    if amask is not None:
        rows = amask[0, 0].reshape(-1)
        first = r.kind.index("audio")
        sigma_a = 1.0 - t_a
        for i, m in enumerate(rows.tolist()):
            out[first + i] = min(1.0 - m * sigma_a, max(t_a, 1.0))
    return out


# ---------------------------------------------------------------------------------------------
# the network in float64
# ---------------------------------------------------------------------------------------------

def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x, sd, name, bias=True):
    y = x @ sd[name + ".weight"].T
    return y + sd[name + ".bias"] if bias and (name + ".bias") in sd else y


def t_embedding(sd, t: float) -> torch.Tensor:
    tf = _f32(t)  # core embeds the distinct t values as float32
    if "adaln_t_table" in sd:
        table = sd["adaln_t_table"]
        pos = min(max(tf, 0.0), 1.0) * (table.shape[0] - 1)
        i0 = min(int(math.floor(pos)), table.shape[0] - 2)
        return table[i0] + (pos - i0) * (table[i0 + 1] - table[i0])
    d = sd["time_embedder.proj_in.weight"].shape[1]
    half = d // 2
    freqs = torch.tensor([math.exp(-math.log(10000.0) * i / half) for i in range(half)], dtype=F64)
    emb = torch.cat([torch.cos(tf * freqs), torch.sin(tf * freqs)])
    return linear(torch.nn.functional.silu(linear(emb, sd, "time_embedder.proj_in")), sd, "time_embedder.proj_out")


def adaln(sd, prefix, temb, silu: bool):
    x = torch.nn.functional.silu(temb) if silu else temb
    return linear(x, sd, prefix + ".adaln_proj.linear")


def attention(sd, prefix, h, heads, hd, eps, angles=None):
    s = h.shape[0]
    qkv = linear(h, sd, prefix + ".qkv_proj", bias=False)
    inner = heads * hd
    q, k, v = (qkv[:, i * inner:(i + 1) * inner].reshape(s, heads, hd) for i in range(3))
    q = rms(q, sd[prefix + ".q_norm.weight"], eps)
    k = rms(k, sd[prefix + ".k_norm.weight"], eps)
    if angles is not None:
        q, k = rope(q, angles), rope(k, angles)
    att = torch.einsum("shd,rhd->hsr", q, k) / math.sqrt(hd)
    o = torch.einsum("hsr,rhd->shd", att.softmax(-1), v).reshape(s, inner)
    return linear(o, sd, prefix + ".out_proj", bias=False)


def rope(x, angles):
    """Split-half rotation of channels [0, 2R) of every head: (x_i, x_{i+R}) by angle_i, R = angles.shape[1]."""
    n = angles.shape[1]
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :n], x[..., n:2 * n]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * n:]], dim=-1)


def mlp(sd, prefix, h):
    y = linear(h, sd, prefix + ".fc1", bias=False)
    f = y.shape[1] // 2
    return linear(torch.nn.functional.silu(y[:, :f]) * y[:, f:], sd, prefix + ".fc2", bias=False)


def refine_text(sd, text, heads, hd, eps):
    x = linear(text, sd, "condition_proj")
    i = 0
    while f"token_refiner.blocks.{i}.norm1.weight" in sd:
        p = f"token_refiner.blocks.{i}"
        x = x + attention(sd, p + ".attn", rms(x, sd[p + ".norm1.weight"], eps), heads, hd, eps)
        x = x + mlp(sd, p + ".mlp", rms(x, sd[p + ".norm2.weight"], eps))
        i += 1
    return rms(x, sd["token_refiner.final_norm.weight"], eps)


def pdd_weight(weight, bias, n, start, stop, shift):
    grid = [1.0 - i / n for i in range(n + 1)]
    shifted = [1.0 - shift * g / (1.0 + (shift - 1.0) * g) for g in grid]
    dt = [shifted[j + 1] - shifted[j] for j in range(start, stop)]
    total = sum(dt)
    out_w = weight.shape[0] // n
    wsum = weight[:out_w].clone()
    bsum = bias[:out_w].clone()
    for j in range(max(start, 1), stop):
        wj = dt[j - start] / total
        wsum = wsum + wj * weight[j * out_w:(j + 1) * out_w]
        bsum = bsum + wj * bias[j * out_w:(j + 1) * out_w]
    return wsum, bsum


def pdd_span(sigma, sample_sigmas, n, shift_v):
    ss = [float(v) for v in sample_sigmas]
    i = min(range(len(ss)), key=lambda j: (abs(ss[j] - sigma), j))
    nxt = ss[min(i + 1, len(ss) - 1)]
    start = round((1.0 - time_shift(sigma, shift_v, 1.0)) * n)
    stop = round((1.0 - time_shift(_f32(nxt), shift_v, 1.0)) * n)
    start = min(start, n - 1)
    return start, max(stop, start + 1)


# ---------------------------------------------------------------------------------------------
# the whole evaluation
# ---------------------------------------------------------------------------------------------

def dit_block(sd: dict, p: str, x: torch.Tensor, ctx: dict) -> torch.Tensor:
    """One DiT block ``p`` (e.g. ``blocks.3``) of float64 weights ``sd`` over rows x: every row modulated by the
    adaLN of its own (t, tag) from ``ctx`` (times, tags, temb, angles, heads, hd, eps, curve)."""
    hidden, eps = x.shape[1], ctx["eps"]
    mods = {tv: adaln(sd, p, e, not ctx["curve"]).reshape(3, 6, hidden) for tv, e in ctx["temb"].items()}
    m = torch.stack([mods[tv][tag] for tv, tag in zip(ctx["times"], ctx["tags"])])  # [S, 6, hidden]
    hmod = rms(x, sd[p + ".norm1.weight"], eps) * (1.0 + m[:, 1]) + m[:, 0]
    x = x + m[:, 2] * attention(sd, p + ".attn", hmod, ctx["heads"], ctx["hd"], eps, ctx["angles"])
    hmod = rms(x, sd[p + ".norm2.weight"], eps) * (1.0 + m[:, 4]) + m[:, 3]
    return x + m[:, 5] * mlp(sd, p + ".mlp", hmod)


def core_forward(sd: dict, video: torch.Tensor, audio: torch.Tensor, text_states: torch.Tensor, sigma: float,
                 token_tags=None, payload: dict | None = None, shifts=(12.0, 3.0), eps: float = 1e-5,
                 block_hook=None):
    """Core's model output (video [1,C,T,H,W], audio [1,Ca,2,Ta]) in float64 for one evaluation.

    sd: ComfyUI-named state dict (any dtype; used in float64). payload: core's payload with tensors in place
    (keyframes, refs, denoise_mask, audio_denoise_mask, sample_sigmas, *_cond_noise_aug, seed).
    block_hook(i, x, ctx) -> x: called after base block i (a model patch such as core_control's tower); ctx holds
    the embedded sequence ``x0`` and the per-row pieces ``dit_block`` reads, plus ``kinds``, ``latent_t``, ``sigma``.
    """
    payload = payload or {}
    sd = {k: v.to(F64) for k, v in sd.items()}
    hd = sd["blocks.0.attn.q_norm.weight"].shape[0]
    heads = sd["blocks.0.attn.qkv_proj.weight"].shape[0] // (3 * hd)
    curve = "adaln_t_table" in sd
    _, c, t, h0, w0 = video.shape
    vpad = pad_circular_even(video.to(F64))
    sigma = core_sigma(sigma)
    tags = None if token_tags is None else [int(v) for v in torch.as_tensor(token_tags).reshape(-1).tolist()]
    r = build_rows(text_states.shape[1], tags, vpad, audio.to(F64), payload)
    vmask = pooled_video_mask(payload.get("denoise_mask"))
    amask = pooled_audio_mask(payload.get("audio_denoise_mask"))
    vmask_rows = None if vmask is None else pad_circular_even(vmask)  # same values per patch
    times = row_times(r, sigma, shifts, payload, vmask_rows, amask)

    # embed every segment
    feats = []
    for kind, f in r.parts:
        if kind == "text":
            states = text_states[0].to(F64)
            as_refined = states.shape[-1] == sd["video_patch_proj.weight"].shape[0]
            feats.append(states if as_refined else refine_text(sd, states, heads, hd, eps))
        elif kind in ("cond", "ref_img", "video"):
            feats.append(linear(f, sd, "video_patch_proj"))
        else:
            feats.append(linear(f, sd, "audio_patch_proj"))
    x = torch.cat(feats)

    # rope angles per row: fp32 positions x fp32 inv_freq
    inv = sd["rope.inv_freq"]
    pos = torch.tensor([[_f32(p) for p in row] for row in r.pos], dtype=F64)
    angles = torch.cat([pos[:, a:a + 1] * inv[None, :] for a in range(3)], dim=1)

    temb = {tv: t_embedding(sd, tv) for tv in sorted(set(times))}
    hidden = x.shape[1]
    ctx = dict(x0=x.clone(), kinds=list(r.kind), times=times, tags=r.tag, angles=angles, temb=temb, heads=heads,
               hd=hd, eps=eps, curve=curve, latent_t=t, sigma=sigma)
    i = 0
    while f"blocks.{i}.norm1.weight" in sd:
        x = dit_block(sd, f"blocks.{i}", x, ctx)
        if block_hook is not None:
            x = block_hook(i, x, ctx)
        i += 1

    fmods = {tv: adaln(sd, "final_layer", e, not curve).reshape(2, hidden) for tv, e in temb.items()}

    def head(kind, name, shift):
        idx = [j for j, k in enumerate(r.kind) if k == kind]
        fm = torch.stack([fmods[times[j]] for j in idx])
        hh = rms(x[idx], sd["final_layer.norm.weight"], eps) * (1.0 + fm[:, 1]) + fm[:, 0]
        wt, bs = sd[f"final_layer.{name}.weight"], sd[f"final_layer.{name}.bias"]
        out_f = c * 4 if name == "video_out" else audio.shape[1]
        n = wt.shape[0] // out_f
        if n > 1:
            if payload.get("sample_sigmas") is None:
                raise ValueError("PDD heads need sample_sigmas")
            start, stop = pdd_span(sigma, payload["sample_sigmas"], n, shifts[0])
            wt, bs = pdd_weight(wt, bs, n, start, stop, shift)
        return hh @ wt.T + bs

    v = video_from_rows(head("video", "video_out", shifts[0]), c, t, vpad.shape[3], vpad.shape[4])[..., :h0, :w0]
    a = audio_from_rows(head("audio", "audio_out", shifts[1]), audio.shape[3])
    v, a = -v, -a
    if vmask is not None:
        v = v * vmask
    if amask is not None:
        a = a * amask
    return v, a
