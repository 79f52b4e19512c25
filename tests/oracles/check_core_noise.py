"""The H3 Sampler's initial noise against ComfyUI core's own ``comfy.sample.prepare_noise`` on a one-clip nested
(video, audio) latent, for batch_index none, [0], [1] and [5], two seeds, fp32 and fp16 latents (bitwise). Not a
pytest module and not run by CI (it needs a ComfyUI checkout with core H3's NestedTensor). Usage::

    cd <ComfyUI checkout> && <its python> <repo>/tests/oracles/check_core_noise.py [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_LINK = Path(tempfile.mkdtemp(prefix="h3b-pkg-"))  # ``import h3_blackwell`` resolves to this checkout
(_LINK / "h3_blackwell").symlink_to(REPO)
sys.path.insert(0, str(_LINK))
sys.path.insert(0, os.getcwd())  # the ComfyUI checkout

import torch  # noqa: E402

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--json", default=None)
OPTS = ARGS.parse_args()
sys.argv = ["main.py", "--cpu"]  # core's model management reads its own flags at import: the CPU
import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import comfy.nested_tensor  # noqa: E402
import comfy.sample  # noqa: E402

from h3_blackwell.runtime.sampling.sampler import initial_noise  # noqa: E402

VSHAPE, ASHAPE = (1, 24, 5, 8, 12), (1, 32, 2, 37)


def main() -> int:
    a = OPTS
    rows = []
    for dtype in (torch.float32, torch.float16):  # fp16: core's --fp16-intermediates (sample() rounds the same way)
        latent = comfy.nested_tensor.NestedTensor([torch.zeros(VSHAPE, dtype=dtype), torch.zeros(ASHAPE, dtype=dtype)])
        for seed in (0, 440420):
            for inds in (None, [0], [1], [5]):
                core = comfy.sample.prepare_noise(latent, seed, inds).unbind()
                ours = [n.to(dtype) for n in initial_noise(seed, VSHAPE, ASHAPE, 0 if inds is None else inds[0])]
                ok = all(c.dtype == o.dtype and torch.equal(c, o) for c, o in zip(core, ours))
                rows.append({"dtype": str(dtype), "seed": seed, "batch_index": inds, "bitwise_equal": ok})
                print(f"{dtype} seed {seed} batch_index {inds}: {'ok' if ok else 'DIFFERENT'}")
    res = {"shapes": [VSHAPE, ASHAPE], "rows": rows, "all_equal": all(r["bitwise_equal"] for r in rows)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
