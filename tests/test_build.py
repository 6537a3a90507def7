"""The build itself: what it reports, and (in CI) that the CUDA kernels were compiled."""

import os

import pytest
import torch

import kda_dsa_ops


def test_build_info_reports_backends():
    info = kda_dsa_ops.build_info()
    assert "cpu" in info["backends"]
    assert info["version"] == kda_dsa_ops.__version__
    if "cuda" in info["backends"]:
        assert info["cuda_archs"], "a CUDA build must name its architectures"


@pytest.mark.skipif(os.environ.get("KDA_DSA_OPS_EXPECT_CUDA_BUILD") != "1",
                    reason="set by tools/test.sh when nvcc was available to the build")
def test_cuda_kernels_were_built():
    assert "cuda" in kda_dsa_ops.build_info()["backends"]
    assert "9.0a" in kda_dsa_ops.build_info()["cuda_archs"]
    assert torch.ops.kda_dsa_ops.grouped_mm.default.has_kernel_for_dispatch_key("CUDA")


def test_value_checks_switch():
    before = kda_dsa_ops.value_checks_enabled()
    try:
        kda_dsa_ops.set_value_checks(True)
        assert kda_dsa_ops.value_checks_enabled()
        kda_dsa_ops.set_value_checks(False)
        assert not kda_dsa_ops.value_checks_enabled()
    finally:
        kda_dsa_ops.set_value_checks(before)
