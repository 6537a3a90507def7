"""Each reference op against an independent formulation of the same mathematics, in float64.

The references are the ground truth for every kernel, so they are checked here first: KDA's
recurrence against the Householder product form, LI against brute-force scoring and sorting,
SFA against dense attention under a mask built from the indices, every explicit backward
against autograd, and the MoE ops against loops that follow the definitions one copy at a time.
"""

import inspect
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kda_dsa_ops import ops
from kda_dsa_ops import reference as R
from kda_dsa_ops.contracts import expert_capacity
from kda_dsa_ops.nn.loss import indexer_kl_loss

from strategies import SEEDS, expert_counts, routing_case, seqlens
from tolerances import assert_close

F64 = torch.float64


# ---- KDA -------------------------------------------------------------------------------------

def kda_householder(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens):
    """S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = scale S_t^T q_t, one head at a time."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        c = cu_seqlens.tolist()
        seqs = [(0, c[i], c[i + 1]) for i in range(len(c) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=F64)
    finals = torch.zeros(len(seqs), HV, K, V, dtype=F64)
    for n, (b, start, end) in enumerate(seqs):
        for hv in range(HV):
            h = hv // (HV // H)
            S = initial_state[n, hv].clone() if initial_state is not None else torch.zeros(K, V, dtype=F64)
            for t in range(start, end):
                qt, kt = q[b, t, h], k[b, t, h]
                if use_qk_l2norm:
                    qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6)
                    kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
                bt = beta[b, t, hv]
                S = (torch.eye(K, dtype=F64) - bt * torch.outer(kt, kt)) @ torch.diag(g[b, t, hv].exp()) @ S
                S = S + bt * torch.outer(kt, v[b, t, hv])
                o[b, t, hv] = scale * S.T @ qt
            finals[n, hv] = S
    return o, finals


def kda_inputs(B, T, H, G, K, V):
    HV = H * G
    q = torch.randn(B, T, H, K, dtype=F64)
    k = torch.randn(B, T, H, K, dtype=F64) / math.sqrt(K)
    v = torch.randn(B, T, HV, V, dtype=F64)
    g = -torch.rand(B, T, HV, K, dtype=F64) * 2
    beta = torch.rand(B, T, HV, dtype=F64)
    return q, k, v, g, beta


@given(seed=SEEDS, B=st.integers(1, 2), T=st.integers(1, 9), H=st.integers(1, 2), G=st.integers(1, 2),
       K=st.sampled_from([2, 4, 8]), V=st.sampled_from([2, 4, 8]), l2=st.booleans(), with_state=st.booleans())
def test_chunk_kda_recurrence_matches_householder_form(seed, B, T, H, G, K, V, l2, with_state):
    torch.manual_seed(seed)
    q, k, v, g, beta = kda_inputs(B, T, H, G, K, V)
    h0 = torch.randn(B, H * G, K, V, dtype=F64) if with_state else None
    o, final = R.chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=l2)
    o_ref, final_ref = kda_householder(q, k, v, g, beta, 0.3, h0, l2, None)
    assert_close(o, o_ref, F64, "o")
    assert_close(final, final_ref, F64, "final_state")


@given(seed=SEEDS, lens=seqlens(max_len=7), l2=st.booleans())
def test_chunk_kda_recurrence_varlen_matches_householder_form(seed, lens, l2):
    torch.manual_seed(seed)
    T = sum(lens)
    q, k, v, g, beta = kda_inputs(1, T, 2, 2, 4, 4)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    h0 = torch.randn(len(lens), 4, 4, 4, dtype=F64)
    o, final = R.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                               cu_seqlens=cu)
    o_ref, final_ref = kda_householder(q, k, v, g, beta, 4 ** -0.5, h0, l2, cu)
    assert_close(o, o_ref, F64, "o")
    assert_close(final, final_ref, F64, "final_state")


def test_kda_state_passing_splits_a_sequence():
    q, k, v, g, beta = kda_inputs(1, 12, 2, 1, 8, 8)
    o, final = R.chunk_kda(q, k, v, g, beta, output_final_state=True)
    o1, mid = R.chunk_kda(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], output_final_state=True)
    o2, final2 = R.chunk_kda(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], initial_state=mid,
                                 output_final_state=True)
    assert_close(torch.cat([o1, o2], 1), o, F64, "o")
    assert_close(final2, final, F64, "final_state")


def test_kda_gate_is_fla06s_formula():
    """reference.kda_gate against the formulas written out element by element: -exp(A_log)
    log(1 + exp(x)) (x itself above 20) and lower_bound / (1 + exp(-exp(A_log) x)), x = g + dt_bias."""
    torch.manual_seed(0)
    g = torch.randn(2, 5, 3, 4, dtype=torch.float64) * 15
    A_log, dt_bias = torch.randn(3, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    x = g + dt_bias.view(3, 4)
    a = A_log.exp().view(3, 1)
    soft = torch.tensor([[v if v > 20 else math.log1p(math.exp(v)) for v in row] for row in x.reshape(-1, 4).tolist()],
                        dtype=torch.float64).view_as(x)
    assert torch.allclose(R.kda_gate(g, A_log, dt_bias), -a * soft, rtol=1e-13, atol=0)
    bounded = -5.0 / (1 + torch.exp(-a * x))
    assert torch.allclose(R.kda_gate(g, A_log, dt_bias, lower_bound=-5.0), bounded, rtol=1e-13, atol=0)
    assert (R.kda_gate(g, A_log, dt_bias, lower_bound=-5.0) >= -5.0).all()  # saturates to it in floating point


def test_kda_strong_decay_stays_finite():
    q, k, v, g, beta = kda_inputs(1, 64, 1, 1, 8, 8)
    g = torch.full_like(g, -20.0)
    o, final = R.chunk_kda(q.float(), k.float(), v.float(), g.float(), beta.float(), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()


# ---- LI --------------------------------------------------------------------------------------

def brute_force_indexer(q, k, w, cu_q, cu_k, topk):
    T = q.shape[0]
    indices = torch.full((T, topk), -1, dtype=torch.int32)
    scores = torch.full((T, topk), -math.inf, dtype=F64)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for n in range(len(bq) - 1):
        Lq, Lk = bq[n + 1] - bq[n], bk[n + 1] - bk[n]
        for i in range(Lq):
            t = bq[n] + i
            cands = []
            for j in range(min(Lk, i + Lk - Lq + 1)):
                s = bk[n] + j
                score = sum(float(w[t, h]) * max(0.0, float(q[t, h] @ k[s])) for h in range(q.shape[1]))
                cands.append((-score, s))
            for r, (neg, s) in enumerate(sorted(cands)[:topk]):
                indices[t, r] = s
                scores[t, r] = -neg
    return indices, scores


@given(seed=SEEDS, lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4)), min_size=1, max_size=3),
       topk=st.integers(1, 12), Hi=st.integers(1, 3))
def test_lightning_indexer_matches_brute_force(seed, lens, topk, Hi):
    torch.manual_seed(seed)
    q_lens = [a for a, _ in lens]
    k_lens = [a + extra for a, extra in lens]  # keys may include a prefix before the queries
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), Hi, 5, dtype=F64)
    k = torch.randn(sum(k_lens), 5, dtype=F64)
    w = torch.randn(sum(q_lens), Hi, dtype=F64)
    idx, sc = R.lightning_indexer(q, k, w, cu_q, cu_k, topk)
    idx_ref, sc_ref = brute_force_indexer(q, k, w, cu_q, cu_k, topk)
    assert torch.equal(idx, idx_ref)
    valid = idx_ref >= 0
    assert torch.isinf(sc[~valid]).all()
    assert_close(sc[valid], sc_ref[valid], F64, "scores")


def test_lightning_indexer_ties_go_to_the_lower_index():
    q = torch.ones(1, 1, 2, dtype=F64)
    k = torch.ones(6, 2, dtype=F64)
    w = torch.ones(1, 1, dtype=F64)
    idx, _ = R.lightning_indexer(q, k, w, torch.tensor([0, 1]), torch.tensor([0, 6]), 3)
    assert idx.tolist() == [[0, 1, 2]]


@given(seed=SEEDS, T=st.integers(1, 6), Tk=st.integers(1, 8), topk=st.integers(1, 6))
def test_lightning_indexer_bwd_matches_autograd(seed, T, Tk, topk):
    torch.manual_seed(seed)
    q = torch.randn(T, 2, 4, dtype=F64, requires_grad=True)
    k = torch.randn(Tk, 4, dtype=F64, requires_grad=True)
    w = torch.randn(T, 2, dtype=F64, requires_grad=True)
    idx = torch.randint(-1, Tk, (T, topk), dtype=torch.int32)
    g = torch.randn(T, topk, dtype=F64)
    scores = R.indexer_scores(q, k, w).gather(1, idx.clamp(min=0).long())
    (torch.where(idx >= 0, scores * g, torch.zeros_like(scores))).sum().backward()
    dq, dk, dw = R.lightning_indexer_bwd(q.detach(), k.detach(), w.detach(), idx, g)
    assert_close(dq, q.grad, F64, "dq")
    assert_close(dk, k.grad, F64, "dk")
    assert_close(dw, w.grad, F64, "dw")


def test_indexer_kl_loss_matches_kl_div():
    T, topk = 5, 7
    idx = torch.randint(0, 20, (T, topk), dtype=torch.int32)
    idx[1, 3:] = -1
    p = torch.rand(T, topk, dtype=F64)
    s = torch.randn(T, topk, dtype=F64)
    loss = indexer_kl_loss(p, s, idx)
    expected = 0.0
    for t in range(T):
        m = idx[t] >= 0
        pt = p[t][m] / p[t][m].sum()
        expected += torch.nn.functional.kl_div(torch.log_softmax(s[t][m], 0), pt, reduction="sum").item()
    assert math.isclose(loss.item(), expected / T, rel_tol=1e-12)
    assert indexer_kl_loss(torch.softmax(s, -1), s, torch.zeros_like(idx)).abs().item() < 1e-12


# ---- SFA / SFAG ------------------------------------------------------------------------------

def sfa_inputs(T, Tk, H, Hkv, D, dv, topk, empty_rows=True):
    q = torch.randn(T, H, D, dtype=F64)
    kv = torch.randn(Tk, Hkv, D, dtype=F64)
    idx = torch.stack([torch.stack([torch.randperm(Tk)[:topk] for _ in range(Hkv)]) for _ in range(T)]).to(torch.int32)
    drop = torch.rand(T, Hkv, topk) < 0.3
    if not empty_rows:
        drop[..., 0] = False  # every row keeps a key
    idx[drop] = -1
    if empty_rows and T > 1:
        idx[0] = -1  # a row with no key
    gate = torch.randn(T, H, dv, dtype=F64)
    return q, kv, idx, gate


def dense_masked_attention(q, kv, idx, scale, dv, gate):
    T, H, _ = q.shape
    Tk, Hkv, _ = kv.shape
    G = H // Hkv
    o = torch.zeros(T, H, dv, dtype=F64)
    lse = torch.full((T, H), -math.inf, dtype=F64)
    p = torch.zeros(T, Hkv, Tk, dtype=F64)
    for h in range(H):
        a = h // G
        mask = torch.zeros(T, Tk, dtype=torch.bool)
        for t in range(T):
            for s in idx[t, a].tolist():
                if s >= 0:
                    mask[t, s] = True
        logits = (q[:, h] @ kv[:, a].T * scale).masked_fill(~mask, -math.inf)
        lse[:, h] = torch.logsumexp(logits, -1)
        probs = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)
        o[:, h] = probs @ kv[:, a, :dv]
        p[:, a] += probs
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return o, lse, p


@given(seed=SEEDS, T=st.integers(1, 5), Tk=st.integers(2, 9), Hkv=st.integers(1, 2), G=st.integers(1, 3),
       gated=st.booleans(), data=st.data())
def test_sparse_attn_fwd_matches_dense_masked_attention(seed, T, Tk, Hkv, G, gated, data):
    torch.manual_seed(seed)
    topk = data.draw(st.integers(1, Tk))
    q, kv, idx, gate = sfa_inputs(T, Tk, Hkv * G, Hkv, 6, 4, topk)
    gate = gate if gated else None
    o, lse, p = R.sparse_attention(q, kv, idx, 0.4, 4, gate, return_p=True)
    o_ref, lse_ref, p_dense = dense_masked_attention(q, kv, idx, 0.4, 4, gate)
    assert_close(o, o_ref, F64, "o")
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse[finite], lse_ref[finite], F64, "lse")
    p_ref = p_dense.gather(2, idx.clamp(min=0).long()) * (idx >= 0)
    assert_close(p, p_ref, F64, "p")


@given(seed=SEEDS, T=st.integers(1, 5), Tk=st.integers(2, 9), Hkv=st.integers(1, 2), G=st.integers(1, 3),
       gated=st.booleans(), data=st.data())
def test_sparse_attn_bwd_matches_autograd(seed, T, Tk, Hkv, G, gated, data):
    torch.manual_seed(seed)
    topk = data.draw(st.integers(1, Tk))
    q, kv, idx, gate = sfa_inputs(T, Tk, Hkv * G, Hkv, 6, 4, topk, empty_rows=False)
    q.requires_grad_()
    kv.requires_grad_()
    gate = gate.requires_grad_() if gated else None
    o, lse, _ = R.sparse_attention(q, kv, idx, 0.4, 4, gate)
    do = torch.randn_like(o)
    o.backward(do)
    dq, dkv, dgate = R.sparse_attn_bwd(do, q.detach(), kv.detach(), idx, lse.detach(), 0.4, 4,
                                       None if gate is None else gate.detach())
    assert_close(dq, q.grad, F64, "dq")
    assert_close(dkv, kv.grad, F64, "dkv")
    if gated:
        assert_close(dgate, gate.grad, F64, "dgate")


def test_sparse_attn_row_without_keys_gives_zero():
    q, kv, idx, gate = sfa_inputs(3, 5, 2, 1, 6, 4, 3)
    idx[1] = -1
    o, lse, _ = R.sparse_attention(q, kv, idx, 0.5, 4, gate)
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()
    dq, dkv, dgate = R.sparse_attn_bwd(torch.randn_like(o), q, kv, idx, lse, 0.5, 4, gate)
    assert (dq[1] == 0).all() and (dgate[1] == 0).all()


# ---- MoE -------------------------------------------------------------------------------------

def loop_route(logits, bias, k, score_fn, renorm, scale):
    T, E = logits.shape
    weights = torch.zeros(T, k, dtype=F64)
    ids = torch.zeros(T, k, dtype=torch.int32)
    for t in range(T):
        x = logits[t].tolist()
        if score_fn == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in x]
        else:
            m = max(x)
            z = sum(math.exp(v - m) for v in x)
            s = [math.exp(v - m) / z for v in x]
        key = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        key = [-math.inf if math.isnan(v) else v for v in key]
        chosen = sorted(range(E), key=lambda e: (-key[e], e))[:k]
        total = sum(s[e] for e in chosen)
        for j, e in enumerate(chosen):
            ids[t, j] = e
            weights[t, j] = scale * (s[e] / (total + 1e-20) if renorm else s[e])
    return weights, ids


@given(seed=SEEDS, case=routing_case(), score_fn=st.sampled_from(["sigmoid", "softmax"]), renorm=st.booleans(),
       with_bias=st.booleans(), ties=st.booleans())
def test_moe_route_matches_loop(seed, case, score_fn, renorm, with_bias, ties):
    torch.manual_seed(seed)
    T, E, k = case
    logits = torch.randint(-2, 3, (T, E)).to(F64) if ties else torch.randn(T, E, dtype=F64)
    bias = torch.randn(E, dtype=F64) * 0.1 if with_bias else None
    w, ids = R.moe_route(logits, k, bias, score_fn, renorm, 2.5)
    w_ref, ids_ref = loop_route(logits, bias, k, score_fn, renorm, 2.5)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref, F64, "weights")


def loop_permute(x, ids, E, weights, capacity, policy, fallback):
    """Expert queues filled copy by copy, as the policy describes."""
    T, k = ids.shape
    queues = [[] for _ in range(E)]
    for c in range(T * k):
        e = int(ids.view(-1)[c])
        if 0 <= e < E:
            queues[e].append(c)
    overflow = []
    if capacity is not None:
        for e in range(E):
            if policy != "drop_position":
                queues[e].sort(key=lambda c: (-float(weights.view(-1)[c]), c))
            overflow += queues[e][capacity:]
            queues[e] = queues[e][:capacity]
    if capacity is not None and policy == "reroute":
        next_candidate = {}
        for c in sorted(overflow):
            t = c // k
            pos = next_candidate.get(t, 0)
            row = fallback[t].tolist()
            while pos < len(row):
                e = row[pos]
                pos += 1
                if 0 <= e < E and len(queues[e]) < capacity:
                    queues[e].append(c)
                    break
            next_candidate[t] = pos
    rows = [c for q in queues for c in q]
    M = T * k if capacity is None else min(T * k, E * capacity)
    row_map = torch.tensor(rows + [-1] * (M - len(rows)), dtype=torch.int32)
    offs = torch.tensor([len(q) for q in queues]).cumsum(0).to(torch.int32)
    x_sorted = torch.stack([x[c // k] if c >= 0 else torch.zeros_like(x[0]) for c in row_map.tolist()]) if M else \
        x.new_zeros(0, x.shape[1])
    return x_sorted, row_map, offs


@given(seed=SEEDS, case=routing_case(max_tokens=30, max_experts=12), policy=st.sampled_from(["drop_probs", "drop_position",
                                                                               "reroute"]),
       capacity=st.one_of(st.none(), st.integers(0, 6)), data=st.data())
def test_moe_permute_matches_queue_loop(seed, case, policy, capacity, data):
    torch.manual_seed(seed)
    T, E, k = case
    logits = torch.randn(T, E, dtype=F64)
    w, ids = R.moe_route(logits, k)
    ranked = torch.sort(logits, dim=-1, descending=True, stable=True).indices.to(torch.int32)
    fallback = ranked[:, k:] if E > k else torch.full((T, 1), -1, dtype=torch.int32)
    x = torch.randn(T, 3, dtype=F64)
    out = R.moe_permute(x, ids, E, w, capacity, policy=policy, fallback_ids=fallback)
    ref = loop_permute(x, ids, E, w, capacity, policy, fallback)
    assert torch.equal(out[1], ref[1]), (out[1], ref[1])
    assert torch.equal(out[2], ref[2])
    assert torch.equal(out[0], ref[0])


@given(seed=SEEDS, case=routing_case(max_tokens=20, max_experts=10), capacity=st.one_of(st.none(), st.integers(0, 4)))
def test_moe_unpermute_matches_loop(seed, case, capacity):
    torch.manual_seed(seed)
    T, E, k = case
    w, ids = R.moe_route(torch.randn(T, E, dtype=F64), k)
    x = torch.randn(T, 4, dtype=F64)
    xs, row_map, _ = R.moe_permute(x, ids, E, w, capacity, policy="drop_probs")
    ys = torch.randn_like(xs)
    y = R.moe_unpermute(ys, row_map, w, T)
    y_ref = torch.zeros(T, 4, dtype=F64)
    for m, c in enumerate(row_map.tolist()):
        if c >= 0:
            y_ref[c // k] += w.view(-1)[c] * ys[m]
    assert_close(y, y_ref, F64, "y")
    if capacity is None:  # nothing dropped: combining the permuted x with unit weights gives k * x
        assert_close(R.moe_unpermute(xs, row_map, torch.ones_like(w), T), k * x, F64, "roundtrip")


@given(seed=SEEDS, counts=expert_counts(), K=st.integers(1, 12), N=st.integers(1, 12), tail=st.integers(0, 5))
def test_grouped_mm_matches_one_hot_dense(seed, counts, K, N, tail):
    torch.manual_seed(seed)
    E = len(counts)
    M = sum(counts) + tail
    a = torch.randn(M, K, dtype=F64)
    b = torch.randn(E, K, N, dtype=F64)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    owner = torch.cat([owner, torch.full((tail,), -1)])
    dense = sum((owner == e).to(F64)[:, None] * (a @ b[e]) for e in range(E))
    assert_close(R.grouped_mm(a, b, offs), dense, F64, "out")
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)  # the same values as a transposed view
    assert_close(R.grouped_mm(a, bt, offs), dense, F64, "out (transposed b)")


@given(seed=SEEDS, counts=expert_counts(), K=st.integers(1, 12), N=st.integers(1, 12))
def test_grouped_mm_wgrad_matches_autograd(seed, counts, K, N):
    torch.manual_seed(seed)
    E = len(counts)
    a = torch.randn(sum(counts), K, dtype=F64)
    b = torch.randn(E, K, N, dtype=F64, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(sum(counts), N, dtype=F64)
    R.grouped_mm(a, b, offs).backward(dy)
    assert_close(R.grouped_mm_wgrad(a, dy, offs), b.grad, F64, "wgrad")


def test_expert_capacity():
    assert expert_capacity(100, 2, 8, 1.0) == 25
    assert expert_capacity(100, 2, 8, 1.25) == 32
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 1, 2, 0.0)


@pytest.mark.parametrize("op", ops.__all__)
def test_each_reference_op_has_the_ops_name_and_signature(op):
    """kda_dsa_ops.reference.<op> takes kda_dsa_ops.<op>'s named parameters, in order, with its
    defaults (a model switches between kernels and references by switching modules)."""
    ours = [p for p in inspect.signature(getattr(ops, op)).parameters.values() if p.kind != p.VAR_KEYWORD]
    theirs = [p for p in inspect.signature(getattr(R, op)).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert [(p.name, p.default) for p in theirs] == [(p.name, p.default) for p in ours]
