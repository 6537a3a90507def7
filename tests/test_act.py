"""The fused activations against the float64 reference, on CPU and CUDA: short_conv (KDA's
short causal convolution + SiLU over packed sequences, with and without a halo) and swiglu (with
and without GLM-5.3's clamps), outputs and every gradient on awkward shapes (no tokens, one
channel, widths off the vector step, sequences shorter than the taps, row chunks past one
thread's reach, strided inputs), opcheck, and bad inputs."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda_dsa_ops as K
from kda_dsa_ops import reference as R
from kda_dsa_ops.nn import positions_in_sequence

from conftest import DEVICES
from helpers import BACKWARD_UTILS, opcheck, poison, strided
from strategies import SEEDS, seqlens
from tolerances import assert_close

F64 = torch.float64


def dtypes(device):
    return [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float64, torch.float32,
                                                                                   torch.bfloat16]


def conv_case(lens, C, W, halo, dtype, w_dtype, device, offset=3):
    """x [T, C], weight [C, W], pos of packed sequences of lens; with a halo the first sequence
    continues one that began `offset` tokens before x (context parallelism's share)."""
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    pos = positions_in_sequence(cu, T)
    if halo and lens:
        pos[:lens[0]] += offset
    x = torch.randn(T, C).to(dtype)
    w = (torch.randn(C, W) / W).to(w_dtype)
    h = torch.randn(W - 1, C).to(dtype) if halo else None
    return [t.to(device) if t is not None else None for t in (x, w, pos, h)]


def check_grads(outs, ins, ref_out, ref_ins, grad, dtype, names, scales):
    live = [(n, t, r) for n, t, r in zip(names, ins, ref_ins) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(outs, [t for _, t, _ in live], grad.to(outs.device))
    ref_grads = torch.autograd.grad(ref_out, [r for _, _, r in live], grad.to(F64))
    for (name, t, _), g, r in zip(live, grads, ref_grads):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        coarser = max(dtype, t.dtype, key=lambda d: torch.finfo(d).eps)
        assert_close(g, r, coarser, name, scale=scales.get(name))


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, lens=seqlens(max_seqs=4, max_len=40, min_len=0), C=st.sampled_from([1, 7, 8, 24, 520, 2048 + 4]),
       W=st.sampled_from([1, 2, 3, 4, 5, 8]), halo=st.booleans(), w_fp32=st.booleans(), x_view=st.booleans(),
       dtype_index=st.integers(0, 2))
def test_short_conv_matches_reference(device, seed, lens, C, W, halo, w_fp32, x_view, dtype_index):
    """y and the gradients of x, the weight and the halo against float64 on the same rounded inputs."""
    torch.manual_seed(seed)
    dtype = dtypes(device)[dtype_index]
    x, w, pos, h = conv_case(lens, C, W, halo, dtype, torch.float32 if w_fp32 else dtype, device)
    if x_view:
        x = strided(x)
    ins = [x.requires_grad_(), w.requires_grad_(), pos, h.requires_grad_() if h is not None else None]
    poison(device)
    y = K.short_conv(*ins)
    ref_ins = [t.detach().cpu().to(F64).requires_grad_() if t is not None and t.is_floating_point() else
               (t.cpu() if t is not None else None) for t in ins]
    y_ref = R.short_conv(*ref_ins)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y_ref, dtype, "y")
    if x.numel() == 0:
        return
    gy = torch.randn(y.shape).to(dtype)
    # the weight's gradient sums over tokens terms of both signs: measured against their size
    rows = torch.cat([ref_ins[3].detach(), ref_ins[0].detach()]) if h is not None else ref_ins[0].detach()
    scale = (gy.to(F64).square().sum(0) * rows.square().sum(0)).sqrt()[:, None].expand(C, W)
    check_grads(y, ins, y_ref, ref_ins, gy, dtype, ["dx", "dweight", "pos", "dhalo"], {"dweight": scale})


@pytest.mark.cuda
@pytest.mark.parametrize("W", [4, 6])
def test_short_conv_cuda_long_batch(W):
    """More row chunks than the backward's weight-gradient slots (each slot sums several), and
    sequence starts inside and at the edges of chunks: float32 against float64."""
    torch.manual_seed(0)
    lens = [1, 63, 64, 65, 5000, 9000, 2, 6700]
    x, w, pos, h = conv_case(lens, 40, W, True, torch.float32, torch.float32, "cuda")
    ins = [x.requires_grad_(), w.requires_grad_(), pos, h.requires_grad_()]
    y = K.short_conv(*ins)
    ref_ins = [t.detach().cpu().to(F64).requires_grad_() if t.is_floating_point() else t.cpu() for t in ins]
    y_ref = R.short_conv(*ref_ins)
    assert_close(y, y_ref, torch.float32, "y")
    gy = torch.randn(y.shape)
    rows = torch.cat([ref_ins[3].detach(), ref_ins[0].detach()])
    scale = (gy.to(F64).square().sum(0) * rows.square().sum(0)).sqrt()[:, None].expand(40, W)
    check_grads(y, ins, y_ref, ref_ins, gy, torch.float32, ["dx", "dweight", "pos", "dhalo"], {"dweight": scale})


@pytest.mark.parametrize("device", DEVICES)
def test_short_conv_frozen_weight_and_int32_positions(device):
    """A frozen weight (LoRA) gets no gradient and int32 positions give int64's answer."""
    x, w, pos, _ = conv_case([5, 9], 16, 4, False, torch.float32, torch.float32, device)
    x.requires_grad_()
    y = K.short_conv(x, w, pos)
    torch.testing.assert_close(K.short_conv(x, w, pos.int()), y, rtol=0, atol=0)
    (dx,) = torch.autograd.grad(y.sum(), [x])
    assert w.grad is None and dx.shape == x.shape
    dx2, dw, dh = torch.ops.kda_dsa_ops.short_conv_bwd(torch.ones_like(y), x.detach(), w, pos, None, False)
    torch.testing.assert_close(dx2, dx, rtol=0, atol=0)
    assert dw.numel() == 0 and dh.numel() == 0


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, lead=st.sampled_from([(3,), (2, 5), (0,), (1, 1, 4)]), F=st.sampled_from([0, 1, 7, 8, 40, 4096 + 8]),
       limit=st.sampled_from([0.0, 1.5]), at_bounds=st.booleans(), view=st.booleans(), dtype_index=st.integers(0, 2))
def test_swiglu_matches_reference(device, seed, lead, F, limit, at_bounds, view, dtype_index):
    """h and d gate_up against float64 (the clamps' gradient masks included, values on the bounds too:
    the gradient stops there)."""
    torch.manual_seed(seed)
    dtype = dtypes(device)[dtype_index]
    gu = (3 * torch.randn(*lead, 2 * F)).to(dtype)
    if at_bounds and gu.numel():  # values exactly on the clamps' bounds
        flat = gu.view(-1)
        flat[::5], flat[1::7] = limit, -limit
    gu = gu.to(device)
    if view and len(lead) > 1:
        gu = gu.transpose(0, 1).contiguous().transpose(0, 1)
    gu.requires_grad_()
    poison(device)
    h = K.swiglu(gu, limit)
    ref = gu.detach().cpu().to(F64).requires_grad_()
    h_ref = R.swiglu(ref, limit)
    assert h.dtype == dtype and h.shape == (*lead, F)
    assert_close(h, h_ref, dtype, "h")
    if gu.numel() == 0:
        return
    check_grads(h, [gu], h_ref, [ref], torch.randn(h.shape).to(dtype), dtype, ["dgate_up"], {})


@pytest.mark.parametrize("device", DEVICES)
def test_act_opcheck(device):
    x, w, pos, h = conv_case([6, 4], 24, 4, True, torch.float32, torch.float32, device)
    ops = torch.ops.kda_dsa_ops
    opcheck(ops.short_conv.default, (strided(x.requires_grad_()), w.requires_grad_(), pos, h.requires_grad_()))
    opcheck(ops.short_conv.default, (x, w.detach(), pos, None))
    opcheck(ops.short_conv_bwd.default, (torch.randn(10, 24, device=device), x.detach(), w.detach(), pos, h.detach(),
                                         True), test_utils=BACKWARD_UTILS)
    gu = torch.randn(5, 48, device=device, requires_grad=True)
    opcheck(ops.swiglu.default, (gu, 1.5))
    opcheck(ops.swiglu_bwd.default, (torch.randn(5, 24, device=device), gu.detach(), 0.0), test_utils=BACKWARD_UTILS)


@pytest.mark.parametrize("device", DEVICES)
def test_act_bad_inputs_raise(device):
    x, w, pos, h = conv_case([6, 4], 8, 4, True, torch.float32, torch.float32, device)
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        K.short_conv(x[None], w, pos)
    with pytest.raises(RuntimeError, match=r"weight must be \[C, W\] with C = 8"):
        K.short_conv(x, w[:7], pos)
    with pytest.raises(RuntimeError, match="1 to 8 taps"):
        K.short_conv(x, torch.zeros(8, 9, device=device), pos)
    with pytest.raises(RuntimeError, match=r"pos must be \[T\] with T = 10"):
        K.short_conv(x, w, pos[:9])
    with pytest.raises(RuntimeError, match="pos must have dtype in"):
        K.short_conv(x, w, pos.float())
    with pytest.raises(RuntimeError, match=r"halo must be \[W - 1, C\] = \[3, 8\]"):
        K.short_conv(x, w, pos, h[:2])
    with pytest.raises(RuntimeError, match="halo must have the dtype of x"):
        K.short_conv(x, w, pos, h.double())
    with pytest.raises(RuntimeError, match=r"grad_y must be \[T, C\]"):
        torch.ops.kda_dsa_ops.short_conv_bwd(x[:5], x, w, pos, h, True)
    gu = torch.randn(3, 8, device=device)
    with pytest.raises(RuntimeError, match="last dim must be even"):
        K.swiglu(gu[:, :7])
    with pytest.raises(RuntimeError, match="limit must be finite and >= 0"):
        K.swiglu(gu, -1.0)
    with pytest.raises(RuntimeError, match=r"grad_h must be \[..., F\]"):
        torch.ops.kda_dsa_ops.swiglu_bwd(gu, gu, 0.0)
    with pytest.raises(ValueError, match="last dim must be even"):
        R.swiglu(gu[:, :7])


@pytest.mark.cuda
def test_act_cuda_rejects_float64_and_other_devices():
    x, w, pos, _ = conv_case([6], 8, 4, False, F64, F64, "cuda")
    with pytest.raises(RuntimeError, match="CUDA kernel takes float32, bfloat16 or float16"):
        K.short_conv(x, w, pos)
    with pytest.raises(RuntimeError, match="pos must be on the same device as x"):
        K.short_conv(x.float(), w, pos.cpu())
    with pytest.raises(RuntimeError, match="CUDA kernel takes float32, bfloat16 or float16"):
        K.swiglu(torch.zeros(2, 4, dtype=F64, device="cuda"))
