#!/usr/bin/env python3
"""Write a tiny random diffusers-layout MiniMax H3 pipeline folder, offline (runtime.pipeline.tiny):

    .venv/bin/python scripts/make_tiny_pipeline.py OUT_DIR [--seed 0]

then ``h3-blackwell generate --pipeline OUT_DIR --prompt "..." --output out/`` (the folder's own tiny transformer
weights run on our runtime), or ``ModularPipeline.from_pretrained(OUT_DIR)`` in diffusers. Needs the ``pipeline``
extra (diffusers, transformers, torchvision, accelerate, av)."""

import argparse
import sys

from h3_blackwell.runtime.pipeline.tiny import TinyPipeline, save_tiny_pipeline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder to write (created)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (the same seed writes the same weights)")
    a = ap.parse_args(argv)
    print(f"wrote {save_tiny_pipeline(a.out, TinyPipeline(seed=a.seed))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
