"""The guarded cuBLASLt FC2 path: a pinned GEMM for the MLP's second linear, used only where evidence says it
is byte-identical to the fallback, otherwise the fallback on the same activation bytes.

- ``table``: accepted entries (the seed's GB10 entry, tuned JSON files) and the ``code: detail`` Refusal;
- ``guard``: a call and the device checked against the entries, in a fixed order;
- ``lt_plans``: the cuBLASLt plan layer over the extension (or a test fake) and the on-disk compatibility cache;
- ``dispatcher``: ``Fc2Dispatcher``, the one object the block stack calls; counters per run;
- ``operands``: synthetic operands, the reference GEMM and the byte comparison (self-test and tuner);
- ``tune``: the sweep behind ``h3-blackwell tune-fc2`` (its command line: ``cli/tune_fc2.py``), which
  sweeps, verifies and times configurations into an entry;
- ``ext``: builds and loads the host C++ extension ``csrc/fc2_nvfp4_lt.cpp``.
"""
