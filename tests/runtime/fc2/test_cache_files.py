"""Files under the cache directory that are not what the runtime wrote (a crash of another tool, a disk error, a hand
edit, a pipe): a tuned table entry is ignored and listed in ``Fc2Table.problems``, a compatibility record is measured
again; neither stops a run. Before, a JSON list or a deeply nested file raised AttributeError / RecursionError out of
``Fc2Table.default`` (the FC2 dispatcher's construction, so every CUDA run), and a pipe named ``*.json`` blocked it.
"""

from __future__ import annotations

import json
import os

import pytest

from h3_blackwell.runtime.fc2.guard import Fc2Environment
from h3_blackwell.runtime.fc2.lt_plans import COMPAT_SCHEMA, CompatCache
from h3_blackwell.runtime.fc2.table import BUILTIN_ENTRIES, ENTRY_SCHEMA, Fc2Table, table_dir

_SECTIONS = {"device": {"cc": [9, 0], "sm_count": 132}, "versions": {"cuda_header": [13, 0], "cublas_header": [13, 1],
             "cuda_runtime": 13000, "cublaslt_runtime": 130100},
             "gemm": {"dtype": "nvfp4", "out_dtype": "bfloat16", "m_logical": 64, "m_padded": 128, "n": 96, "k": 160},
             "algo": {}}

BAD_ENTRIES = {
    "list.json": "[1, 2]",
    "deep.json": "[" * 100000 + "]" * 100000,
    "gemm-string.json": json.dumps({"schema": ENTRY_SCHEMA, "name": "x", "role": "fc2", **_SECTIONS, "gemm": "fast"}),
    "device-list.json": json.dumps({"schema": ENTRY_SCHEMA, "name": "x", "role": "fc2", **_SECTIONS, "device": [9, 0]}),
    "algo-list.json": json.dumps({"schema": ENTRY_SCHEMA, "name": "x", "role": "fc2", **_SECTIONS, "algo": [1]}),
    "not-utf8.json": b"\xff\xfe",
    "empty.json": "",
}


def test_bad_table_files_are_listed_not_raised(tmp_path):
    d = table_dir(tmp_path)
    d.mkdir(parents=True)
    for name, text in BAD_ENTRIES.items():
        (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    os.mkfifo(d / "pipe.json")
    t = Fc2Table.default(tmp_path)
    assert [e.name for e in t.entries] == [e.name for e in BUILTIN_ENTRIES]
    listed = {p.split(":")[0].rsplit("/", 1)[-1] for p in t.problems}
    assert listed == set(BAD_ENTRIES) | {"pipe.json"}, t.problems
    why = {p.split(":")[0].rsplit("/", 1)[-1]: p for p in t.problems}
    assert "expected an object" in why["list.json"] and "nested too deeply" in why["deep.json"]
    assert "'gemm' is a JSON str" in why["gemm-string.json"] and "not a regular file" in why["pipe.json"]


ENV = Fc2Environment(cc=(9, 0), sm_count=132, cuda_header=13000, cublas_header=130100, cuda_runtime=13000,
                     cublaslt_runtime=130100, device_name="NVIDIA H200")


@pytest.mark.parametrize("content", ["[1]", "[" * 100000, '"text"', "{}", "entries-list", "entry-string"])
def test_a_bad_compatibility_record_is_measured_again(content, tmp_path):
    cache = CompatCache(tmp_path)
    path = cache.path(ENV, "layer")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = cache.key_fields(ENV, "layer")
    if content == "entries-list":
        content = json.dumps({"schema": COMPAT_SCHEMA, "key": key, "entries": [1]})
    elif content == "entry-string":
        content = json.dumps({"schema": COMPAT_SCHEMA, "key": key, "entries": {"fp": "refused"}})
    path.write_text(content)
    assert cache.load(ENV, "layer") == {"schema": COMPAT_SCHEMA, "key": key, "entries": {}}
    cache.store_entry(ENV, "layer", "fp", {"status": "ready"})  # and it is written over with a good one
    assert cache.load(ENV, "layer")["entries"]["fp"]["status"] == "ready"
