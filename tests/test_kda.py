"""KDA (chunk_kda) against the float64 naive recurrence, on CPU and CUDA: outputs, final states
and every gradient (q, k, v, g, beta, initial state), varlen, grouped value heads, strong decay,
opcheck, torch.compile(fullgraph=True), no host synchronisation, and bad inputs."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda_dsa_ops as K
from kda_dsa_ops import reference as R

from conftest import DEVICES
from helpers import BACKWARD_UTILS, opcheck, poison, strided
from strategies import SEEDS, seqlens
from tolerances import CUDA_KDA_REL_RMS, REL_RMS, assert_close

F64 = torch.float64


def device_dtypes(device):
    return [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float64, torch.float32,
                                                                                      torch.bfloat16]


def make_inputs(B, T, H, HV, Kd, V, dtype, g_dtype, device, decay="normal", l2=True):
    """Inputs in the ranges a model produces: without in-kernel normalisation q, k are scaled to
    unit norm on average (the delta rule needs |beta k^2| <~ 2 to be stable)."""
    qk_scale = 1.0 if l2 else Kd ** -0.5
    q = (torch.randn(B, T, H, Kd) * qk_scale).to(dtype)
    k = (torch.randn(B, T, H, Kd) * qk_scale).to(dtype)
    v = torch.randn(B, T, HV, V).to(dtype)
    if decay == "strong":  # down to -20 per step, whole chunks summing to about -1e4 on some channels
        g = -20 * torch.rand(B, T, HV, Kd)
        g[..., 0] = -160.0
    elif decay == "bounded":  # uniform in (-1.8, 0]: a whole chunk's range on its strongest channel near 96 log2
        g = -1.8 * torch.rand(B, T, HV, Kd)  # (the bf16 intra kernel's one-factorisation bound), either side
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, Kd) + 2.0)
    if decay == "edge":  # channel 0's range over whole chunks 95.5 and 96.5 log2 in turn: either side of that bound
        chunk = torch.arange(T) // 64
        g[:, :, :, 0] = torch.where(chunk % 2 == 0, -95.5, -96.5)[None, :, None] / (63 * math.log2(math.e))
    if decay == "reset":  # g = -inf (decay 0: the state forgotten) at whole steps and on single channels
        g[:, 3::37] = -torch.inf
        g[:, 5::11, :, 0] = -torch.inf
    beta = torch.rand(B, T, HV)
    return [t.to(device) for t in (q, k, v, g.to(g_dtype), beta.to(g_dtype if g_dtype != F64 else dtype))]


def check_against_reference(device, dtype, g_dtype, B, T, H, group, Kd, V, lens, l2, with_h0, decay,
                            precision="highest"):
    """precision: chunk_kda's matmul_precision; "medium" (bf16 operands on CUDA) holds every
    output to the bf16 row (tolerances.py)."""
    HV = H * group
    q, k, v, g, beta = make_inputs(B, T, H, HV, Kd, V, dtype, g_dtype, device, decay, l2)
    cu = None if lens is None else torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    N = B if cu is None else len(lens)
    state_dtype = F64 if dtype == F64 else torch.float32
    h0 = torch.randn(N, HV, Kd, V, dtype=state_dtype, device=device) if with_h0 else None
    ins = [t.detach().requires_grad_() for t in (q, k, v, g, beta)] + ([h0.requires_grad_()] if with_h0 else [])
    poison(device)
    o, ht = K.chunk_kda(*ins[:5], initial_state=ins[5] if with_h0 else None, output_final_state=True,
                       use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, matmul_precision=precision)
    assert o.dtype == dtype and ht.dtype == state_dtype and ht.shape == (N, HV, Kd, V)
    ref_ins = [t.detach().cpu().to(F64).requires_grad_() for t in ins]
    ro, rht = R.chunk_kda(*ref_ins[:5], initial_state=ref_ins[5] if with_h0 else None, output_final_state=True,
                            use_qk_l2norm_in_kernel=l2, cu_seqlens=None if cu is None else cu.cpu())
    table = CUDA_KDA_REL_RMS if device == "cuda" else REL_RMS
    bf16_row = device == "cuda" and precision == "medium"
    assert_close(o, ro, torch.bfloat16 if bf16_row else dtype, "o", scale=o_scale(ref_ins, l2, lens, with_h0),
                 table=table)
    assert_close(ht, rht, torch.bfloat16 if bf16_row else state_dtype, "final_state", table=table)
    do = torch.randn(o.shape, dtype=F64)
    dht = torch.randn(ht.shape, dtype=F64)
    grads = torch.autograd.grad((o * do.to(device, dtype)).sum() + (ht * dht.to(device, state_dtype)).sum(), ins)
    ref_grads = torch.autograd.grad((ro * do.to(dtype).to(F64)).sum() + (rht * dht.to(state_dtype).to(F64)).sum(),
                                    ref_ins)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
    scales = {"dg": dg_scale(ref_ins, ref_grads), "dbeta": dbeta_scale(ref_ins, ref_grads),
              "dq": dq_scale(ref_ins, do, l2, lens, with_h0)}
    for name, a, b, x in zip(names, grads, ref_grads, ins):
        assert a.dtype == x.dtype
        assert_close(a, b, torch.bfloat16 if bf16_row else x.dtype, name, scale=scales.get(name), table=table)


def dbeta_scale(ins, grads):
    """The size of the terms of dbeta_t = (dS_t^T k_t) . (v_t - S'^T k_t) = (dv_t / beta_t) . r_t, a
    dot product over V that can cancel: |dv_t| |v_t| / beta_t per (t, head)."""
    v, beta, dv = ins[2], ins[4], grads[2]
    return dv.norm(dim=-1) * v.norm(dim=-1) / beta.clamp_min(1e-3)


def first_tokens(terms, lens):
    """terms [B, T, HV] kept at the first token of each sequence, zero elsewhere."""
    starts = torch.zeros(terms.shape[:2], dtype=torch.bool)
    if lens is None:
        starts[:, 0] = True
    else:
        first = torch.tensor([0] + lens[:-1]).cumsum(0)
        starts[0, first[torch.tensor(lens) > 0]] = True
    return terms * starts[:, :, None]


def o_scale(ins, l2, lens, with_h0):
    """The first token of a sequence without an initial state has o_t = K^-0.5 beta_t (q_t . k_t)
    v_t: one dot product over K, which can cancel. Its terms' size, K^-0.5 beta_t sum_c |q_tc k_tc|
    |v_t|, at those tokens; other tokens sum many such products and need no scale."""
    if with_h0:
        return None
    q, k, v, beta = ins[0], ins[1], ins[2], ins[4]
    if l2:  # the rows the kernel's products see
        q, k = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6), k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return first_tokens((q * k).abs().sum(dim=-1) * v.norm(dim=-1) * beta * q.shape[-1] ** -0.5, lens)


def dq_scale(ins, do, l2, lens, with_h0):
    """The first token of a sequence without an initial state has dq_t = K^-0.5 beta_t
    (dO_t . v_t) k_t alone: one dot product over V, which can cancel. Its terms' size,
    K^-0.5 beta_t sum_j |dO_tj v_tj| |k_t| (|k_t| = 1 and over |q_t| when q and k are normalised
    in the kernel), at those tokens; other tokens sum many such products and need no scale."""
    if with_h0:
        return None
    q, k, v, beta = ins[0], ins[1], ins[2], ins[4]
    group = v.shape[2] // q.shape[2]
    size = 1.0 / q.norm(dim=-1).clamp_min(1e-6) if l2 else k.norm(dim=-1)  # |k_t| = 1 once normalised
    size = size.repeat_interleave(group, dim=2)
    return first_tokens((do * v).abs().sum(dim=-1) * beta * size * q.shape[-1] ** -0.5, lens)


def dg_scale(ins, grads):
    """The size of the terms that make up dg: it is a sum of terms of the size of q * dq and
    k * dk that cancel where decay is strong (the true dg is then tiny, ~exp(g))."""
    return torch.cat([(ins[0] * grads[0]).flatten(), (ins[1] * grads[1]).flatten()])


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, T=st.integers(1, 150), B=st.integers(1, 2), H=st.integers(1, 2), group=st.sampled_from([1, 2]),
       dims=st.sampled_from([(4, 3), (16, 16), (64, 64), (128, 128), (128, 64), (40, 72)]), l2=st.booleans(),
       with_h0=st.booleans(), decay=st.sampled_from(["normal", "strong", "reset"]), data=st.data())
def test_kda_matches_reference(seed, device, T, B, H, group, dims, l2, with_h0, decay, data):
    torch.manual_seed(seed)
    dtype = data.draw(st.sampled_from(device_dtypes(device)), label="dtype")
    g_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="g_dtype")
    if dims[0] * T > 64 * 64 and device == "cpu":
        T = 64 * 64 // dims[0]  # keep the float64 reference loop short on CPU
    check_against_reference(device, dtype, g_dtype, B, T, H, group, *dims, None, l2, with_h0, decay)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, lens=seqlens(max_seqs=5, max_len=140, min_len=0), group=st.sampled_from([1, 4]),
       with_h0=st.booleans(), data=st.data())
def test_kda_varlen_matches_reference(seed, device, lens, group, with_h0, data):
    """Packed sequences of any length (0, 1, 64, 65 ...) restart the state at their bounds (on CUDA
    also with the head sizes of the bf16 state kernels)."""
    torch.manual_seed(seed)
    if sum(lens) == 0:
        lens = lens + [1]  # at least one token, so that o depends on the inputs
    dtype = data.draw(st.sampled_from(device_dtypes(device)), label="dtype")
    dims = data.draw(st.sampled_from([(32, 16)] + ([(64, 64), (128, 128)] if device == "cuda" else [])), label="dims")
    check_against_reference(device, dtype, torch.float32, 1, sum(lens), 1, group, *dims, lens, True, with_h0,
                            "normal")


@pytest.mark.cuda
@given(seed=SEEDS, T=st.integers(1, 300), B=st.integers(1, 2), H=st.integers(1, 2), group=st.sampled_from([1, 2]),
       dims=st.sampled_from([(16, 16), (32, 16), (64, 64), (128, 128), (128, 64), (64, 128), (40, 72)]),
       lens=st.none() | seqlens(max_seqs=4, max_len=140, min_len=0), l2=st.booleans(), with_h0=st.booleans(),
       decay=st.sampled_from(["normal", "strong", "reset", "bounded", "edge"]), data=st.data())
def test_kda_bf16_products_match_reference(seed, T, B, H, group, dims, lens, l2, with_h0, decay, data):
    """matmul_precision="medium": the bf16-operand kernels (the state kernels at K 64/128 with V a
    multiple of 64, the generic ones otherwise), every output within the bf16 row, any input
    dtype, varlen included; chunks on both sides of the intra kernel's one-factorisation bound
    (decays "bounded", "edge"). Head sizes from 16 up: with fewer terms per product (K = 4) one operand's
    rounding is not averaged out and the row does not apply."""
    torch.manual_seed(seed)
    dtype = data.draw(st.sampled_from(device_dtypes("cuda")), label="dtype")
    g_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="g_dtype")
    if lens is not None:
        B, T, lens = 1, max(sum(lens), 1), (lens if sum(lens) else lens + [1])
    check_against_reference("cuda", dtype, g_dtype, B, T, H, group, *dims, lens, l2, with_h0, decay, "medium")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kda_default_precision_follows_the_input_dtype(dtype):
    """By default bf16 / fp16 inputs take bf16 products ("medium", fla's precision) whatever
    torch's fp32 matmul precision, and fp32 inputs follow torch's; "medium" changes the results,
    "highest" and "high" do not; an explicit matmul_precision overrides the default."""
    ins = make_inputs(1, 200, 2, 2, 64, 64, dtype, torch.float32, "cuda")
    run = {p: K.chunk_kda(*ins, use_qk_l2norm_in_kernel=True, matmul_precision=p)[0] for p in ("highest", "high",
                                                                                              "medium")}
    assert torch.equal(run["highest"], run["high"]) and not torch.equal(run["highest"], run["medium"])
    before = torch.get_float32_matmul_precision()
    try:
        for p in run:
            torch.set_float32_matmul_precision(p)
            expected = run[p] if dtype == torch.float32 else run["medium"]
            assert torch.equal(K.chunk_kda(*ins, use_qk_l2norm_in_kernel=True)[0], expected), p
    finally:
        torch.set_float32_matmul_precision(before)


WINDOW_CASES = [("cpu", F64, "highest", 16, 8),
                pytest.param("cuda", torch.float32, "highest", 32, 16, marks=pytest.mark.cuda),
                pytest.param("cuda", torch.bfloat16, "medium", 64, 64, marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device, dtype, precision, Kd, V", WINDOW_CASES)
@pytest.mark.parametrize("lens", [None, [70, 0, 200, 33, 97]])
@pytest.mark.parametrize("with_h0", [False, True])
def test_kda_long_calls_run_in_windows(device, dtype, precision, Kd, V, lens, with_h0, monkeypatch):
    """A call past the window size runs as windows along T (the workspaces of one window): the
    outputs, final states and every gradient are the reference's, with sequences that cross
    windows, begin inside one, are empty, and a batch of two."""
    from kda_dsa_ops.ops import kda as kda_ops

    B, T = (2, 300) if lens is None else (1, sum(lens))
    monkeypatch.setattr(kda_ops, "WINDOW_TOKEN_HEADS", 64 * B * 4)  # 64-token windows at HV = 4
    assert len(kda_ops._windows(B * 4, T)) == -(-T // 64)
    check_against_reference(device, dtype, torch.float32, B, T, 2, 2, Kd, V, lens, True, with_h0, "normal",
                            precision)


@pytest.mark.parametrize("device", DEVICES)
def test_kda_sequence_bounds_restart_the_state(device):
    """Two packed sequences give the outputs of two separate calls."""
    q, k, v, g, beta = make_inputs(1, 130, 2, 2, 32, 32, torch.float32, torch.float32, device)
    cu = torch.tensor([0, 67, 130], dtype=torch.int32, device=device)
    o, ht = K.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for n, (a, b) in enumerate([(0, 67), (67, 130)]):
        on, hn = K.chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, a:b], on, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht[n], hn[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cuts", [(37,), (64, 130), (1, 100, 129)])
def test_kda_segments_combine_to_the_unsplit_sequence(device, cuts):
    """A sequence split along T (2-4 segments, cuts inside and at chunk bounds): each segment's
    transition and zero-start final state, composed into the segments' start states, then
    chunk_kda per segment give the unsplit outputs, final state and every gradient (the kernel side
    of context parallelism). CPU in float64 against the unsplit op; CUDA in float32 against the
    float64 reference."""
    B, T, H, HV, Kd, V = 2, 160, 2, 4, 16, 8
    dtype = F64 if device == "cpu" else torch.float32
    q, k, v, g, beta = make_inputs(B, T, H, HV, Kd, V, dtype, dtype, device)
    h0 = torch.randn(B, HV, Kd, V, dtype=dtype, device=device)
    w_o, w_h = torch.randn(B, T, HV, V, dtype=dtype, device=device), torch.randn_like(h0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta, h0)]

    def unsplit(kda, ins):
        o, ht = kda(*ins[:5], initial_state=ins[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                    matmul_precision="highest")
        return o, ht

    bounds = [0, *cuts, T]
    parts = [[t[:, a:b] for t in leaves[:5]] for a, b in zip(bounds[:-1], bounds[1:])]
    transitions = [K.segment_transition(pk, pg, pb, use_qk_l2norm_in_kernel=True, matmul_precision="highest")
                   for _, pk, _, pg, pb in parts]
    finals = [K.chunk_kda(*part, output_final_state=True, use_qk_l2norm_in_kernel=True,
                          matmul_precision="highest")[1] for part in parts]
    starts = K.segment_start_states(transitions, finals, leaves[5])
    runs = [K.chunk_kda(*part, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                        matmul_precision="highest") for part, s0 in zip(parts, starts)]
    o, ht = torch.cat([r[0] for r in runs], dim=1), runs[-1][1]
    grads = torch.autograd.grad((o * w_o).sum() + (ht * w_h).sum(), leaves)

    if device == "cpu":
        judge, ref_leaves, table = K.chunk_kda, [t.detach().requires_grad_() for t in leaves], REL_RMS
    else:
        judge, ref_leaves, table = R.chunk_kda, [t.detach().cpu().to(F64).requires_grad_() for t in leaves], CUDA_KDA_REL_RMS
    o_ref, ht_ref = unsplit(judge, ref_leaves)
    ref_grads = torch.autograd.grad((o_ref * w_o.cpu().to(o_ref.dtype) if device != "cpu" else o_ref * w_o).sum()
                                    + (ht_ref * (w_h.cpu().to(F64) if device != "cpu" else w_h)).sum(), ref_leaves)
    assert_close(o, o_ref, dtype, "o", table=table)
    assert_close(ht, ht_ref, dtype, "final state", table=table)
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, ref_grads):
        assert_close(a, e, dtype, name, table=table)


# (B, T, H, HV, K, V, cu_seqlens lengths or None, input dtype, g / beta dtype): the exact family
# (float64 on CPU, float32 3xTF32 on CUDA) and the bf16 kernels' reach, where the gate and beta
# are computed in the kernels (K, V in {64, 128}, bf16 products; grouped and direct value heads,
# partial chunks, g and beta in float32 or the inputs' dtype).
GATE_SHAPES = {"exact": (1, 150, 2, 4, 16, 8, None, None, None),
               "bf16-grouped": (1, 150, 2, 4, 64, 64, [70, 0, 80], torch.bfloat16, torch.float32),
               "bf16-direct": (2, 100, 2, 2, 128, 64, None, torch.bfloat16, torch.bfloat16),
               "fp16-direct": (1, 130, 1, 1, 64, 128, None, torch.float16, torch.float32)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gate, neg_eigval, v_first, shape, windowed", [
    ("softplus", False, False, "exact", False), ("lower_bound", True, True, "exact", False),
    ("none", True, False, "exact", False), ("softplus", False, False, "exact", True),
    ("softplus", False, False, "bf16-grouped", False), ("lower_bound", True, False, "bf16-grouped", False),
    ("softplus", True, False, "bf16-direct", False), ("lower_bound", False, False, "fp16-direct", False),
    ("none", False, False, "bf16-direct", False), ("lower_bound", False, False, "bf16-grouped", True)])
def test_kda_fla06_gate_and_beta_options_match_reference(device, gate, neg_eigval, v_first, shape, windowed,
                                                         monkeypatch):
    """fla 0.6's in-kernel options with its meaning: the raw gate through A_log / dt_bias (softplus
    or the lower-bounded sigmoid), the raw beta through sigmoid (x2 with allow_neg_eigval), the state
    V-first; outputs, final state and every gradient (raw g and beta, A_log, dt_bias, the state)
    against the reference, in the exact family and in the bf16 kernels (which fuse the gate), also
    as windows along T (A_log's and dt_bias's gradients summed over the windows)."""
    B, T, H, HV, Kd, V, lens, dtype, g_dtype = GATE_SHAPES[shape]
    if windowed:
        from kda_dsa_ops.ops import kda as kda_ops

        monkeypatch.setattr(kda_ops, "WINDOW_TOKEN_HEADS", 64 * B * HV)  # 64-token windows
        assert len(kda_ops._windows(B * HV, T)) == -(-T // 64) > 1
    exact = dtype is None
    dtype = (F64 if device == "cpu" else torch.float32) if exact else dtype
    g_dtype = dtype if exact else g_dtype
    q, k, v, _, _ = make_inputs(B, T, H, HV, Kd, V, dtype, dtype, device)
    cu = None if lens is None else torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(device)
    N = B if lens is None else len(lens)
    state_dtype = F64 if dtype == F64 else torch.float32
    g_raw = (torch.randn(B, T, HV, Kd, device=device) * 2).to(g_dtype)
    beta_raw = torch.randn(B, T, HV, device=device).to(g_dtype)
    A_log = (torch.randn(HV, device=device) * 0.5).to(state_dtype)
    dt_bias = torch.randn(HV * Kd, device=device).to(state_dtype)
    h0 = torch.randn(N, HV, V if v_first else Kd, Kd if v_first else V, dtype=state_dtype, device=device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g_raw, beta_raw, A_log, dt_bias, h0)]
    opts = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval, state_v_first=v_first,
                matmul_precision="highest" if exact else "medium")
    if gate != "none":
        opts.update(use_gate_in_kernel=True, lower_bound=-5.0 if gate == "lower_bound" else None,
                    safe_gate=gate == "lower_bound")
    w_o = torch.randn(B, T, HV, V, device=device)

    def run(kda, ins, cu_seqlens):
        q_, k_, v_, g_, b_, a_, d_, h_ = ins
        gate_args = dict(A_log=a_, dt_bias=d_) if gate != "none" else {}
        g_in = g_ if gate != "none" else torch.nn.functional.logsigmoid(g_)  # a log-decay without the gate
        o, ht = kda(q_, k_, v_, g_in, b_, initial_state=h_, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu_seqlens, **opts, **gate_args)
        wrt = list(ins) if gate != "none" else [t for t in ins if t is not a_ and t is not d_]  # unused without
        loss = (o * w_o.to(o.device, o.dtype)).sum() + (ht * h_.detach().to(ht.dtype)).sum()
        return o, ht, torch.autograd.grad(loss, wrt)

    o, ht, grads = run(K.chunk_kda, leaves, cu)
    o_ref, ht_ref, ref_grads = run(R.chunk_kda, [t.detach().cpu().to(F64).requires_grad_() for t in leaves],
                                   None if cu is None else cu.cpu())
    table = REL_RMS if device == "cpu" else CUDA_KDA_REL_RMS
    row = torch.bfloat16 if dtype == torch.float16 and device == "cuda" else dtype  # bf16 products on CUDA
    assert ht.shape == h0.shape and o.dtype == dtype
    assert_close(o, o_ref, row, "o", table=table)
    assert_close(ht, ht_ref, row if not exact else state_dtype, "final state", table=table)
    names = ["dq", "dk", "dv", "dg_raw", "dbeta_raw"] + (["dA_log", "ddt_bias"] if gate != "none" else []) + ["dh0"]
    scales = {}
    if gate != "none":  # dA_log and ddt_bias sum terms over every token that can cancel: their sizes
        dg_raw, x = ref_grads[3], g_raw.cpu().to(F64) + dt_bias.cpu().to(F64).view(HV, Kd)
        sp = torch.nn.functional.softplus(x)
        scales = {"ddt_bias": dg_raw, "dA_log": dg_raw * (x if gate == "lower_bound" else sp / torch.sigmoid(x))}
    for name, a, e, x in zip(names, grads, ref_grads, [t for t in leaves if gate != "none" or t.dim() != 1]):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        assert_close(a, e, row if x.dtype in (torch.bfloat16, torch.float16) or not exact else x.dtype, name,
                     scale=scales.get(name), table=table)


def test_kda_segment_start_states_check_their_lists():
    with pytest.raises(ValueError, match="2 transitions for 1 final states"):
        K.segment_start_states([torch.eye(2)[None, None]] * 2, [torch.zeros(1, 1, 2, 3)])
    assert K.segment_start_states([], []) == []


@pytest.mark.parametrize("device", DEVICES)
def test_kda_extreme_decay_is_finite(device):
    """g = -1e4 in one step (state wiped) and cumulative sums of -1e4 inside a chunk: finite and
    equal to the reference."""
    q, k, v, g, beta = make_inputs(1, 96, 1, 1, 16, 16, torch.float32, torch.float32, device)
    g = g.clone()
    g[0, 40] = -1e4
    g[0, 41:, :, :4] = -160.0
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = K.chunk_kda(*ins, use_qk_l2norm_in_kernel=True)
    ref_ins = [t.detach().cpu().to(F64).requires_grad_() for t in ins]
    ro, _ = R.chunk_kda(*ref_ins, use_qk_l2norm_in_kernel=True)
    assert_close(o, ro, torch.float32, "o")
    grads = torch.autograd.grad(o.sum(), ins)
    ref_grads = torch.autograd.grad(ro.sum(), ref_ins)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, ref_grads):
        scale = {"dg": dg_scale, "dbeta": dbeta_scale}.get(name)
        assert_close(a, b, torch.float32, name, scale=scale(ref_ins, ref_grads) if scale else None)


# (device, dtype, matmul precision, K, V): the CPU kernel, and on CUDA the generic kernels, the
# generic intra kernel with the bf16 state kernel, and the bf16 kernels
KERNEL_PATHS = [("cpu", F64, "highest", 16, 16), ("cpu", torch.float32, "highest", 16, 16),
                pytest.param("cuda", torch.float32, "highest", 32, 16, marks=pytest.mark.cuda),
                pytest.param("cuda", torch.float32, "medium", 64, 64, marks=pytest.mark.cuda),
                pytest.param("cuda", torch.bfloat16, "medium", 64, 64, marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device, dtype, precision, Kd, V", KERNEL_PATHS)
def test_kda_minus_inf_decay_resets_the_state(device, dtype, precision, Kd, V):
    """g = -inf (decay 0) at whole steps and on single channels, inside chunks: the reference's
    outputs, final state and gradients (not NaN for the chunk)."""
    check_against_reference(device, dtype, torch.float32, 2, 150, 2, 2, Kd, V, None, True, True, "reset", precision)


def _poison_step(x, where, t, value):
    """x with x[0, t] set to value at one channel (q, k, g, v) or head (beta)."""
    x = x.detach().clone()
    if where == "beta":
        x[0, t, 0] = value
    else:
        x[0, t, 0, 1] = value
    return x


@pytest.mark.parametrize("device, dtype, precision, Kd, V", KERNEL_PATHS)
@pytest.mark.parametrize("where, value", [("q", "nan"), ("k", "nan"), ("k", "inf"), ("v", "nan"), ("v", "inf"),
                                          ("g", "nan"), ("beta", "nan")])
def test_kda_nonfinite_input_reaches_no_earlier_step(device, dtype, precision, Kd, V, where, value):
    """A NaN or inf at step 70 of one sequence (inside its second chunk) and at step 120 (the second
    sequence's first chunk): the outputs and final states are non-finite exactly where the
    reference's are (from that step on; one column for v, one step for q) and the reference's
    elsewhere, the steps before it in the same chunk included."""
    names = ["q", "k", "v", "g", "beta"]
    ins = make_inputs(1, 150, 2, 4, Kd, V, dtype, torch.float32, device)
    i = names.index(where)
    ins[i] = _poison_step(_poison_step(ins[i], where, 70, float(value)), where, 120, float(value))
    cu = torch.tensor([0, 100, 150], dtype=torch.int32, device=device)
    o, ht = K.chunk_kda(*ins, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True,
                       matmul_precision=precision)
    ro, rht = R.chunk_kda(*[t.cpu().to(F64) for t in ins], cu_seqlens=cu.cpu(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    table = CUDA_KDA_REL_RMS if device == "cuda" else REL_RMS
    medium = precision == "medium"
    rows = {"o": torch.bfloat16 if medium else dtype,
            "final_state": torch.bfloat16 if medium else F64 if dtype == F64 else torch.float32}
    for name, a, e in [("o", o, ro), ("final_state", ht, rht)]:
        a = a.cpu().to(F64)
        mask = torch.isfinite(e)
        assert name != "o" or ((~mask).any() and mask.any()), "o: the case must have finite and non-finite values"
        assert torch.equal(torch.isfinite(a), mask), (
            f"{name}: {int((torch.isfinite(a) != mask).sum())} values finite where the reference's are not or back")
        assert_close(a.where(mask, 0.0), e.where(mask, 0.0), rows[name], name, table=table)
    first = ~torch.isfinite(ro[0]).flatten(1).all(-1)
    assert int(first.nonzero()[0]) == 70, "the first non-finite output is the poisoned step's"


@pytest.mark.parametrize("device", DEVICES)
def test_kda_values_outside_the_contract_raise(device, value_checks):
    """g > 0 and beta outside [0, 2] (where the chunked form overflows) and int64 cu_seqlens past
    2^31 (which a cast would wrap) are errors naming the value."""
    q, k, v, g, beta = make_inputs(1, 10, 2, 4, 16, 8, torch.float32, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"g is a log-decay and must be <= 0 .*1 values above 0, up to 0.5"):
        K.chunk_kda(q, k, v, _poison_step(g, "g", 3, 0.5), beta)
    with pytest.raises(RuntimeError, match=r"beta must lie in \[0, 2\], got 1 values outside, in \[1000"):
        K.chunk_kda(q, k, v, g, _poison_step(beta, "beta", 2, 1e3))
    with pytest.raises(ValueError, match=r"cu_seqlens values must lie in \[0, 2\^31\)"):
        K.chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2 ** 32, 10], device=device))
    K.chunk_kda(q, k, v, g, _poison_step(beta, "beta", 2, float("nan")))  # NaN has its own rule


@pytest.mark.parametrize("device", DEVICES)
def test_kda_opcheck(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v, g, beta = make_inputs(1, 70, 2, 4, 16, 8, dtype, dtype, device)
    h0 = torch.randn(2, 4, 16, 8, dtype=dtype, device=device)
    cu = torch.tensor([0, 5, 70], dtype=torch.int32, device=device)
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    op = torch.ops.kda_dsa_ops.kda_fwd.default
    opcheck(op, (*ins, 0.25, h0.requires_grad_(), cu, True, True))
    opcheck(op, (*[t.reshape(2, 35, *t.shape[2:]).detach().requires_grad_() for t in ins], 0.25, None, None, False,
                 False))
    opcheck(op, (*[strided(t) for t in ins], 0.25, strided(h0), cu, True, True))
    o = K.chunk_kda(*ins, scale=0.25, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]
    opcheck(torch.ops.kda_dsa_ops.kda_bwd.default,  # the gradients come back contiguous whatever the strides
            (strided(torch.randn_like(o)), None, *[strided(t) for t in ins], 0.25, strided(h0), cu, True),
            test_utils=BACKWARD_UTILS)
    gate = (torch.randn(4, dtype=dtype, device=device).requires_grad_(),
            torch.randn(64, dtype=dtype, device=device).requires_grad_())
    raw = [t.detach().requires_grad_() for t in (torch.randn_like(g), torch.randn_like(beta))]
    for lower_bound, beta_scale in ((0.0, 1.0), (-5.0, 2.0)):  # the in-kernel gate and beta
        opcheck(op, (*ins[:3], *raw, 0.25, h0, cu, True, True, False, *gate, lower_bound, beta_scale))
        opcheck(torch.ops.kda_dsa_ops.kda_bwd.default,
                (torch.randn_like(o), None, *ins[:3], *raw, 0.25, h0, cu, True, False, *gate, lower_bound,
                 beta_scale), test_utils=BACKWARD_UTILS)


@pytest.mark.parametrize("device", DEVICES)
def test_kda_compile_fullgraph(device):
    torch._dynamo.reset()
    q, k, v, g, beta = make_inputs(2, 40, 1, 2, 16, 16, torch.float32, torch.float32, device)
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]

    def block(q, k, v, g, beta):
        o, ht = K.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o.sum(-1) + ht.sum()

    eager = block(*ins)
    out = torch.compile(block, fullgraph=True, backend="aot_eager")(*ins)
    assert torch.equal(out, eager)
    for a, b in zip(torch.autograd.grad(out.sum(), ins), torch.autograd.grad(eager.sum(), ins)):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_kda_cuda_does_not_synchronise():
    q, k, v, g, beta = make_inputs(1, 300, 2, 2, 64, 64, torch.bfloat16, torch.float32, "cuda")
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32, device="cuda")
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for precision in ("highest", "medium"):
            o, ht = K.chunk_kda(*ins, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True,
                               matmul_precision=precision)
            torch.autograd.grad(o.float().sum() + ht.sum(), ins)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
def test_kda_bad_inputs_raise(device, value_checks):
    q, k, v, g, beta = make_inputs(1, 10, 2, 4, 16, 8, torch.float32, torch.float32, device)
    f = K.chunk_kda
    with pytest.raises(RuntimeError, match="multiple of the query/key heads"):
        f(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(RuntimeError, match="k must have the shape of q"):
        f(q, k[:, :9], v, g, beta)
    with pytest.raises(RuntimeError, match=r"head dims K \(0\) and V \(8\) must lie in \[1, 128\]"):
        f(q[..., :0], k[..., :0], v, g[..., :0], beta)  # no default scale to compute
    with pytest.raises(RuntimeError, match="g must be"):
        f(q, k, v, g[..., :8], beta)
    with pytest.raises(RuntimeError, match="beta must be"):
        f(q, k, v, g, beta[:, :9])
    with pytest.raises(RuntimeError, match=r"head dims K \(200\)"):
        big = torch.randn(1, 10, 2, 200, device=device)
        f(big, big, v, torch.zeros(1, 10, 4, 200, device=device), beta)
    with pytest.raises(RuntimeError, match="share one dtype"):
        f(q, k.double(), v, g, beta)
    with pytest.raises(RuntimeError, match="g must be float32 or the dtype of q"):
        f(q.half(), k.half(), v.half(), g.double(), beta.half())
    with pytest.raises(RuntimeError, match="cu_seqlens must have dtype"):
        f(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 10.0], device=device))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        f(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="must end at T = 10"):
        f(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6, 9], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="must start at 0"):
        f(q, k, v, g, beta, cu_seqlens=torch.tensor([1, 6, 10], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="B == 1"):
        q2, k2, v2, g2, b2 = make_inputs(2, 10, 2, 4, 16, 8, torch.float32, torch.float32, device)
        f(q2, k2, v2, g2, b2, cu_seqlens=torch.tensor([0, 10], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="initial_state must be float"):
        f(q, k, v, g, beta, initial_state=torch.zeros(1, 4, 16, 8, dtype=torch.bfloat16, device=device))
    with pytest.raises(RuntimeError, match=r"initial_state must be \[N, HV, K, V\]"):
        f(q, k, v, g, beta, initial_state=torch.zeros(2, 4, 16, 8, device=device))
    with pytest.raises(TypeError, match=r"unsupported arguments \['cp_context'\]"):
        f(q, k, v, g, beta, cp_context=object())
    with pytest.raises(TypeError, match="return_intermediate_states"):
        f(q, k, v, g, beta, return_intermediate_states=True)
    with pytest.raises(ValueError, match="use_gate_in_kernel needs A_log with one value per value head"):
        f(q, k, v, g, beta, use_gate_in_kernel=True)
    A_log = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="dt_bias must hold HV"):
        f(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="safe_gate needs lower_bound"):
        f(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound must be a finite number < 0"):
        f(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, lower_bound=1.0)
    with pytest.raises(ValueError, match="belong to use_gate_in_kernel=True"):
        f(q, k, v, g, beta, A_log=A_log)
    with pytest.raises(ValueError, match="allow_neg_eigval .* needs use_beta_sigmoid_in_kernel"):
        f(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="cu_seqlens_cpu is a host copy of cu_seqlens"):
        f(q, k, v, g, beta, cu_seqlens_cpu=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        f(q, k, v, g, beta, matmul_precision="low")


@pytest.mark.cuda
def test_kda_cuda_bad_device_and_dtype_raise():
    q, k, v, g, beta = make_inputs(1, 10, 1, 1, 16, 8, torch.float32, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="same device"):
        K.chunk_kda(q, k.cpu(), v, g, beta)
    with pytest.raises(RuntimeError, match="use the CPU kernel for float64"):
        K.chunk_kda(q.double(), k.double(), v.double(), g.double(), beta.double())
