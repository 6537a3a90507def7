"""Shared test fixtures: device parametrisation, the cuda marker, seeding, memory poisoning."""

import os
import sys

import pytest
import torch

import kda_dsa_ops

from hypothesis import settings

# The judge of the model tests is transformers' own eager code; with flash-linear-attention
# importable, transformers' kimi_linear and glm5_next call fla's Triton kernels (CUDA tensors only)
# in its place. fla stays out of the test process (bench/bench_kda.py is where it is compared).
sys.modules["fla"] = None

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=10)
settings.register_profile("gpu", deadline=None, max_examples=40, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = kda_dsa_ops.cuda_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and the CUDA build of kda_dsa_ops")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def value_checks():
    """Value checks on for the test (CPU tensors always have them)."""
    previous = kda_dsa_ops.value_checks_enabled()
    kda_dsa_ops.set_value_checks(True)
    yield
    kda_dsa_ops.set_value_checks(previous)
