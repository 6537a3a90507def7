"""The build itself: what it reports, and (in CI) that the CUDA kernels were compiled."""

import os
import subprocess
import sys

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


@pytest.mark.parametrize("name, env", [("value_checks", "KDA_DSA_OPS_CHECK_VALUES"),
                                       ("portable_sfa", "KDA_DSA_OPS_PORTABLE_SFA")])
def test_switches_start_from_their_environment_variable(name, env):
    code = f"import kda_dsa_ops; print(kda_dsa_ops._C.switch({name!r}))"
    for value, on in (("1", True), ("0", False), ("", False)):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, env: value}, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == str(on), (env, value, out)


def test_an_unknown_switch_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown switch"):
        kda_dsa_ops._C.switch("fast_math")
    with pytest.raises(ValueError, match="unknown switch"):
        kda_dsa_ops._C.set_switch("fast_math", True)


@pytest.mark.parametrize("name", ["value_checks", "portable_sfa"])
def test_switches_are_set_from_python(name):
    enabled = getattr(kda_dsa_ops, f"{name}_enabled")
    set_switch = getattr(kda_dsa_ops, f"set_{name}")
    before = enabled()
    try:
        set_switch(True)
        assert enabled() and kda_dsa_ops._C.switch(name)
        set_switch(False)
        assert not enabled() and not kda_dsa_ops._C.switch(name)
    finally:
        set_switch(before)
