"""LoRA on the resident H3 model.

- ``key_forms``: reading a LoRA file, every key form mapped onto the model's module names and validated;
- ``spec``: a stack's entries (``LoraSpec``) and the CLI's ``FILE:STRENGTH[:MODE]``;
- ``source``: the model's source weights read again, and how a patched tensor is put back;
- ``merge``: the merge contract (float64, rounded once; NVFP4 re-quantized) and restoring the originals;
- ``side``: the exact bf16 low-rank side path and its hooks;
- ``pdd``: PDD head banks in a LoRA file (``final_layer.*_out.set_weight`` / ``set_bias``): the heads replaced;
- ``apply``: ``apply_loras`` / ``sync_loras`` / ``LoraView``, the entry points (and the stack's report).
"""
