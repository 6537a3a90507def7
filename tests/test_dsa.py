"""DSA ops (lightning indexer, sparse attention and their gradients) against the float64
reference and dense masked attention: varlen, fewer visible keys than topk, repeated keys, rows
without keys, GQA and MQA layouts, opcheck, torch.compile(fullgraph=True), the indexer's KL loss,
and bad inputs; the CUDA kernels (bf16/fp16) against the same reference, their deterministic dkv
and their limits."""

import contextlib
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kda_dsa_ops as K
from kda_dsa_ops import reference as R
from kda_dsa_ops.nn.loss import indexer_kl_loss

from conftest import DEVICES
from helpers import BACKWARD_UTILS, opcheck, poison, strided
from strategies import SEEDS, seqlens
from tolerances import assert_close

F64 = torch.float64
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@contextlib.contextmanager
def portable_sfa(on):
    before = K.portable_sfa_enabled()
    K.set_portable_sfa(on)
    try:
        yield
    finally:
        K.set_portable_sfa(before)


def cu_of(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


def small_ints(*shape, dtype):
    """Integer-valued inputs: every score is an exact integer in every dtype, so the kernel and
    the reference rank keys identically (ties, which are frequent, go to the lower index)."""
    return torch.randint(-3, 4, shape).to(dtype)


@given(seed=SEEDS, lens=seqlens(max_seqs=4, max_len=40), extra_keys=st.lists(st.integers(0, 8), min_size=4,
       max_size=4), topk=st.sampled_from([1, 3, 16, 64]), Hi=st.integers(1, 4), dtype=st.sampled_from(DTYPES))
def test_lightning_indexer_matches_reference(seed, lens, extra_keys, topk, Hi, dtype):
    torch.manual_seed(seed)
    klens = [n + e for n, e in zip(lens, extra_keys)]  # keys >= queries per sequence (bottom-right aligned)
    T, Tk, Di = sum(lens), sum(klens), 8
    q, k, w = small_ints(T, Hi, Di, dtype=dtype), small_ints(Tk, Di, dtype=dtype), small_ints(T, Hi, dtype=dtype)
    idx, sc = K.lightning_indexer(q, k, w, cu_of(lens), cu_of(klens), topk)
    idx_ref, sc_ref = R.lightning_indexer(q.to(F64), k.to(F64), w.to(F64), cu_of(lens), cu_of(klens), topk)
    assert idx.dtype == torch.int32 and sc.dtype == (F64 if dtype == F64 else torch.float32)
    assert torch.equal(idx, idx_ref)
    assert torch.equal(sc.to(F64), sc_ref)


def kpool_inputs(T, Tk, Hi, Di, kpool, dtype, exact):
    """q, k, gate, ape, w for the k-pooled indexer. exact: integer q, k, w and a zero gate and ape
    (uniform pools: the pooled keys are sums / kpool, exact in every dtype for kpool a power of
    two, and so is every score), else normal draws."""
    if exact:
        zeros = torch.zeros(Tk, Di, dtype=dtype), torch.zeros(kpool, Di, dtype=dtype)
        return small_ints(T, Hi, Di, dtype=dtype), small_ints(Tk, Di, dtype=dtype), *zeros, small_ints(T, Hi,
                                                                                                     dtype=dtype)
    return (torch.randn(T, Hi, Di, dtype=dtype), torch.randn(Tk, Di, dtype=dtype), torch.randn(Tk, Di, dtype=dtype),
            torch.randn(kpool, Di, dtype=dtype), torch.randn(T, Hi, dtype=dtype))


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, lens=seqlens(max_seqs=3, max_len=90), extra_keys=st.lists(st.integers(0, 40), min_size=3,
       max_size=3), kpool=st.sampled_from([1, 2, 4, 16]), pools=st.sampled_from([0, 1, 3, 8]), tail=st.booleans(),
       exact=st.booleans())
def test_kpool_indexer_matches_reference(device, seed, lens, extra_keys, kpool, pools, tail, exact):
    """GLM-5.3's k-pooled indexer on the indexer kernel (its queries split by pool phase) against
    the reference: the same indices, ties to the lower pool, with more keys than queries per
    sequence, empty sequences, fewer visible pools than wanted, kpool 1. CPU in float64 (normal
    draws, or exact scores in float32 / bf16); CUDA bf16 with exact scores."""
    torch.manual_seed(seed)
    if device == "cuda" and not exact:
        exact = True  # bf16 pooled keys and scores: only exact scores rank as the float64 reference does
    dtype = torch.bfloat16 if device == "cuda" else (F64 if not exact else [torch.float32, torch.bfloat16][seed % 2])
    klens = [n + e for n, e in zip(lens, extra_keys)]
    T, Tk, Hi, Di = sum(lens), sum(klens), 3, 16
    topk = max(pools * kpool, 1)
    ins = kpool_inputs(T, Tk, Hi, Di, kpool, dtype, exact)
    got = K.kpool_indexer(*[t.to(device) for t in ins], cu_of(lens).to(device), topk, kpool, tail,
                          cu_of(klens).to(device))
    expected = R.kpool_indexer(*[t.to(F64) for t in ins], cu_of(lens), topk, kpool, tail, cu_of(klens))
    assert got.dtype == torch.int32 and got.shape == expected.shape
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, lens=seqlens(max_seqs=3, max_len=60), extra_keys=st.lists(st.integers(0, 30), min_size=3,
       max_size=3), kpool=st.sampled_from([1, 2, 4]), pools=st.sampled_from([1, 3, 8]))
def test_kpool_indexer_scores_and_gradients_match_reference(device, seed, lens, extra_keys, kpool, pools):
    """with_scores: the chosen pools' scores, in the indices' pool order, and their gradients w.r.t.
    q, k, gate, ape and w (the indexer's backward kernel, then the pooling's autograd) against the
    float64 reference; -inf where a query has fewer pools. CPU float64; CUDA bf16 with exact
    scores (integer q, k, w and a zero gate and ape: the same pools chosen; the gate's and ape's
    gradients are not zero there)."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else F64
    klens = [n + e for n, e in zip(lens, extra_keys)]
    T, Tk, Hi, Di = sum(lens), sum(klens), 3, 16
    topk = pools * kpool
    q, k, gate, ape, w = kpool_inputs(T, Tk, Hi, Di, kpool, dtype, exact=device == "cuda")
    leaves = [t.to(device).requires_grad_() for t in (q, k, gate, ape, w)]
    idx, sc = K.kpool_indexer(*leaves, cu_of(lens).to(device), topk, kpool, True, cu_of(klens).to(device),
                              with_scores=True)
    ref_leaves = [t.detach().cpu().to(F64).requires_grad_() for t in leaves]
    ref_idx, ref_sc = R.kpool_indexer(*ref_leaves, cu_of(lens), topk, kpool, True, cu_of(klens), with_scores=True)
    assert torch.equal(idx.cpu(), ref_idx)
    assert sc.shape == (T, pools) and sc.dtype == (F64 if dtype == F64 else torch.float32)
    finite = torch.isfinite(ref_sc)
    assert torch.equal(torch.isfinite(sc).cpu(), finite)
    assert_close(sc.cpu()[finite], ref_sc[finite], dtype if device == "cuda" else F64, "scores")
    if not finite.any():
        return
    g = torch.randn(T, pools, dtype=F64).masked_fill(~finite, 0)
    got = torch.autograd.grad(sc.masked_fill(~torch.isfinite(sc), 0), leaves, g.to(device, sc.dtype),
                              allow_unused=True)
    ref = torch.autograd.grad(ref_sc.masked_fill(~finite, 0), ref_leaves, g, allow_unused=True)
    for name, a, b in zip(["dq", "dk", "dgate", "dape", "dw"], got, ref):
        b = torch.zeros_like(ref_leaves[0] if name == "dq" else b) if b is None else b
        a = torch.zeros_like(b) if a is None else a
        assert a.dtype == dtype
        assert_close(a.cpu(), b, dtype, name)


def selected_dots(q, k, idx):
    """q_h . k_s for each query's selected keys s, and the size of its terms |q_h| . |k_s|
    ([T, H, topk] float64 on the CPU; -1 entries read key 0)."""
    sel = k.detach().cpu().to(F64)[idx.cpu().clamp(min=0).long()]  # [T, topk, Di]
    qd = q.detach().cpu().to(F64)
    return torch.einsum("thd,tsd->ths", qd, sel), torch.einsum("thd,tsd->ths", qd.abs(), sel.abs())


def off_the_kink(q, k, idx, g):
    """g with zeros for the selected keys where some head's q . k is within rounding of the ReLU's
    kink: there the float32 sums of the kernels and the float64 reference may fall on either side,
    and the derivative (0 or w k) follows the rounding, not the inputs."""
    d, terms = selected_dots(q, k, idx)
    return g.masked_fill((d.abs() <= 1e-5 * terms).any(1).to(g.device), 0)


def dw_terms(q, k, idx, g):
    """The size of the terms that dw sums, sum_s |g| |q_h| . |k_s|: dw = sum_s g relu(q_h . k_s)
    keeps the float32 rounding of a dot product that cancels to near zero."""
    return torch.einsum("ths,ts->th", selected_dots(q, k, idx)[1], g.detach().cpu().to(F64).abs())


@given(seed=SEEDS, lens=seqlens(max_seqs=3, max_len=30), topk=st.sampled_from([1, 4, 32]),
       dtype=st.sampled_from(DTYPES))
def test_lightning_indexer_bwd_matches_reference(seed, lens, topk, dtype):
    torch.manual_seed(seed)
    T, Hi, Di = sum(lens), 3, 16
    q = torch.randn(T, Hi, Di).to(dtype).requires_grad_()
    k = torch.randn(T, Di).to(dtype).requires_grad_()
    w = torch.randn(T, Hi).to(dtype).requires_grad_()
    idx, sc = K.lightning_indexer(q, k, w, cu_of(lens), cu_of(lens), topk)
    g = off_the_kink(q, k, idx, torch.randn(sc.shape, dtype=sc.dtype).masked_fill(idx < 0, 0))
    grads = torch.autograd.grad(sc.masked_fill(idx < 0, 0), (q, k, w), g)
    ref = R.lightning_indexer_bwd(q.detach().to(F64), k.detach().to(F64), w.detach().to(F64), idx, g.to(F64))
    for name, a, b in zip(["dq", "dk", "dw"], grads, ref):
        assert a.dtype == dtype
        assert_close(a, b, dtype, name, scale=dw_terms(q, k, idx, g) if name == "dw" else None)


def attn_case(T, Tk, H, Hkv, D, dv, topk, dtype, gated, empty_rows=True, repeats=True):
    """repeats=False: each query's keys distinct (as an indexer's top-k are), but for query T // 3,
    which chooses key 0 twice."""
    q = torch.randn(T, H, D).to(dtype)
    kv = torch.randn(Tk, Hkv, D).to(dtype)
    if repeats:
        idx = torch.randint(-1, Tk, (T, Hkv, topk), dtype=torch.int32)  # repeats and -1 entries included
    else:  # the first topk of a random order of the keys and topk -1 entries
        idx = torch.rand(T, Hkv, Tk + topk).argsort(-1)[..., :topk].int()
        idx[idx >= Tk] = -1
        idx[T // 3, :, :2] = 0
    if empty_rows and T > 1:
        idx[T // 2] = -1  # a query with no key at all
    gate = torch.randn(T, H, dv).to(dtype) if gated else None
    return q, kv, idx, gate


@given(seed=SEEDS, T=st.integers(1, 12), Tk=st.integers(1, 40), layout=st.sampled_from(["mqa", "gqa"]),
       G=st.sampled_from([1, 2, 4]), topk=st.sampled_from([1, 5, 33]), gated=st.booleans(),
       dtype=st.sampled_from(DTYPES))
def test_sparse_attention_matches_reference(seed, T, Tk, layout, G, topk, gated, dtype):
    torch.manual_seed(seed)
    Hkv, D, dv = (1, 36, 32) if layout == "mqa" else (2, 16, 16)
    q, kv, idx, gate = attn_case(T, Tk, Hkv * G, Hkv, D, dv, topk, dtype, gated)
    ins = [t.requires_grad_() for t in (q, kv) + ((gate,) if gated else ())]
    o, lse, p = K.sparse_attention(q, kv, idx, 0.3, dv, gate, return_p=True)
    ref_ins = [t.detach().to(F64).requires_grad_() for t in ins]
    o_ref, lse_ref, p_ref = R.sparse_attention(ref_ins[0], ref_ins[1], idx, 0.3, dv, ref_ins[2] if gated else None,
                                              return_p=True)
    assert o.dtype == dtype and lse.dtype == (F64 if dtype == F64 else torch.float32)
    acc = F64 if dtype == F64 else torch.float32
    assert_close(o, o_ref, dtype, "o")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    # lse is a dot product plus a log-sum-exp: measured against the size of the dot products'
    # terms (Cauchy-Schwarz: scale |q| max |k|), since a logit may cancel to near zero.
    lse_terms = 0.3 * ref_ins[0].detach().norm(dim=-1) * ref_ins[1].detach().norm(dim=-1).max()
    assert_close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), acc, "lse", scale=lse_terms)
    assert_close(p, p_ref, acc, "p")
    do = torch.randn(o.shape, dtype=F64)
    grads = torch.autograd.grad(o, ins, do.to(dtype))
    ref_grads = torch.autograd.grad(o_ref, ref_ins, do.to(dtype).to(F64))
    scales = attn_grad_scales(ref_ins[0].detach(), ref_ins[1].detach(), do.to(dtype).to(F64), 0.3)
    for name, a, b in zip(["dq", "dkv", "dgate"], grads, ref_grads):
        assert_close(a, b, dtype, name, scale=scales.get(name))


def attn_grad_scales(q, kv, do, scale):
    """Sizes of the terms dq and dkv are summed from. dlogits = p (dp - delta) cancels when the
    selected keys agree (e.g. one key chosen many times): the true gradient is then ~0 and only
    rounding of terms of size scale |do| max|v| max|k| (dq) or scale |do| max|v| |q| (dkv) is left."""
    kmax = kv.norm(dim=-1).max()
    dn = do.norm(dim=-1)
    return {"dq": scale * dn * kmax * kmax, "dkv": scale * dn * kmax * q.norm(dim=-1)}


def test_sparse_attention_matches_dense_masked_attention():
    torch.manual_seed(0)
    T, Tk, H, D = 6, 9, 4, 8
    q, kv, idx, gate = attn_case(T, Tk, H, 1, D, D, 5, F64, True, empty_rows=False)
    idx = torch.stack([torch.randperm(Tk)[:5] for _ in range(T)])[:, None].int()  # distinct keys per row
    o, lse, _ = K.sparse_attention(q, kv, idx, 0.5, D, gate)
    mask = torch.zeros(T, Tk, dtype=torch.bool)
    mask.scatter_(1, idx[:, 0].long(), True)
    logits = torch.einsum("thd,sd->ths", q, kv[:, 0]) * 0.5
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    dense = torch.softmax(logits, -1) @ kv[:, 0] * torch.sigmoid(gate)
    assert_close(o, dense, F64, "o")
    assert_close(lse, torch.logsumexp(logits, -1), F64, "lse")


def test_sparse_attention_row_without_keys_gives_zero():
    q, kv, idx, gate = attn_case(3, 5, 2, 1, 8, 8, 4, torch.float32, True)
    idx[:] = -1
    ins = [t.requires_grad_() for t in (q, kv, gate)]
    o, lse, _ = K.sparse_attention(*ins[:2], idx, 0.5, 8, ins[2])
    assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all()
    for g in torch.autograd.grad(o, ins, torch.randn_like(o)):
        assert torch.equal(g, torch.zeros_like(g))


# (device, dtype, (Hkv, Dqk, dv), portable, heads per kv head): the CPU kernel; on CUDA the portable
# kernel and (sm_90) the Hopper MLA ones (the backward's for more than 16 heads)
ATTN_PATHS = [("cpu", F64, (2, 16, 16), False, 2), ("cpu", torch.float32, (1, 36, 32), False, 2),
              pytest.param("cuda", torch.bfloat16, (2, 128, 128), True, 2, marks=pytest.mark.cuda),
              pytest.param("cuda", torch.bfloat16, (1, 576, 512), False, 2, marks=pytest.mark.cuda),
              pytest.param("cuda", torch.bfloat16, (1, 512, 512), False, 64, marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device, dtype, layout, portable, G", ATTN_PATHS)
@pytest.mark.parametrize("case", ["q_nan", "kv_nan", "kv_inf_value", "unselected_nan"])
def test_sparse_attention_nonfinite_inputs_give_the_references_nan(device, dtype, layout, portable, G, case):
    """NaN in q: its row's o and lse are NaN (not the no-key marker, o = 0 and lse = -inf); NaN in a
    selected kv row: the rows that select it; +inf in a selected row's value channel whose logit
    is -inf: that channel of those rows only; NaN in a row no query selects: nothing. The
    gradients are non-finite where the reference's are."""
    Hkv, D, dv = layout
    T, Tk, topk = 6, 40, 64
    q, kv, idx, _ = attn_case(T, Tk, Hkv * G, Hkv, D, dv, topk, dtype, False)
    idx[idx == 7] = 8  # row 7 is selected by no query
    picked = int(idx[0, 0, 0])
    if case == "q_nan":
        q[1, 0, 3] = float("nan")
    elif case == "kv_nan":
        kv[picked, 0, 2] = float("nan")
    elif case == "kv_inf_value":
        q[..., 1] = -q[..., 1].abs() - 0.5  # every logit of the row is -inf: probability 0 meets inf
        kv[picked, 0, 1] = float("inf")
    else:
        kv[7, :, 2] = float("nan")
    ins = [t.to(device).requires_grad_() for t in (q, kv)]
    with portable_sfa(portable):
        o, lse, _ = K.sparse_attention(*ins, idx.to(device), 0.1, dv)
        grads = torch.autograd.grad(o, ins, torch.ones_like(o))
    ref_ins = [t.detach().to(F64).requires_grad_() for t in (q, kv)]
    o_ref, lse_ref, _ = R.sparse_attention(*ref_ins, idx, 0.1, dv)
    ref_grads = torch.autograd.grad(o_ref, ref_ins, torch.ones_like(o_ref))
    if case == "unselected_nan":
        assert torch.isfinite(o_ref).all()
    else:
        assert not torch.isfinite(o_ref).all()
    if case == "kv_inf_value":
        assert torch.isfinite(o_ref[..., 0]).all() and torch.isfinite(lse_ref[0]).all()
    lse_terms = 0.1 * q.to(F64).nan_to_num(0).norm(dim=-1) * kv.to(F64).nan_to_num(0, 0, 0).norm(dim=-1).max()
    for name, a, e in [("o", o, o_ref), ("lse", lse, lse_ref)] + list(zip(["dq", "dkv"], grads, ref_grads)):
        a = a.detach().cpu().to(F64)
        mask = torch.isfinite(e) | (e == -math.inf) if name == "lse" else torch.isfinite(e)
        assert torch.equal(torch.isfinite(a) | (a == -math.inf) if name == "lse" else torch.isfinite(a), mask), (
            f"{name}: non-finite in other places than the reference's")
        if name in ("o", "lse"):
            assert_close(a.where(mask, 0.0).nan_to_num(neginf=0), e.where(mask, 0.0).nan_to_num(neginf=0),
                         dtype, name, scale=None if name == "o" else lse_terms)


@pytest.mark.parametrize("device, Di", [("cpu", 8), pytest.param("cuda", 64, marks=pytest.mark.cuda)])
def test_lightning_indexer_never_selects_a_nan_score(device, Di):
    """A NaN in key 5 makes every q.k with it NaN: its score is NaN (not 0, which a ReLU that drops
    NaN would give) and it is never selected, as in the reference; the other keys are ranked as
    before."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens = [12, 9]
    T, Hi = sum(lens), 3
    q, k, w = small_ints(T, Hi, Di, dtype=dtype), small_ints(T, Di, dtype=dtype), small_ints(T, Hi, dtype=dtype)
    k[5, 0] = float("nan")
    cu = cu_of(lens)
    idx, sc = K.lightning_indexer(q.to(device), k.to(device), w.to(device), cu.to(device), cu.to(device), 16)
    idx_ref, sc_ref = R.lightning_indexer(q.to(F64), k.to(F64), w.to(F64), cu, cu, 16)
    assert not (idx_ref == 5).any() and (idx_ref[6:lens[0]] >= 0).sum(-1).lt(torch.arange(7, lens[0] + 1)).all()
    assert torch.equal(idx.cpu(), idx_ref)
    assert torch.equal(sc.cpu().to(F64), sc_ref)


def test_indexer_kl_loss_trains_the_indexer_through_the_kernels():
    """KL(p || softmax(I_selected)) with p from sparse_attention and I from the indexer kernel:
    the same loss and gradients as the pure reference pipeline."""
    torch.manual_seed(0)
    T, Hi, Di, H, D, topk = 12, 2, 8, 4, 16, 6
    lens = [5, 7]
    q_i, k_i, w = torch.randn(T, Hi, Di, dtype=F64), torch.randn(T, Di, dtype=F64), torch.randn(T, Hi, dtype=F64)
    q, kv = torch.randn(T, H, D, dtype=F64), torch.randn(T, 1, D, dtype=F64)
    losses, grads = [], []
    for li, attn in ((K.lightning_indexer, K.sparse_attention), (R.lightning_indexer, R.sparse_attention)):
        ins = [t.clone().requires_grad_() for t in (q_i, k_i, w)]
        idx, scores = li(*ins, cu_of(lens), cu_of(lens), topk)
        _, _, p = attn(q, kv, idx[:, None], 0.25, D, None, return_p=True)
        loss = indexer_kl_loss(p[:, 0], scores, idx)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, ins))
    assert_close(losses[0], losses[1], F64, "loss")
    for a, b in zip(*grads):
        assert_close(a, b, F64, "grad")


def test_dsa_opcheck():
    torch.manual_seed(0)
    q, k, w = torch.randn(9, 2, 8, dtype=F64), torch.randn(9, 8, dtype=F64), torch.randn(9, 2, dtype=F64)
    cu = cu_of([4, 5])
    ops = torch.ops.kda_dsa_ops
    # opcheck's AOT-autograd utility sums all outputs into the first one's dtype, which fails for an
    # integer first output (the indices); the indexer's gradients are checked against the reference
    # in test_lightning_indexer_bwd_matches_reference.
    opcheck(ops.lightning_indexer_fwd.default, (q.requires_grad_(), k.requires_grad_(), w.requires_grad_(), cu, cu, 3),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    qa, kv, idx, gate = attn_case(5, 7, 4, 2, 8, 6, 3, F64, True)
    opcheck(ops.sparse_attn_fwd.default, (qa.requires_grad_(), kv.requires_grad_(), idx, 0.4, 6,
                                          gate.requires_grad_(), True))
    opcheck(ops.sparse_attn_fwd.default, (qa, kv, idx, 0.4, 6, None, False))
    opcheck(ops.sparse_attn_fwd.default, (strided(qa), strided(kv), idx, 0.4, 6, strided(gate), True))
    o, lse, _ = K.sparse_attention(qa, kv, idx, 0.4, 6, gate)
    opcheck(ops.sparse_attn_bwd.default, (strided(torch.randn_like(o)), strided(qa), strided(kv), idx, strided(o),
                                          lse, 0.4, 6, strided(gate), False), test_utils=BACKWARD_UTILS)
    opcheck(ops.lightning_indexer_fwd.default, (strided(q), strided(k), strided(w), cu, cu, 3),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    opcheck(ops.lightning_indexer_bwd.default, (strided(q), strided(k), strided(w),
                                                 K.lightning_indexer(q, k, w, cu, cu, 3)[0], torch.randn(9, 3, dtype=F64)),
            test_utils=BACKWARD_UTILS)


def test_dsa_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    q_i, k_i, w = torch.randn(10, 2, 8), torch.randn(10, 8), torch.randn(10, 2)
    q, kv = torch.randn(10, 4, 16, requires_grad=True), torch.randn(10, 1, 16, requires_grad=True)
    cu = cu_of([10])

    def block(q, kv):
        idx, _ = K.lightning_indexer(q_i, k_i, w, cu, cu, 4)
        o, _, _ = K.sparse_attention(q, kv, idx[:, None], 0.25)
        return o

    eager = block(q, kv)
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(q, kv)
    assert torch.equal(out, eager)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, kv)), torch.autograd.grad(eager.sum(), (q, kv))):
        assert torch.equal(a, b)


def test_dsa_bad_inputs_raise():
    q, kv, idx, gate = attn_case(4, 6, 4, 2, 8, 8, 3, torch.float32, True)
    f = K.sparse_attention
    with pytest.raises(RuntimeError, match=r"indices values must lie in \[-1, 6\)"):
        f(q, kv, torch.full_like(idx, 6), 0.5, 8)
    with pytest.raises(RuntimeError, match=r"dv must be in \[1, Dqk = 0\]"):
        f(q[..., :0], kv[..., :0], idx)  # Dqk = 0: no default scale to compute
    with pytest.raises(RuntimeError, match=r"indices values must lie in \[-1, 6\)"):
        f(q, kv, torch.full_like(idx, -2), 0.5, 8)
    with pytest.raises(RuntimeError, match="indices must have dtype"):
        f(q, kv, idx.long(), 0.5, 8)
    with pytest.raises(RuntimeError, match="multiple of the kv heads"):
        f(q[:, :3], kv, idx, 0.5, 8)
    with pytest.raises(RuntimeError, match="dv must be in"):
        f(q, kv, idx, 0.5, 9)
    with pytest.raises(RuntimeError, match="gate must be"):
        f(q, kv, idx, 0.5, 8, gate[:, :, :4])
    f(q, kv, torch.zeros(4, 2, 4096, dtype=torch.int32), 0.5, 8)  # attention takes more keys than the indexer
    with pytest.raises(RuntimeError, match=r"topk must be in \[1, 4096\]"):
        f(q, kv, torch.zeros(4, 2, 4097, dtype=torch.int32), 0.5, 8)
    with pytest.raises(RuntimeError, match=r"topk must be in \[1, 4096\]"):
        f(q, kv, idx[:, :, :0], 0.5, 8)
    qi, ki, w = torch.randn(6, 2, 8), torch.randn(6, 8), torch.randn(6, 2)
    cu = cu_of([6])
    li = K.lightning_indexer
    with pytest.raises(RuntimeError, match=r"topk must be in \[1, 2048\]"):
        li(qi, ki, w, cu, cu, 0)
    with pytest.raises(RuntimeError, match=r"topk must be in \[1, 2048\]"):
        li(qi, ki, w, cu, cu, 2049)
    with pytest.raises(RuntimeError, match="w must be"):
        li(qi, ki, w[:, :1], cu, cu, 2)
    with pytest.raises(RuntimeError, match="same number of sequences"):
        li(qi, ki, w, cu, cu_of([3, 3]), 2)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must end at Tk = 6"):
        li(qi, ki, w, cu, cu_of([5]), 2)


# ---- CUDA kernels (bf16/fp16 operands) against the float64 reference on the same rounded inputs ----

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.cuda
@given(seed=SEEDS, lens=seqlens(max_seqs=3, max_len=300), extra_keys=st.lists(st.integers(0, 40), min_size=3,
       max_size=3), topk=st.sampled_from([1, 7, 64, 200, 2048]), Hi=st.sampled_from([1, 5, 64]),
       Di=st.sampled_from([8, 40, 128]), dtype=st.sampled_from(HALF))
def test_lightning_indexer_cuda_matches_reference(seed, lens, extra_keys, topk, Hi, Di, dtype):
    """Integer inputs make every score exact, so indices (ties included) and scores must match
    exactly; varlen blocks of four queries that straddle sequences, Di of one or two 64-wide halves."""
    torch.manual_seed(seed)
    klens = [n + e for n, e in zip(lens, extra_keys)]
    T, Tk = sum(lens), sum(klens)
    q, k, w = small_ints(T, Hi, Di, dtype=dtype), small_ints(Tk, Di, dtype=dtype), small_ints(T, Hi, dtype=dtype)
    poison("cuda")
    idx, sc = K.lightning_indexer(q.cuda(), k.cuda(), w.cuda(), cu_of(lens).cuda(), cu_of(klens).cuda(), topk)
    idx_ref, sc_ref = R.lightning_indexer(q.to(F64), k.to(F64), w.to(F64), cu_of(lens), cu_of(klens), topk)
    assert idx.dtype == torch.int32 and sc.dtype == torch.float32
    assert torch.equal(idx.cpu(), idx_ref)
    assert torch.equal(sc.cpu().to(F64), sc_ref)


@pytest.mark.cuda
@settings(max_examples=12)
@given(seed=SEEDS, lens=st.lists(st.integers(1500, 4000), min_size=1, max_size=2),
       topk=st.sampled_from([1, 7, 200, 1500, 2048]), Hi=st.sampled_from([1, 3]), Di=st.sampled_from([8, 72]),
       spread=st.sampled_from([3, 100]), dtype=st.sampled_from(HALF))
def test_lightning_indexer_cuda_long_sequences(seed, lens, topk, Hi, Di, spread, dtype):
    """Sequences far longer than topk: each query's candidate buffer (topk + 1024 entries) fills and
    is cut back to its top-k again and again. q and k are integers in [-spread, spread] (exact in
    bf16 and fp16, every score exact in fp32): spread 3 gives many tied scores (the cut then ranks
    by key), spread 100 few."""
    torch.manual_seed(seed)
    T = sum(lens)
    ints = lambda *shape: torch.randint(-spread, spread + 1, shape).to(dtype)
    q, k, w = ints(T, Hi, Di), ints(T, Di), small_ints(T, Hi, dtype=dtype)
    cu = cu_of(lens)
    idx, sc = K.lightning_indexer(q.cuda(), k.cuda(), w.cuda(), cu.cuda(), cu.cuda(), topk)
    idx_ref, sc_ref = R.lightning_indexer(q.to(F64), k.to(F64), w.to(F64), cu, cu, topk)
    assert torch.equal(idx.cpu(), idx_ref)
    assert torch.equal(sc.cpu().to(F64), sc_ref)


@pytest.mark.cuda
@given(seed=SEEDS, lens=seqlens(max_seqs=3, max_len=120), topk=st.sampled_from([1, 30, 64, 100]),
       Hi=st.sampled_from([3, 64]), Di=st.sampled_from([16, 128]), dtype=st.sampled_from(HALF))
def test_lightning_indexer_bwd_cuda_matches_reference(seed, lens, topk, Hi, Di, dtype):
    torch.manual_seed(seed)
    T = sum(lens)
    q, k, w = torch.randn(T, Hi, Di).to(dtype), torch.randn(T, Di).to(dtype), torch.randn(T, Hi).to(dtype)
    ins = [t.cuda().requires_grad_() for t in (q, k, w)]
    poison("cuda")
    idx, sc = K.lightning_indexer(*ins, cu_of(lens).cuda(), cu_of(lens).cuda(), topk)
    g = off_the_kink(q, k, idx, torch.randn(sc.shape, dtype=sc.dtype, device="cuda").masked_fill(idx < 0, 0))
    grads = torch.autograd.grad(sc.masked_fill(idx < 0, 0), ins, g)
    ref = R.lightning_indexer_bwd(q.to(F64), k.to(F64), w.to(F64), idx.cpu(), g.cpu().to(F64))
    # dk sums terms of both signs over many queries: measured against the size of those terms.
    dk_terms = (g.abs().cpu().to(F64)[:, None, :, None] * w.abs().to(F64)[:, :, None, None]
                * q.abs().to(F64)[:, :, None, :]).sum((0, 1, 2)).norm()
    for name, a, b in zip(["dq", "dk", "dw"], grads, ref):
        assert a.dtype == dtype
        assert_close(a, b, dtype, name, scale=dk_terms if name == "dk" else None)


MLA = (1, 576, 512)
NOPE = (1, 512, 512)  # GLM-5.3's MLA without rope dims


def check_cuda_attention(seed, T, Tk, layout, G, topk, gated, return_p, portable, dtype, repeats=True, crowded=0):
    """The CUDA op's o, lse, p and gradients against the float64 reference on the same inputs; the
    first `crowded` queries choose topk / 4 distinct keys among the first topk / 2, at random slots,
    -1 in the others (so that their blocks' unions keep at most an eighth of their slots)."""
    torch.manual_seed(seed)
    Hkv, D, dv = layout
    q, kv, idx, gate = attn_case(T, Tk, Hkv * G, Hkv, D, dv, topk, dtype, gated, repeats=repeats)
    keys = torch.rand(crowded, Hkv, topk // 2).argsort(-1)[..., :topk // 4].int()
    slots = torch.rand(crowded, Hkv, topk).argsort(-1)[..., :topk // 4]
    idx[:crowded] = torch.full((crowded, Hkv, topk), -1, dtype=idx.dtype).scatter_(-1, slots, keys)
    ins = [t.cuda().requires_grad_() for t in (q, kv) + ((gate,) if gated else ())]
    poison("cuda")
    with portable_sfa(portable):
        o, lse, p = K.sparse_attention(ins[0], ins[1], idx.cuda(), 0.1, dv, ins[2] if gated else None,
                                       return_p=return_p)
    ref_ins = [t.to(F64).requires_grad_() for t in (q, kv) + ((gate,) if gated else ())]
    o_ref, lse_ref, p_ref = R.sparse_attention(ref_ins[0], ref_ins[1], idx, 0.1, dv, ref_ins[2] if gated else None,
                                              return_p=True)
    assert o.dtype == dtype and lse.dtype == torch.float32 and (p is None) != return_p
    assert_close(o, o_ref, dtype, "o")
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(lse_ref))
    lse_terms = 0.1 * ref_ins[0].detach().norm(dim=-1) * ref_ins[1].detach().norm(dim=-1).max()
    assert_close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), dtype, "lse", scale=lse_terms)
    if return_p:
        assert p.dtype == torch.float32
        assert_close(p, p_ref, dtype, "p")
    do = torch.randn(o.shape).to(dtype)
    grads = torch.autograd.grad(o, ins, do.cuda())
    ref_grads = torch.autograd.grad(o_ref, ref_ins, do.to(F64))
    scales = attn_grad_scales(ref_ins[0].detach(), ref_ins[1].detach(), do.to(F64), 0.1)
    for name, a, b in zip(["dq", "dkv", "dgate"], grads, ref_grads):
        assert a.dtype == dtype
        assert_close(a, b, dtype, name, scale=scales.get(name))


@pytest.mark.cuda
@given(seed=SEEDS, T=st.integers(1, 20), Tk=st.integers(1, 300),
       layout=st.sampled_from([MLA, NOPE, (2, 128, 128), (4, 64, 48), (1, 32, 32)]),
       G=st.sampled_from([1, 5, 8, 16, 32, 64, 128]), topk=st.sampled_from([1, 37, 64, 2048, 2063, 4096]),
       gated=st.booleans(), return_p=st.booleans(), portable=st.booleans(), dtype=st.sampled_from(HALF))
def test_sparse_attention_cuda_matches_reference(seed, T, Tk, layout, G, topk, gated, return_p, portable,
                                                 dtype):
    """On sm_90 the MLA layouts (576 / 512, NoPE 512 / 512) take the Hopper forward kernel (p from
    its second pass) unless set_portable_sfa(True) keeps it on the portable one, which other GPUs
    take; 2063 keys: GLM-5.3's pooled selection with its tail, past the indexer's 2048."""
    check_cuda_attention(seed, T, Tk, layout, G, topk, gated, return_p, portable, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [MLA, NOPE, (2, 128, 128), (4, 64, 48)])
@pytest.mark.parametrize("G", [8, 16, 32])
@pytest.mark.parametrize("T, Tk, topk", [(13, 30, 64), (9, 2000, 100), (17, 5000, 2063)])
@pytest.mark.parametrize("repeats", [True, False])
def test_sparse_attention_cuda_packed_queries_match_reference(layout, G, T, Tk, topk, repeats):
    """With 8, 16 or 32 heads a kv head the kernels take 64 / G queries a block on each kv head (the
    Hopper MLA ones with p, the mma.sync ones without): the union of their selections, each row
    masked to its own query's keys, as many copies of a key as its query has. Keys shared by most of
    a block's queries (Tk 30), by few (Tk 2000, 5000); T not a multiple of the block (a short last
    block); a query without keys; gated. Keys repeated within a query (the blocks' entries sorted),
    or distinct but in one query (the other blocks counted)."""
    mla = layout[0] == 1
    check_cuda_attention(T + G, T, Tk, layout, G, topk, True, mla, False, torch.bfloat16, repeats)


@pytest.mark.cuda
@pytest.mark.parametrize("G", [8, 16])
def test_sparse_attention_cuda_splits_packed_and_unpacked_blocks(G):
    """On the mma.sync kernels at 8 and 16 heads a kv head a packed block whose union keeps more than
    a share of its slots (backward: 8 heads 50%, 16 heads 40%; forward: 60%, 20%) runs unpacked, in
    a second launch: in one call, the first 20 queries choose few keys (their blocks packed), the
    others 64 among 3000 (their blocks unpacked); the profile holds both launches, forward and
    backward (the packed ones at 8 heads on the GQA packed kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        check_cuda_attention(0, 41, 3000, (2, 128, 128), G, 64, True, False, False, torch.bfloat16, False,
                             crowded=20)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    packed, unpacked = r", (true|1)>", r", (false|0)>"  # the kernels' last template argument, as named
    packed_fwd = "gqa_packed_fwd_kernel" if G == 8 else r"attn_fwd_kernel<[^>]*" + packed
    packed_bwd = "gqa_packed_bwd_kernel" if G == 8 else r"attn_bwd_kernel<[^>]*" + packed
    for kernel in [packed_fwd, "gqa_fwd_kernel", packed_bwd, r"attn_bwd_kernel<[^>]*" + unpacked]:
        assert any(re.search(kernel, n) for n in names), (kernel, names)


@pytest.mark.cuda
@pytest.mark.parametrize("G", [8, 16])
@pytest.mark.parametrize("return_p", [False, True])
def test_sparse_attention_cuda_gqa_forward_kernels(G, return_p):
    """At 8 and 16 heads a kv head with Dqk <= 128 the forward runs on gqa_fwd_cuda.cu's kernels: at 8
    heads without p a packed block whose queries share keys (the first 8 queries choose among 200
    keys) on gqa_packed_fwd_kernel, the others (a short block of 4 queries that share few keys, Tk
    3000) and every query with p on gqa_fwd_kernel; both give the reference's o, lse and p: a slot
    without a key, keys repeated within a query, a head dim below 128, gated."""
    torch.manual_seed(0)
    q, kv, idx, _ = attn_case(12, 3000, 2 * G, 2, 64, 48, 100, torch.bfloat16, False, repeats=True)
    idx[:8] = torch.rand(8, 2, 200).argsort(-1)[..., :100].int()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        K.sparse_attention(q.cuda(), kv.cuda(), idx.cuda(), 0.1, 48, return_p=return_p)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("gqa_fwd_kernel" in n for n in names), names
    assert any("gqa_packed_fwd_kernel" in n for n in names) == (G == 8 and not return_p), names
    check_cuda_attention(G, 12, 3000, (2, 64, 48), G, 100, True, return_p, False, torch.bfloat16, crowded=8)


@pytest.mark.cuda
@pytest.mark.parametrize("layout, G, return_p, portable, packed",
                         [((2, 128, 128), 8, False, False, True), ((2, 128, 128), 32, False, False, True),
                          ((2, 128, 128), 64, False, False, False), ((2, 128, 128), 16, True, False, False),
                          (MLA, 16, True, False, True), (MLA, 16, False, True, True),
                          (MLA, 16, True, True, False)])
def test_sparse_attention_cuda_packs_where_it_should(layout, G, return_p, portable, packed):
    """The pack runs (its kernels appear in the profile) with 8, 16 or 32 heads a kv head, except on
    the mma.sync kernels when the probabilities are asked for."""
    Hkv, D, dv = layout
    q, kv, idx, _ = attn_case(6, 50, Hkv * G, Hkv, D, dv, 16, torch.bfloat16, False, repeats=False)
    with portable_sfa(portable), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        K.sparse_attention(q.cuda(), kv.cuda(), idx.cuda(), 0.1, dv, return_p=return_p)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("count_kernel" in n for n in names) == packed, names


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [MLA, NOPE])
@pytest.mark.parametrize("G", [8, 64, 128])
@pytest.mark.parametrize("return_p", [False, True])
def test_sparse_attention_cuda_blocks_take_several_items(layout, G, return_p):
    """The Hopper MLA forward runs a block an SM, each taking every gridDim-th item (query and head
    block, or packed block) in turn, twice with p: 300 items, more than twice the SMs; three tiles
    a query (an odd last pair), a query without keys, packed blocks of different union lengths."""
    check_cuda_attention(G, 300 * 64 // G, 500, layout, G, 150, True, return_p, False, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("layout, G, T, topk", [(MLA, 64, 64, 256), (NOPE, 64, 64, 256), ((2, 128, 128), 64, 64, 256),
                                                (MLA, 128, 64, 256), (MLA, 8, 64, 256), (MLA, 64, 300, 4096),
                                                (MLA, 8, 300, 4096), ((2, 128, 128), 8, 64, 256),
                                                ((2, 128, 128), 16, 300, 4096)])
def test_sparse_attention_cuda_deterministic_dkv(layout, G, T, topk):
    """deterministic=True: dkv bitwise equal over repeated runs, and equal to the atomic path
    within rounding. Keys are chosen by many queries (Tk small) so the order of the sums matters,
    and repeated within a query. The Hopper MLA blocks of 64 heads add in turn order (two head
    blocks a query at 128); with 8 heads (MLA) the queries are packed 8 to a block and store their
    contributions for the ordered sum, 300 queries of 4096 keys in several chunks; so do GQA's
    packed blocks (8 and 16 heads a kv head) on the mma.sync kernels."""
    Hkv, D, dv = layout
    q, kv, idx, gate = attn_case(T, 40, Hkv * G, Hkv, D, dv, topk, torch.bfloat16, True)
    q, kv, idx, gate = q.cuda().requires_grad_(), kv.cuda().requires_grad_(), idx.cuda(), gate.cuda()
    do = torch.randn(T, Hkv * G, dv, device="cuda").to(torch.bfloat16)

    def dkv(deterministic):
        o, _, _ = K.sparse_attention(q, kv, idx, 0.1, dv, gate, deterministic=deterministic)
        return torch.autograd.grad(o, kv, do)[0]

    first = dkv(True)
    assert all(torch.equal(first, dkv(True)) for _ in range(3))
    assert_close(dkv(False), first, torch.bfloat16, "dkv (atomic vs deterministic)")


@pytest.mark.cuda
def test_dsa_cuda_bad_inputs_raise():
    q, kv, idx, _ = attn_case(4, 6, 4, 2, 8, 8, 3, torch.float32, False)
    q, kv, idx = q.cuda(), kv.cuda(), idx.cuda()
    with pytest.raises(RuntimeError, match="CUDA kernel takes bfloat16 or float16"):
        K.sparse_attention(q, kv, idx, 0.5, 8)
    with pytest.raises(RuntimeError, match="Dqk a multiple of 8"):
        K.sparse_attention(torch.randn(4, 4, 36, device="cuda").half(), torch.randn(6, 2, 36, device="cuda").half(),
                           idx, 0.5, 36)
    with pytest.raises(RuntimeError, match="up to 576 with dv <= 512"):
        K.sparse_attention(torch.randn(4, 4, 584, device="cuda").half(), torch.randn(6, 2, 584, device="cuda").half(),
                           idx, 0.5, 512)
    qi, ki, w = torch.randn(6, 65, 8, device="cuda").half(), torch.randn(6, 8, device="cuda").half(), torch.randn(6, 65, device="cuda")
    cu = cu_of([6]).cuda()
    with pytest.raises(RuntimeError, match="up to 64 indexer heads"):
        K.lightning_indexer(qi, ki, w, cu, cu, 2)
    with pytest.raises(RuntimeError, match="Di a multiple of 8"):
        K.lightning_indexer(qi[:, :4, :6].contiguous(), ki[:, :6].contiguous(), w[:, :4], cu, cu, 2)


@pytest.mark.cuda
def test_dsa_cuda_out_of_range_values_are_checked_or_ignored(value_checks):
    """With value checks on, an out-of-range index raises; off, the kernels treat it as -1 and
    read nothing outside kv."""
    q, kv, idx, _ = attn_case(4, 6, 4, 1, 32, 32, 3, torch.bfloat16, False, empty_rows=False)
    q, kv, bad = q.cuda(), kv.cuda(), idx.cuda().clone()
    bad[0, 0, 0] = 6
    with pytest.raises(RuntimeError, match=r"indices values must lie in \[-1, 6\)"):
        K.sparse_attention(q, kv, bad, 0.5, 32)
    K.set_value_checks(False)
    minus = bad.clone()
    minus[0, 0, 0] = -1
    o_bad, _, _ = K.sparse_attention(q, kv, bad, 0.5, 32)
    o_ref, _, _ = K.sparse_attention(q, kv, minus, 0.5, 32)
    assert torch.equal(o_bad, o_ref)


@pytest.mark.cuda
def test_dsa_cuda_takes_views_at_any_offset():
    """A contiguous view that starts off a 16-byte boundary gives the results of an aligned copy."""
    T, Tk, H, D = 5, 9, 16, 64
    flat = torch.randn(T * H * D + Tk * D + 1, device="cuda").to(torch.bfloat16)
    q = flat[1:1 + T * H * D].view(T, H, D)
    kv = flat[1 + T * H * D:].view(Tk, 1, D)
    idx = torch.randint(-1, Tk, (T, 1, 7), device="cuda", dtype=torch.int32)
    o, lse, _ = K.sparse_attention(q, kv, idx, 0.1, D)
    o_ref, lse_ref, _ = K.sparse_attention(q.clone(), kv.clone(), idx, 0.1, D)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    cu = cu_of([T]).cuda()
    i, s = K.lightning_indexer(q[:, :4], kv[:T, 0], q[:, :4, 0], cu, cu, 3)
    i_ref, s_ref = K.lightning_indexer(q[:, :4].contiguous(), kv[:T, 0].clone(), q[:, :4, 0].clone(), cu, cu, 3)
    assert torch.equal(i, i_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("T, Tk", [(0, 5), (4, 0), (0, 0)])
def test_reference_attention_takes_empty_batches(T, Tk):
    """No queries or no keys (legal: the ops handle them): the reference gives the op's output, lse
    and gradients (all zero without keys)."""
    q = torch.randn(T, 2, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(Tk, 1, 8, dtype=torch.float64, requires_grad=True)
    idx = torch.full((T, 1, 3), -1, dtype=torch.int32)
    o, lse, _ = R.sparse_attention(q, kv, idx, 0.3, 8, None, True)
    o_op, lse_op, _ = K.sparse_attention(q, kv, idx, 0.3, 8, None, True)
    assert torch.equal(o, o_op) and torch.equal(lse, lse_op)
    do = torch.randn_like(o)
    dq, dkv, _ = R.sparse_attn_bwd(do, q, kv, idx, lse, 0.3, 8, None)
    dq_op, dkv_op = torch.autograd.grad(o_op, (q, kv), do, allow_unused=True)
    assert torch.equal(dq, dq_op if dq_op is not None else torch.zeros_like(q))
    assert torch.equal(dkv, dkv_op if dkv_op is not None else torch.zeros_like(kv))
