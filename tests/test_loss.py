"""cross_entropy_rows_ (the LM head's per-row cross-entropy, its argmax and its gradient, in place)
against the float64 reference on CPU and CUDA: awkward widths (one class, not a multiple of the
vector width), ignored rows, -inf logits, tied maxima, NaN / +inf rows, opcheck, bad inputs; and
the chunked linear cross-entropy on the CUDA kernels in bf16 against the composition."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kda_dsa_ops as K
from kda_dsa_ops import reference as R
from kda_dsa_ops.nn import chunked_linear_cross_entropy

from conftest import DEVICES
from helpers import opcheck
from strategies import SEEDS
from tolerances import assert_close

F64 = torch.float64


def dtypes(device):
    return [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [F64, torch.float32,
                                                                                   torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, N=st.integers(0, 9), V=st.sampled_from([1, 7, 8, 64, 1003, 4096]), dtype_index=st.integers(0, 2),
       ignored=st.booleans(), masked=st.booleans(), tied=st.booleans(), write_grad=st.booleans(),
       scale=st.sampled_from([1.0, 0.37]))
def test_cross_entropy_rows_matches_reference(device, seed, N, V, dtype_index, ignored, masked, tied, write_grad,
                                              scale):
    torch.manual_seed(seed)
    dtype = dtypes(device)[dtype_index]
    x = (torch.randn(N, V) * 3).to(dtype)
    if tied:  # the row's largest value at several places: the argmax is the first of them
        x[:, torch.randperm(V)[:3]] = 12.0
    if masked and V > 1:  # -inf logits (a masked vocabulary) are legal
        x[:, ::3] = -math.inf
    labels = torch.randint(0, V, (N,))
    if masked and V > 1:
        labels = torch.where(labels % 3 == 0, (labels - 1).clamp_min(1), labels)  # not a masked one
    if ignored and N > 1:
        labels[::2] = -7
    ours = x.clone().to(device)
    loss, top = K.cross_entropy_rows_(ours, labels.to(device), -7, scale, write_grad)
    ref_x = x.to(F64, copy=True)
    ref, ref_top = R.cross_entropy_rows_(ref_x, labels, -7, scale, write_grad)
    assert loss.dtype == (F64 if dtype == F64 else torch.float32) and loss.shape == (N,)
    assert_close(loss, ref, dtype, "loss")
    assert top.dtype == torch.int64 and torch.equal(top.cpu(), ref_top), "argmax"
    if write_grad:
        assert_close(ours, ref_x, dtype, "gradient")
    else:
        assert torch.equal(ours.cpu(), x), "logits changed without write_grad"


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_rows_non_finite(device):
    """A NaN or +inf logit makes its row's loss and gradient NaN; a row of -inf gives a NaN loss;
    the other rows are untouched by them. The argmax passes NaNs over, takes the first +inf, and
    is -1 on a row of -inf."""
    x = torch.randn(4, 40, device=device)
    x[0, [0, 5]], x[1, [9, 30]], x[2] = math.nan, math.inf, -math.inf
    labels = torch.tensor([1, 2, 3, 4], device=device)
    want = [torch.where(x[0].isnan(), -math.inf, x[0]).argmax().item(), 9, -1, x[3].argmax().item()]
    loss, top = K.cross_entropy_rows_(x, labels)
    assert top.tolist() == want
    assert loss[:3].isnan().all() and loss[3].isfinite()
    assert x[:2].isnan().all() and x[3].isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_rows_opcheck_and_bad_inputs(device, value_checks):
    x, labels = torch.randn(5, 33, device=device), torch.randint(0, 33, (5,), device=device)
    opcheck(torch.ops.kda_dsa_ops.cross_entropy_rows_.default, (x, labels, -100, 0.5, True),
            test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match=r"labels must lie in \[0, 33\) or equal ignore_index"):
        K.cross_entropy_rows_(x, torch.full((5,), 33, device=device))
    with pytest.raises(RuntimeError, match="logits must be contiguous"):
        K.cross_entropy_rows_(x.t(), labels)
    with pytest.raises(RuntimeError, match="labels must have dtype"):
        K.cross_entropy_rows_(x, labels.int())
    with pytest.raises(RuntimeError, match="one entry per row"):
        K.cross_entropy_rows_(x, labels[:4])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 33\)"):
        R.cross_entropy_rows_(x, torch.full((5,), -2, device=device))


@pytest.mark.cuda
@pytest.mark.parametrize("train_head", [False, True])
def test_chunked_cross_entropy_cuda_bf16_matches_composition(train_head):
    """bf16 on the kernels (two chunks and a remainder, ignored tokens) against the float64 loss of
    the same bf16 inputs: the loss, dh and dW within the bf16 row."""
    torch.manual_seed(0)
    T, V, D = 1000, 5003, 64
    h = torch.randn(T, D).to(torch.bfloat16)
    w = (torch.randn(V, D) * D ** -0.5).to(torch.bfloat16)
    labels = torch.randint(0, V, (T,))
    labels[::7] = -100
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_(train_head)
    loss = chunked_linear_cross_entropy(hc, wc, labels.cuda(), chunk=384)
    h64, w64 = h.to(F64).requires_grad_(), w.to(F64).requires_grad_(train_head)
    ref = F.cross_entropy(h64 @ w64.t(), labels)
    assert_close(loss, ref, torch.bfloat16, "loss")
    wrt, ref_wrt = ((hc, wc), (h64, w64)) if train_head else ((hc,), (h64,))
    for name, a, b in zip(["dh", "dW"], torch.autograd.grad(loss, wrt), torch.autograd.grad(ref, ref_wrt)):
        assert a.dtype == torch.bfloat16
        assert_close(a, b, torch.bfloat16, name)


def test_cross_entropy_rows_under_compile():
    """torch.compile(fullgraph=True) keeps the in-place write: the loss and the gradient written
    into the logits equal eager's."""
    def f(logits, labels):
        x = logits.clone()
        return K.cross_entropy_rows_(x, labels, -100, 0.5, True), x

    logits, labels = torch.randn(6, 50), torch.tensor([1, 2, -100, 49, 0, 7])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(logits, labels), f(logits, labels)):
        torch.testing.assert_close(a, b)
