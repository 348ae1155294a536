import os
import random

import pytest
import torch

import moeblaze


def gpu_available():
    return torch.cuda.is_available() and moeblaze.has_cuda()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    why = ("skipped: no GPU" if not torch.cuda.is_available() else
           "skipped: no GPU backend (moeblaze was built without CUDA)")
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return (f"moeblaze: {moeblaze.library_path()} (CUDA backend: {moeblaze.has_cuda()}), torch "
            f"{torch.__version__}, GPU: "
            f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")


@pytest.fixture
def seed(request):
    """A fresh seed per test (printed on failure), or MOEBLAZE_TEST_SEED to replay one."""
    s = int(os.environ.get("MOEBLAZE_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
    torch.manual_seed(s)
    print(f"seed {s} (replay: MOEBLAZE_TEST_SEED={s})")
    return s
