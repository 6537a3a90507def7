"""hc_mix (hyper-connections' per-token stream mixing) against the float64 reference, on CPU and
CUDA: outputs and every gradient on awkward shapes (no tokens, no channels, odd widths, one to
eight streams, strided coefficients), opcheck, and bad inputs."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda_dsa_ops as K
from kda_dsa_ops import reference as R

from conftest import DEVICES
from helpers import BACKWARD_UTILS, opcheck, poison, strided
from strategies import SEEDS
from tolerances import assert_close

F64 = torch.float64


def dtypes(device):
    return [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float64, torch.float32,
                                                                                   torch.bfloat16]


def mix_case(T, n, m, D, add, dtype, a_dtype, device):
    """x [T, n, D], a [T, m, n] (sometimes a transposed view, as the model's comb^T), z, b."""
    x = torch.randn(T, n, D).to(dtype)
    a = torch.randn(T, m, n).to(a_dtype)
    z = torch.randn(T, D).to(dtype) if add else None
    b = torch.randn(T, m).to(a_dtype) if add else None
    return [t.to(device) if t is not None else None for t in (x, a, z, b)]


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, T=st.integers(0, 9), n=st.integers(1, 8), m=st.sampled_from(["one", "n", "other"]),
       D=st.sampled_from([0, 1, 7, 8, 40, 4096 + 3]), add=st.booleans(), a_fp32=st.booleans(),
       a_view=st.booleans(), dtype_index=st.integers(0, 2))
def test_hc_mix_matches_reference(device, seed, T, n, m, D, add, a_fp32, a_view, dtype_index):
    """Outputs and the gradients of x, a, z and b against float64 on the same rounded inputs."""
    torch.manual_seed(seed)
    dtype = dtypes(device)[dtype_index]
    m = {"one": 1, "n": n, "other": (n * 5) % 8 + 1}[m]
    a_dtype = torch.float32 if a_fp32 else dtype
    x, a, z, b = mix_case(T, n, m, D, add, dtype, a_dtype, device)
    if a_view:  # the model passes comb^T: a view with swapped strides
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    ins = [t.requires_grad_() if t is not None else None for t in (x, a, z, b)]
    poison(device)
    y = K.hc_mix(*ins)
    ref_ins = [t.detach().cpu().to(F64).requires_grad_() if t is not None else None for t in ins]
    y_ref = R.hc_mix(*ref_ins)
    assert y.dtype == dtype and y.shape == (T, m, D)
    assert_close(y, y_ref, dtype, "y")
    gy = torch.randn(y.shape).to(dtype)
    live = [t for t in ins if t is not None]
    grads = torch.autograd.grad(y, live, gy.to(device))
    ref_grads = torch.autograd.grad(y_ref, [t for t in ref_ins if t is not None], gy.to(F64))
    coarser = max(dtype, a_dtype, key=lambda d: torch.finfo(d).eps)  # da and db come in a's dtype
    for name, g, t, r in zip(["dx", "da", "dz", "db"], grads, live, ref_grads):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        # da, db: dot products over D of terms of both signs, measured against the terms' size
        scale = None if name in ("dx", "dz") else (gy.to(F64).abs().norm() * (x.detach().cpu().to(F64).abs().norm()
                                                                              + (0 if z is None else z.detach().cpu().to(F64).norm())))
        assert_close(g, r, dtype if name in ("dx", "dz") else coarser, name, scale=scale)


@pytest.mark.parametrize("device", DEVICES)
def test_hc_mix_opcheck(device):
    x, a, z, b = mix_case(5, 4, 4, 24, True, torch.float32, torch.float32, device)
    ops = torch.ops.kda_dsa_ops
    opcheck(ops.hc_mix.default, (x.requires_grad_(), strided(a.requires_grad_()), z.requires_grad_(),
                                 b.requires_grad_()))
    opcheck(ops.hc_mix.default, (x, a[:, :1], None, None))
    opcheck(ops.hc_mix_bwd.default, (strided(torch.randn(5, 4, 24, device=device)), x.detach(), a.detach(),
                                     z.detach(), b.detach()), test_utils=BACKWARD_UTILS)


@pytest.mark.parametrize("device", DEVICES)
def test_hc_mix_bad_inputs_raise(device):
    x, a, z, b = mix_case(3, 4, 4, 8, True, torch.float32, torch.float32, device)
    with pytest.raises(RuntimeError, match="x must have 1 to 8 streams"):
        K.hc_mix(torch.zeros(3, 9, 8, device=device), torch.zeros(3, 1, 9, device=device))
    with pytest.raises(RuntimeError, match="a must give 1 to 8 streams"):
        K.hc_mix(x, torch.zeros(3, 9, 4, device=device))
    with pytest.raises(RuntimeError, match=r"a must be \[T, m, n\] with T = 3, n = 4"):
        K.hc_mix(x, a[:, :, :3])
    with pytest.raises(RuntimeError, match="z and b come together"):
        K.hc_mix(x, a, z, None)
    with pytest.raises(RuntimeError, match=r"z must be \[T, D\]"):
        K.hc_mix(x, a, z[:, :4], b)
    with pytest.raises(RuntimeError, match=r"b must be \[T, m\]"):
        K.hc_mix(x, a, z, b[:, :2])
    with pytest.raises(RuntimeError, match="z must have the dtype of x"):
        K.hc_mix(x, a, z.double(), b)
    with pytest.raises(RuntimeError, match="x must be 3-D"):
        K.hc_mix(x[0], a)
    with pytest.raises(RuntimeError, match=r"grad_y must be \[T, m, D\]"):
        torch.ops.kda_dsa_ops.hc_mix_bwd(torch.zeros(3, 4, 7, device=device), x, a, z, b)
    with pytest.raises(ValueError, match="z and b come together"):
        R.hc_mix(x, a, z, None)


@pytest.mark.cuda
def test_hc_mix_cuda_rejects_float64_and_other_devices():
    x, a, _, _ = mix_case(3, 4, 4, 8, False, F64, F64, "cuda")
    with pytest.raises(RuntimeError, match="CUDA kernel takes float32, bfloat16 or float16"):
        K.hc_mix(x, a)
    with pytest.raises(RuntimeError, match="a must be on the same device as x"):
        K.hc_mix(x.float(), a.float().cpu())
