"""Building H3's module tree on the meta device (every plan does, before any tensor is read) stays a plain module
build: it must not reach torch's meta decompositions, whose first use imports the compiler stack (torch._dynamo,
about 1.4 s of a fresh process's plan). Run in a fresh interpreter: other tests import torch._dynamo."""

import subprocess
import sys

_SCRIPT = """
import sys, torch
from h3_blackwell.runtime.model.config import FULL, TINY
from h3_blackwell.runtime.model.h3 import H3Model
assert "torch._dynamo" not in sys.modules, "imported before the build"
with torch.device("meta"):
    m = H3Model(FULL, torch.bfloat16)
    t = H3Model(TINY, torch.float32)
inv = m.rope.inv_freq
assert inv.is_meta and inv.shape == (FULL.rope_inv_freq_len,), (inv.device, inv.shape)
print("dynamo" if "torch._dynamo" in sys.modules else "plain")
"""


def test_the_meta_build_of_the_full_model_does_not_import_the_compiler_stack():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "plain"

