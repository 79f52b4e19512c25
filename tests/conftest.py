"""Shared test setup: gpu-marked tests skip cleanly without CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu-marked); run on the H200 with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
