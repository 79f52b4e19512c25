"""H3 Diagnostics (output node): the sampler's report as text in the UI and as JSON in the output folder,
with an optional regression check of the video latent's sha256.

The UI dict carries ``text`` (shown under the node) and ``h3_report`` ([{filename, subfolder, type}], the
JSON file, fetchable through ``/view``; ``h3-blackwell comfy-run`` downloads it).
"""

from __future__ import annotations

import json
import os
import re

from ..runtime import write_file
from ._common import CATEGORY, comfy_module, node_error

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def report_text(report: dict) -> str:
    """A short human summary, the backends, then the full JSON."""
    from ..runtime import summary

    lines = []
    try:
        lines.append(summary(report))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        pass  # a partial report still shows its JSON below
    for op, b in (report.get("backends") or {}).items():
        if isinstance(b, dict):
            lines.append(f"{op}: {b.get('choice')} ({b.get('reason')})")
    lines.append(json.dumps(report, indent=2, sort_keys=False, default=str))
    return "\n".join(lines)


class H3Diagnostics:
    TITLE = "H3 Diagnostics"
    DESCRIPTION = ("Shows the H3 Sampler's report (backends, step timings, memory, FC2 dispatch counts, latent "
                   "sha256) and writes it as JSON to the output folder. With expected_video_sha256 set, the node "
                   "fails when the video latent's hash differs (regression runs).")
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report_json",)
    FUNCTION = "report"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "diagnostics": ("H3_DIAGNOSTICS", {"tooltip": "from H3 Sampler"}),
                "filename_prefix": ("STRING", {"default": "h3_blackwell/diagnostics",
                                               "tooltip": "JSON file prefix inside the output folder"}),
            },
            "optional": {
                "expected_video_sha256": ("STRING", {"default": "", "tooltip": "fail loudly unless the video "
                                                     "latent's sha256 equals this (64 hex digits); empty = no check"}),
            },
        }

    def report(self, diagnostics, filename_prefix: str, expected_video_sha256: str = ""):
        if not isinstance(diagnostics, dict) or "latent_checksums" not in diagnostics:
            raise node_error(self.TITLE, f"diagnostics must come from H3 Sampler; got {type(diagnostics).__name__}")
        expected = (expected_video_sha256 or "").strip().lower()
        if expected and not _SHA256.match(expected):
            raise node_error(self.TITLE, f"expected_video_sha256 must be 64 hex digits; got {expected_video_sha256!r}")
        fp = comfy_module("folder_paths")
        folder, name, counter, subfolder, _ = fp.get_save_image_path(filename_prefix or "h3_blackwell/diagnostics",
                                                                     fp.get_output_directory())
        filename = f"{name}_{counter:05}_.json"
        body = json.dumps(diagnostics, indent=2, default=str)
        write_file(os.path.join(folder, filename),  # a unique temporary name, then one rename
                   lambda tmp: tmp.write_text(body + "\n", encoding="utf-8"))
        actual = diagnostics["latent_checksums"].get("video_sha256")
        if expected and actual != expected:
            raise node_error(self.TITLE, f"video latent sha256 mismatch: expected {expected}, got {actual} "
                                         f"(report written to {os.path.join(subfolder, filename)} in the output folder)")
        text = report_text(diagnostics)
        ui = {"text": [text], "h3_report": [{"filename": filename, "subfolder": subfolder, "type": "output"}]}
        return {"ui": ui, "result": (body,)}
