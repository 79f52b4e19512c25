"""Text-encoder-only references (core's MiniMaxH3TextEncoderOnlyReference) and picture_index (issue 25).

Core's ReferenceToVideo shows such an image to Qwen as a <Picture i> but leaves it out of the DiT's refs, and its
picture_index counts every image, text-only ones included; the DiT reads neither. A payload may carry such a
reference as ``{"kind": "image", "picture_index": i}`` (no latent): accepted, kept for the text side, and the
model output is exactly the one without it (and core's, from the float64 oracle)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "oracles"))

import core_h3  # noqa: E402

from h3_blackwell.cli import main as cli  # noqa: E402
from h3_blackwell.runtime import ConditioningError, conditioning_from_payload, conditioning_to_payload  # noqa: E402
from h3_blackwell.runtime.model.config import TINY  # noqa: E402
from h3_blackwell.runtime.model.tiny import save_tiny, tiny_state_dict  # noqa: E402

CFG = TINY.replace(text_dim=64)


def _case():
    g = torch.Generator().manual_seed(12)
    video, audio = torch.randn(1, 24, 2, 4, 6, generator=g), torch.randn(1, 32, 2, 8, generator=g)
    text = torch.randn(1, 7, 64, generator=g)
    dit_refs = [{"kind": "image", "picture_index": 0, "latent_h": 2, "latent_w": 4,
                 "latent": torch.randn(1, 24, 1, 2, 4, generator=g)},
                {"kind": "image", "picture_index": 2, "latent_h": 4, "latent_w": 2,
                 "latent": torch.randn(1, 24, 1, 4, 2, generator=g)}]
    return video, audio, text, dit_refs


def _forward(tmp_path, model, video, audio, text, payload, name):
    cond = conditioning_from_payload(payload)
    p, tensors = conditioning_to_payload(cond)
    tensors.update(video=video, audio=audio, text_states=text, sigma=torch.tensor([0.8]))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / f"{name}.safetensors"))
    (tmp_path / f"{name}.json").write_text(json.dumps(p))
    out = tmp_path / f"{name}_out.safetensors"
    assert cli.main(["forward", "--model", str(model), "--inputs", str(tmp_path / f"{name}.safetensors"),
                     "--payload", str(tmp_path / f"{name}.json"), "--out", str(out)]) == 0
    with safe_open(str(out), "pt") as f:
        return f.get_tensor("video"), f.get_tensor("audio")


def test_text_only_reference_is_accepted_and_invisible_to_the_dit(tmp_path):
    model = save_tiny(tmp_path / "m.safetensors", CFG, seed=1, dtype=torch.float32)
    video, audio, text, dit_refs = _case()
    # core's ReferenceToVideo with [image, text-only image, image]: refs 0 and 2 reach the DiT, picture 1 does not
    with_text_only = {"refs": [dit_refs[0], {"kind": "image", "picture_index": 1}, dit_refs[1]], "seed": 3}
    cond = conditioning_from_payload(with_text_only)
    assert [r.picture_index for r in cond.refs] == [0, 2] and cond.text_only_pictures == (1,)
    again = conditioning_from_payload(*conditioning_to_payload(cond))
    assert again.text_only_pictures == (1,) and [r.picture_index for r in again.refs] == [0, 2]
    v, a = _forward(tmp_path, model, video, audio, text, with_text_only, "t")
    bv, ba = _forward(tmp_path, model, video, audio, text, {"refs": dit_refs, "seed": 3}, "b")
    assert torch.equal(v, bv) and torch.equal(a, ba)
    ov, oa = core_h3.core_forward(tiny_state_dict(CFG, seed=1), video, audio, text, 0.8,
                                  payload={"refs": dit_refs, "seed": 3})
    rel = lambda x, y: float((x.double() - y).norm() / y.norm())  # noqa: E731
    assert rel(v, ov) < 1e-5 and rel(a, oa) < 1e-5


def test_text_only_references_alone_and_refusals():
    cond = conditioning_from_payload({"refs": [{"kind": "image", "picture_index": 0}, {"kind": "image"}]})
    assert cond.refs == () and cond.text_only_pictures == (0, None) and not cond.refs
    # the DiT does not read picture_index, so core's model takes any (its nodes number each image once)
    assert conditioning_from_payload({"refs": [{"kind": "image", "picture_index": 1},
                                               {"kind": "image", "picture_index": 1}]}).text_only_pictures == (1, 1)
    with pytest.raises(ConditioningError, match=r"refs\[0\].*unknown field 'caption'"):
        conditioning_from_payload({"refs": [{"kind": "image", "picture_index": 0, "caption": "x"}]})
    with pytest.raises(ConditioningError, match=r"refs\[0\].latent"):  # a size without its latent is not text-only
        conditioning_from_payload({"refs": [{"kind": "image", "latent_h": 2, "latent_w": 2}]})
