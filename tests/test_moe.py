"""MoE ops (routing, permutation, grouped GEMM) against the float64 reference, on CPU and CUDA:
outputs and every gradient, opcheck, torch.compile(fullgraph=True), no host synchronisation,
determinism, and bad inputs."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kda_dsa_ops as K
from kda_dsa_ops import reference as R

from conftest import DEVICES, IS_HOPPER
from helpers import BACKWARD_UTILS, offsets_from_counts, opcheck, poison, strided
from strategies import SEEDS, expert_counts, gemm_dims, routing_case
from tolerances import assert_close

F64 = torch.float64
HALF_TYPES = [torch.bfloat16, torch.float16]


def device_dtypes(device):
    return HALF_TYPES if device == "cuda" else [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def spaced_logits(T, E, dtype, device):
    """Distinct logits 0.0625 apart: the fp32 kernel and the fp64 reference rank them alike."""
    rows = torch.stack([torch.randperm(E) for _ in range(T)]).to(F64) * 0.0625 - 0.03125 * E
    return rows.to(dtype).to(device)


def integer_bias(E, device):
    """Integer-valued bias: it reorders experts without creating near-ties with the scores."""
    return torch.randint(-2, 3, (E,)).to(torch.float32).to(device)


# ---- moe_route -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, case=routing_case(max_tokens=33, max_experts=300), score_fn=st.sampled_from(["sigmoid", "softmax"]),
       renorm=st.booleans(), with_bias=st.booleans(), data=st.data())
def test_route_matches_reference(seed, device, case, score_fn, renorm, with_bias, data):
    torch.manual_seed(seed)
    T, E, k = case
    dtype = data.draw(st.sampled_from([torch.float32] + HALF_TYPES))
    logits = spaced_logits(T, E, dtype, device).requires_grad_()
    bias = integer_bias(E, device) if with_bias else None
    poison(device)
    w, ids = K.moe_route(logits, k, bias, score_fn, renorm, 1.5)
    ref_logits = logits.detach().cpu().to(F64).requires_grad_()
    w_ref, ids_ref = R.moe_route(ref_logits, k, None if bias is None else bias.cpu(), score_fn, renorm, 1.5)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ids_ref)
    check_route_gradient(w, w_ref, logits, ref_logits, score_fn, 1.5, dtype)


def check_route_gradient(w, w_ref, logits, ref_logits, score_fn, scale, dtype):
    """The weights and their gradient w.r.t. the logits against the reference's."""
    assert_close(w, w_ref, torch.float32, "weights")
    g = torch.randn(w.shape, dtype=torch.float32)
    (grad,) = torch.autograd.grad(w, logits, g.to(logits.device))
    (grad_ref,) = torch.autograd.grad(w_ref, ref_logits, g.to(F64))
    # Renormalisation cancels most of the gradient (all of it for k = 1): measure the error
    # against the gradient before renormalisation.
    (unnormalised,) = torch.autograd.grad(R.moe_route(ref_logits, w.shape[1], None, score_fn, False, scale)[0],
                                          ref_logits, g.to(F64))
    assert_close(grad, grad_ref, dtype, "grad_logits", scale=unnormalised)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, E, offset", [(torch.float32, 896, 0), (torch.float32, 896, 1),
                                              (torch.bfloat16, 900, 0), (torch.float16, 136, 8)])
@pytest.mark.parametrize("score_fn", ["sigmoid", "softmax"])
def test_route_many_tokens(device, dtype, E, offset, score_fn):
    """More tokens than the CUDA grid has warps (each warp walks several tokens through its two
    row buffers), rows copied in bulk (16-byte aligned) and by the lanes (misaligned storage, or
    rows of a length that breaks the alignment): the same picks as the float64 reference."""
    torch.manual_seed(E + offset)
    T, k = 9000, 16
    rows = torch.stack([torch.randperm(E) for _ in range(T)]).to(F64) * (8.0 / E) - 4.0
    storage = torch.empty(T * E + offset, dtype=dtype, device=device)
    logits = storage[offset:].view(T, E)
    logits.copy_(rows.to(dtype))
    bias = integer_bias(E, device)
    w, ids = K.moe_route(logits, k, bias, score_fn)
    w_ref, ids_ref = R.moe_route(logits.cpu().to(F64), k, bias.cpu(), score_fn)
    assert torch.equal(ids.cpu(), ids_ref)
    assert_close(w, w_ref, torch.float32, "weights")


def brute_force_group_routing(key: torch.Tensor, k: int, n_group: int, topk_group: int) -> list[set]:
    """Group-limited routing written out token by token: rank the groups by the sum of their two
    best keys, keep the best topk_group, take the k best keys among their experts."""
    E = key.shape[1]
    size = E // n_group
    chosen = []
    for row in key.tolist():
        group_score = [sum(sorted(row[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        open_experts = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen.append(set(sorted(open_experts, key=lambda e: (-row[e], e))[:k]))
    return chosen


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, T=st.integers(1, 40), groups=st.sampled_from([(2, 1), (4, 2), (8, 3), (8, 8), (64, 5)]),
       per_group=st.sampled_from([2, 3, 32]), k=st.integers(1, 8), score_fn=st.sampled_from(["sigmoid", "softmax"]),
       data=st.data())
def test_group_limited_route(seed, device, T, groups, per_group, k, score_fn, data):
    """n_group > 1 (DeepSeek-V3's routing): the chosen experts are the k best of the topk_group
    groups with the largest top-2 sums, as written out token by token, on CPU and CUDA alike; the
    weights and their gradient are the reference's."""
    torch.manual_seed(seed)
    n_group, topk_group = groups
    E = n_group * min(per_group, 256 // n_group)  # spaced logits stay apart in fp32 up to ~300 experts
    per_group = E // n_group
    k = min(k, topk_group * per_group)
    dtype = data.draw(st.sampled_from([torch.float32] + HALF_TYPES))
    logits = spaced_logits(T, E, dtype, device).requires_grad_()
    bias = integer_bias(E, device)
    w, ids = K.moe_route(logits, k, bias, score_fn, True, 2.5, n_group, topk_group)
    ref_logits = logits.detach().cpu().to(F64).requires_grad_()
    w_ref, ids_ref = R.moe_route(ref_logits, k, bias.cpu(), score_fn, True, 2.5, n_group, topk_group)
    key = R.route_scores(ref_logits.detach(), score_fn) + bias.cpu().to(F64)
    # Softmax over 256 experts leaves tail scores of ~1e-8 on an integer bias: keys that fp32 cannot
    # tell apart may be taken in either order, nothing else may differ.
    chosen, expected = key.gather(1, ids.cpu().long()), key.gather(1, ids_ref)
    assert torch.equal(ids.cpu(), ids_ref) or torch.allclose(chosen, expected, rtol=2 ** -22, atol=0)
    assert [set(r) for r in ids_ref.tolist()] == brute_force_group_routing(key, k, n_group, topk_group)
    check_route_gradient(w, w_ref, logits, ref_logits, score_fn, 2.5, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [5, 40])
def test_route_bwd_repeated_and_many_choices(device, k):
    """moe_route_bwd on ids given directly, sigmoid scores: an expert chosen twice gets the sum of
    both choices' gradients, the others zero; k <= 32 (the CUDA kernel that reads the chosen
    logits only) and k > 32, against the formula in float64."""
    torch.manual_seed(0)
    T, E = 7, 50
    logits = torch.randn(T, E).to(F64)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    ids[:, 1] = ids[:, 0]
    g = torch.randn(T, k).to(F64)
    s = torch.sigmoid(logits)
    u = s.gather(1, ids.long())
    unnormalised = torch.zeros_like(logits).scatter_add_(1, ids.long(), 1.5 * g) * s * (1 - s)
    for renorm in (False, True):
        got = torch.ops.kda_dsa_ops.moe_route_bwd(g.float().to(device), logits.float().to(device), ids.to(device),
                                                  "sigmoid", renorm, 1.5)
        D = u.sum(1, keepdim=True) + 1e-20
        ds = 1.5 * (g / D - (g * u).sum(1, keepdim=True) / D**2) if renorm else 1.5 * g
        expected = torch.zeros_like(logits).scatter_add_(1, ids.long(), ds) * s * (1 - s)
        assert_close(got, expected, torch.float32, f"grad_logits (renorm={renorm})", scale=unnormalised)


@pytest.mark.parametrize("device", DEVICES)
def test_route_ties_and_nan(device):
    logits = torch.zeros(3, 6, device=device)
    logits[1, 4] = float("nan")
    logits.requires_grad_()
    w, ids = K.moe_route(logits, 3)
    assert ids[0].tolist() == [0, 1, 2]
    assert ids[1].tolist() == [0, 1, 2]  # NaN ranks last
    (grad,) = torch.autograd.grad(w.sum() + (w * w).sum(), logits)
    assert torch.isfinite(grad).all() and grad[1, 4] == 0  # an expert not chosen gets no gradient
    logits = logits.detach()
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0], device=device)
    w, ids = K.moe_route(logits, 2, bias, renorm=False)
    assert ids[0].tolist() == [5, 0]
    assert torch.allclose(w[0], torch.full((2,), 0.5, device=device))  # the bias never weights


# ---- moe_permute / moe_unpermute --------------------------------------------------------------

def routed_case(T, E, k, device):
    """ids, weights (distinct) and fallback ids from a routing of random logits."""
    logits = torch.randn(T, E, dtype=F64)
    w, ids = R.moe_route(logits, k)
    ranked = torch.sort(logits, dim=-1, descending=True, stable=True).indices.to(torch.int32)
    fallback = ranked[:, k:] if E > k else torch.full((T, 1), -1, dtype=torch.int32)
    return ids.to(device), w.to(torch.float32).to(device), fallback.contiguous().to(device)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, case=routing_case(max_tokens=40, max_experts=24),
       policy=st.sampled_from(["drop_probs", "drop_position", "reroute"]),
       capacity=st.one_of(st.none(), st.integers(0, 9)), D=st.sampled_from([1, 8, 24, 40]), data=st.data())
def test_permute_matches_reference(seed, device, case, policy, capacity, D, data):
    torch.manual_seed(seed)
    T, E, k = case
    dtype = data.draw(st.sampled_from(device_dtypes(device)))
    ids, w, fallback = routed_case(T, E, k, device)
    x = torch.randn(T, D, device=device).to(dtype).requires_grad_()
    poison(device)
    xs, row_map, offs = K.moe_permute(x, ids, E, w, capacity, policy=policy, fallback_ids=fallback)
    xs_ref, row_map_ref, offs_ref = R.moe_permute(x.detach().cpu(), ids.cpu(), E, w.cpu(), capacity, policy=policy,
                                                   fallback_ids=fallback.cpu())
    assert torch.equal(row_map.cpu(), row_map_ref)
    assert torch.equal(offs.cpu(), offs_ref)
    assert torch.equal(xs.detach().cpu(), xs_ref)
    g = torch.randn_like(xs)
    (dx,) = torch.autograd.grad(xs, x, g)
    x_ref = x.detach().cpu().to(F64).requires_grad_()
    (dx_ref,) = torch.autograd.grad(R.moe_permute(x_ref, ids.cpu(), E, w.cpu(), capacity, policy=policy, fallback_ids=fallback.cpu())[0],
                                    x_ref, g.cpu().to(F64))
    assert_close(dx, dx_ref, dtype, "dx")


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, case=routing_case(max_tokens=40, max_experts=24), capacity=st.one_of(st.none(), st.integers(0, 9)),
       D=st.sampled_from([1, 8, 24, 64]), data=st.data())
def test_unpermute_matches_reference(seed, device, case, capacity, D, data):
    torch.manual_seed(seed)
    T, E, k = case
    dtype = data.draw(st.sampled_from(device_dtypes(device)))
    ids, w, _ = routed_case(T, E, k, device)
    _, row_map, _ = R.moe_permute(torch.zeros(T, 1), ids.cpu(), E, w.cpu(), capacity, policy="drop_probs")
    row_map = row_map.to(device)
    ys = torch.randn(row_map.shape[0], D, device=device).to(dtype).requires_grad_()
    w = w.clone().requires_grad_()
    poison(device)
    y = K.moe_unpermute(ys, row_map, w, T)
    ys_ref = ys.detach().cpu().to(F64).requires_grad_()
    w_ref = w.detach().cpu().to(F64).requires_grad_()
    y_ref = R.moe_unpermute(ys_ref, row_map.cpu(), w_ref, T)
    assert_close(y, y_ref, dtype, "y")
    g = torch.randn(T, D).to(dtype)
    d_ys, d_w = torch.autograd.grad(y, (ys, w), g.to(device))
    d_ys_ref, d_w_ref = torch.autograd.grad(y_ref, (ys_ref, w_ref), g.to(F64))
    assert_close(d_ys, d_ys_ref, dtype, "grad_y_sorted")
    # Each weight's gradient is one fp32 dot product over D: its rounding scales with the sum of
    # the |terms|, not with their (possibly cancelling) total.
    (d_w_terms,) = torch.autograd.grad(R.moe_unpermute(ys_ref.detach().abs(), row_map.cpu(), w_ref, T), w_ref,
                                       g.to(F64).abs())
    assert_close(d_w, d_w_ref, torch.float32, "grad_weights", scale=d_w_terms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("F", [5, 32])
def test_permute_reroute_many_overflows(device, F):
    """Thousands of overflowing copies (several windows of the CUDA pass), tokens with several
    of them, fallback lists with -1 and repeated experts, and experts that fill up."""
    torch.manual_seed(F)
    T, E, k = 3000, 32, 4
    w, ids = R.moe_route((torch.randn(T, E) + torch.linspace(2, -2, E)).to(F64), k)  # skewed loads
    ids, w = ids.to(torch.int32), w.to(torch.float32)
    fallback = torch.randint(-1, E, (T, F), dtype=torch.int32)
    x = torch.randn(T, 24).to(torch.bfloat16)
    capacity = 3 * T * k // (4 * E)
    expected = R.moe_permute(x, ids, E, w, capacity, policy="reroute", fallback_ids=fallback)
    assert (torch.bincount(ids.view(-1).long(), minlength=E) - capacity).clamp(min=0).sum() > 2048
    got = K.moe_permute(x.to(device), ids.to(device), E, w.to(device), capacity, policy="reroute",
                        fallback_ids=fallback.to(device))
    for name, a, b in zip(("x_sorted", "row_map", "offs"), got, expected):
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("device", DEVICES)
def test_permute_is_deterministic(device):
    ids, w, fallback = routed_case(300, 16, 4, device)
    x = torch.randn(300, 64, device=device, dtype=torch.bfloat16)
    first = K.moe_permute(x, ids, 16, w, capacity_factor=0.8, policy="reroute", fallback_ids=fallback)
    y0 = K.moe_unpermute(first[0], first[1], w, 300)
    for _ in range(3):
        again = K.moe_permute(x, ids, 16, w, capacity_factor=0.8, policy="reroute", fallback_ids=fallback)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert torch.equal(K.moe_unpermute(again[0], again[1], w, 300), y0)


# ---- grouped_mm / grouped_mm_wgrad ------------------------------------------------------------

def gemm_case(counts, K_, N, dtype, device, tail=0, transposed_b=False):
    E = len(counts)
    M = sum(counts) + tail
    a = torch.randn(M, K_, device=device).to(dtype)
    if transposed_b:
        b = torch.randn(E, N, K_, device=device).to(dtype).transpose(1, 2)
    else:
        b = torch.randn(E, K_, N, device=device).to(dtype)
    return a, b, offsets_from_counts(counts, device)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, counts=expert_counts(max_count=300), dims=gemm_dims(multiple_of=8, max_dim=320), tail=st.integers(0, 20),
       transposed_b=st.booleans(), data=st.data())
def test_grouped_mm_matches_reference(seed, device, counts, dims, tail, transposed_b, data):
    torch.manual_seed(seed)
    if device == "cuda" and not IS_HOPPER:
        pytest.skip("the CUDA grouped GEMM needs sm_90")
    K_, N = dims
    dtype = data.draw(st.sampled_from(device_dtypes(device)))
    a, b, offs = gemm_case(counts, K_, N, dtype, device, tail, transposed_b)
    a.requires_grad_()
    b.requires_grad_()
    poison(device)
    out = K.grouped_mm(a, b, offs)
    a_ref = a.detach().cpu().to(F64).requires_grad_()
    b_ref = b.detach().cpu().to(F64).requires_grad_()
    out_ref = R.grouped_mm(a_ref, b_ref, offs.cpu())
    assert_close(out, out_ref, dtype, "out")
    g = torch.randn(out.shape).to(dtype)
    poison(device)
    da, db = torch.autograd.grad(out, (a, b), g.to(device))
    da_ref, db_ref = torch.autograd.grad(out_ref, (a_ref, b_ref), g.to(F64))
    assert_close(da, da_ref, dtype, "grad_a")
    assert_close(db, db_ref, dtype, "grad_b")


@pytest.mark.parametrize("device", DEVICES)
@given(seed=SEEDS, counts=expert_counts(max_count=300), dims=gemm_dims(multiple_of=8, max_dim=320), data=st.data())
def test_grouped_mm_wgrad_matches_reference(seed, device, counts, dims, data):
    torch.manual_seed(seed)
    if device == "cuda" and not IS_HOPPER:
        pytest.skip("the CUDA grouped GEMM needs sm_90")
    K_, N = dims
    dtype = data.draw(st.sampled_from(device_dtypes(device)))
    a, _, offs = gemm_case(counts, K_, N, dtype, device)
    dy = torch.randn(a.shape[0], N, device=device).to(dtype)
    poison(device)
    out = K.grouped_mm_wgrad(a, dy, offs)
    assert_close(out, R.grouped_mm_wgrad(a.cpu().to(F64), dy.cpu().to(F64), offs.cpu()), dtype, "wgrad")


@pytest.mark.cuda
@pytest.mark.skipif(not IS_HOPPER, reason="the CUDA grouped GEMM needs sm_90")
@pytest.mark.parametrize("transposed_b", [False, True])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_grouped_mm_matches_torch_grouped_mm(dtype, transposed_b):
    counts = [0, 1, 127, 128, 129, 300, 513, 7, 0]
    a, b, offs = gemm_case(counts, 512, 768, dtype, "cuda", tail=5, transposed_b=transposed_b)
    out = K.grouped_mm(a, b, offs)
    expected = torch._grouped_mm(a, b, offs=offs)
    rows = int(offs[-1])
    assert_close(out[:rows], expected[:rows], dtype, "out vs torch._grouped_mm")
    assert (out[rows:] == 0).all()
    dy = torch.randn(a.shape[0], 768, device="cuda", dtype=dtype)
    wgrad = K.grouped_mm_wgrad(a, dy, offs)
    assert_close(wgrad, torch._grouped_mm(a.t(), dy, offs=offs), dtype, "wgrad vs torch._grouped_mm")


@pytest.mark.cuda
@pytest.mark.skipif(not IS_HOPPER, reason="the CUDA grouped GEMM needs sm_90")
def test_grouped_mm_wgrad_many_tiles_uneven_experts():
    """Several output tile pairs per cluster (the persistent walk over experts) and experts of
    very different lengths, empty ones and lengths not a multiple of 64 among them; the same
    bits on a second run."""
    torch.manual_seed(0)
    counts = torch.randint(0, 700, (48,))
    counts[::7] = 0
    counts[3] = 2500
    a, _, offs = gemm_case(counts.tolist(), 512, 512, torch.bfloat16, "cuda", tail=9)
    dy = torch.randn(a.shape[0], 512, device="cuda").to(torch.bfloat16)
    out = K.grouped_mm_wgrad(a, dy, offs)
    assert_close(out, R.grouped_mm_wgrad(a.cpu().to(F64), dy.cpu().to(F64), offs.cpu()), torch.bfloat16, "wgrad")
    assert torch.equal(out, K.grouped_mm_wgrad(a, dy, offs))  # the same order on every run


# ---- no host synchronisation, opcheck, torch.compile -------------------------------------------

@pytest.mark.cuda
def test_cuda_ops_do_not_synchronise():
    ids, w, fallback = routed_case(64, 12, 3, "cuda")
    logits = torch.randn(64, 12, device="cuda")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(12, 64, 128, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        K.moe_route(logits, 3)
        xs, row_map, offs = K.moe_permute(x, ids, 12, w, capacity_factor=1.0, policy="reroute", fallback_ids=fallback)
        K.moe_unpermute(xs, row_map, w, 64)
        if IS_HOPPER:
            y = K.grouped_mm(xs, b, offs)
            K.grouped_mm_wgrad(xs, y, offs)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def opcheck_cases(device):
    ids, w, fallback = routed_case(10, 6, 2, device)
    logits = torch.randn(10, 6, device=device)
    x = torch.randn(10, 16, device=device, dtype=torch.bfloat16)
    xs, row_map, offs = R.moe_permute(x.cpu(), ids.cpu(), 6, w.cpu(), 3, policy="drop_probs")
    xs, row_map, offs = xs.to(device), row_map.to(device), offs.to(device)
    ys = torch.randn(xs.shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    ops = torch.ops.kda_dsa_ops
    cases = [
        (ops.moe_route.default, (logits.requires_grad_(), None, 2, "softmax", True, 1.0)),
        (ops.moe_permute.default, (x.requires_grad_(), ids, w, 6, 3, "reroute", fallback)),
        (ops.moe_unpermute.default, (ys, row_map, w.clone().requires_grad_(), 10)),
    ]
    if device == "cpu" or IS_HOPPER:
        b = torch.randn(6, 16, 24, device=device, dtype=torch.bfloat16, requires_grad=True)
        cases.append((ops.grouped_mm.default, (xs.clone().requires_grad_(), b, offs)))
        cases.append((ops.grouped_mm_wgrad.default, (xs, torch.randn(xs.shape[0], 24, device=device,
                                                                      dtype=torch.bfloat16), offs)))
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [lambda t: t, strided], ids=["contiguous", "strided"])
def test_opcheck(device, layout):
    for op, args in opcheck_cases(device):
        if layout is strided and op in (torch.ops.kda_dsa_ops.grouped_mm.default,
                                        torch.ops.kda_dsa_ops.grouped_mm_wgrad.default):
            continue  # the CUDA grouped GEMM needs 16-byte aligned rows: strided inputs are refused
        opcheck(op, tuple(layout(a) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 1
                          else a for a in args))
    if layout is strided:  # the backward ops on strided inputs: their gradients come back contiguous
        ops = torch.ops.kda_dsa_ops
        logits = strided(torch.randn(10, 6, device=device))
        w, ids = K.moe_route(logits, 2)
        opcheck(ops.moe_route_bwd.default, (strided(torch.randn(10, 2, device=device)), logits, ids, "sigmoid",
                                            True, 1.0), test_utils=BACKWARD_UTILS)
        xs, row_map, _ = K.moe_permute(torch.randn(10, 16, device=device), ids, 6, w)
        opcheck(ops.moe_unpermute_bwd.default, (strided(torch.randn(10, 16, device=device)), strided(xs), row_map,
                                                strided(w)), test_utils=BACKWARD_UTILS)


def moe_block(x, logits, w_up, E, k, capacity):
    weights, ids = K.moe_route(logits, k)
    xs, row_map, offs = K.moe_permute(x, ids, E, weights, capacity)
    ys = K.grouped_mm(xs, w_up, offs)
    return K.moe_unpermute(ys, row_map, weights, x.shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strided", [False, True])
def test_compile_fullgraph(device, strided):
    """strided: x and logits as transposed views (the ops' gradients come back contiguous, as
    their fake kernels say)."""
    if device == "cuda" and not IS_HOPPER:
        pytest.skip("the CUDA grouped GEMM needs sm_90")
    torch._dynamo.reset()
    if strided:
        x = torch.randn(16, 32, device=device, dtype=torch.bfloat16).t().requires_grad_()
        logits = torch.randn(8, 32, device=device).t().requires_grad_()
    else:
        x = torch.randn(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        logits = torch.randn(32, 8, device=device, requires_grad=True)
    w_up = torch.randn(8, 16, 24, device=device, dtype=torch.bfloat16, requires_grad=True)
    eager = moe_block(x, logits, w_up, 8, 2, 6)
    compiled = torch.compile(moe_block, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(x, logits, w_up, 8, 2, 6)
    assert torch.equal(out, eager)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, logits, w_up), g)
    grads_eager = torch.autograd.grad(eager, (x, logits, w_up), g)
    for a, b in zip(grads, grads_eager):
        assert torch.equal(a, b)


# ---- bad inputs ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise(device, value_checks):
    dt = torch.bfloat16
    a = torch.randn(10, 16, device=device, dtype=dt)
    b = torch.randn(3, 16, 8, device=device, dtype=dt)
    offs = torch.tensor([3, 6, 10], device=device, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="b dtype"):
        K.grouped_mm(a, b.float(), offs)
    with pytest.raises(RuntimeError, match="offs must have dtype"):
        K.grouped_mm(a, b, offs.long())
    with pytest.raises(RuntimeError, match="non-decreasing"):
        K.grouped_mm(a, b, torch.tensor([3, 2, 10], device=device, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="past the 10 rows"):
        K.grouped_mm(a, b, torch.tensor([3, 6, 11], device=device, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one entry per expert"):
        K.grouped_mm(a, b, offs[:2])
    with pytest.raises(RuntimeError, match="K = a.size"):
        K.grouped_mm(a, torch.randn(3, 15, 8, device=device, dtype=dt), offs)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        K.grouped_mm(a[0], b, offs)
    with pytest.raises(RuntimeError, match="M = 10 rows of a"):
        K.grouped_mm_wgrad(a, torch.randn(9, 8, device=device, dtype=dt), offs)

    logits = torch.randn(4, 5, device=device)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, E\]"):
        K.moe_route(logits, 6)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, E\]"):
        K.moe_route(logits, 0)
    with pytest.raises(RuntimeError, match="score_fn"):
        K.moe_route(logits, 2, score_fn="relu")
    with pytest.raises(RuntimeError, match="bias must have E = 5"):
        K.moe_route(logits, 2, torch.zeros(4, device=device))
    x, ids = torch.randn(4, 8, device=device), torch.zeros(4, 2, device=device, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"ids must be 2-D \[T, k\]"):
        K.moe_permute(x, ids[:, 0], 4, capacity_factor=1.0)
    with pytest.raises(RuntimeError, match="num_experts must be >= 1, got 0"):
        K.moe_permute(x, ids, 0, capacity_factor=1.0)
    for bad in (math.nan, math.inf, 0.0):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            K.moe_permute(x, ids, 4, capacity_factor=bad)
    grouped = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match=r"n_group must divide E = 8"):
        K.moe_route(grouped, 2, n_group=3)
    with pytest.raises(RuntimeError, match=r"groups need >= 2 experts"):
        K.moe_route(grouped, 2, n_group=8)
    with pytest.raises(RuntimeError, match=r"topk_group must be in \[1, n_group = 4\]"):
        K.moe_route(grouped, 2, n_group=4, topk_group=5)
    with pytest.raises(RuntimeError, match=r"k = 5 exceeds the 4 experts of topk_group = 2 groups"):
        K.moe_route(grouped, 5, n_group=4, topk_group=2)

    x = torch.randn(4, 8, device=device, dtype=dt)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4]], device=device, dtype=torch.int32)
    w = torch.rand(4, 2, device=device)
    with pytest.raises(RuntimeError, match=r"ids values must lie in \[0, 4\)"):
        K.moe_permute(x, ids, 4)
    with pytest.raises(RuntimeError, match="ids must have dtype"):
        K.moe_permute(x, ids.long(), 5)
    with pytest.raises(RuntimeError, match="pass weights"):
        K.moe_permute(x, ids, 5, capacity=1)
    with pytest.raises(RuntimeError, match="needs fallback_ids"):
        K.moe_permute(x, ids, 5, w, capacity=1, policy="reroute")
    with pytest.raises(RuntimeError, match="policy must be"):
        K.moe_permute(x, ids, 5, w, capacity=1, policy="random")
    with pytest.raises(RuntimeError, match="fallback_ids values"):
        K.moe_permute(x, ids, 5, w, capacity=1, policy="reroute", fallback_ids=torch.full((4, 2), 7, device=device,
                                                                                            dtype=torch.int32))
    rows = torch.tensor([0, 1, 9, -1], device=device, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row_map values"):
        K.moe_unpermute(torch.randn(4, 8, device=device, dtype=dt), rows, w, 4)
    with pytest.raises(RuntimeError, match="at most once"):
        K.moe_unpermute(torch.randn(4, 8, device=device, dtype=dt), torch.tensor([0, 1, 1, -1], device=device,
                                                                                  dtype=torch.int32), w, 4)
    with pytest.raises(RuntimeError, match="num_tokens = 3"):
        K.moe_unpermute(torch.randn(4, 8, device=device, dtype=dt), torch.zeros(4, device=device,
                                                                                dtype=torch.int32), w, 3)


@pytest.mark.cuda
def test_cuda_bad_device_raises():
    a = torch.randn(10, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 16, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="same device"):
        K.grouped_mm(a, b, torch.tensor([3, 6, 10], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="same device"):
        K.moe_route(torch.randn(4, 5, device="cuda"), 2, torch.zeros(5))


@pytest.mark.cuda
def test_cuda_bad_values_without_checks_harm_nothing():
    """With value checks off, out-of-contract values are clamped or dropped, never read or written
    out of bounds; the device stays usable."""
    assert not K.value_checks_enabled()
    x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[0, 9], [1, -3], [2, 3], [3, 4]], device="cuda", dtype=torch.int32)
    xs, row_map, offs = K.moe_permute(x, ids, 5)
    assert offs[-1].item() == 6  # the two out-of-range copies are dropped
    assert (row_map[6:] == -1).all()
    if IS_HOPPER:
        a = torch.randn(10, 16, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(3, 16, 8, device="cuda", dtype=torch.bfloat16)
        bad = torch.tensor([3, 2, 99], device="cuda", dtype=torch.int32)  # clamped to [3, 3, 10]
        out = K.grouped_mm(a, b, bad)
        expected = R.grouped_mm(a.cpu().double(), b.cpu().double(), torch.tensor([3, 3, 10], dtype=torch.int32))
        assert_close(out, expected, torch.bfloat16, "clamped offs")
    torch.cuda.synchronize()
