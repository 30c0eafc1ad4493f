from __future__ import annotations

import os
import sys
import warnings

import pytest

# Megatron warns at import about missing TE/Apex/absl on CPU machines; not our concern here.
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*absl.*")
sys.path.insert(0, os.path.dirname(__file__))
# The GPU tests run several EP ranks' launches on one GPU from one thread (tests/gpu/emulated.py): a rank's kernel
# waits for the next rank's launch, and CUDA's lazy loading of a kernel first used in between (a torch kernel that
# prepares the next rank's inputs) waits for the running kernels -- a deadlock until the timeout. Load eagerly.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# The same ranks' streams (up to 8, beside the current stream) should not share a hardware work queue: with CUDA's
# default of 8, rank q's backward can queue behind rank p's wgrad kernel, which waits for rank p's backward, which
# waits for rank q to start.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-cases", type=int, default=None, help="cases of the fuzz tests (default: each test's own)")
    parser.addoption("--fuzz-seed", type=int, default=0, help="first seed of the fuzz tests' cases")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (sm_90a) and the built MoK kernel")
    config.addinivalue_line("markers", "nvcc: needs nvcc and the CUTLASS headers (compiles, runs nothing)")
    config.addinivalue_line("markers", "slow: multi-process tests that take more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on the H200 (tools/run_gpu_suite.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
