"""diffusers' MiniMax H3 pipeline and our runtime: our transformer inside diffusers' pipeline (``transformer``), the
pipeline folder's conditioner and VAEs around our sampling (``folder``, ``generate``: ``generate --prompt``), a tiny
random pipeline folder for tests and benches (``tiny``). diffusers, transformers (and torchvision for the Qwen3-VL
processor) and PyAV are imported only when these are used (the ``pipeline`` extra)."""
