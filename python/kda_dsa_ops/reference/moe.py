"""Pure-PyTorch definitions of the MoE ops: routing, permutation and the grouped GEMM.

These are the ground truth for the C++ and CUDA kernels. They run in float64 when given
float64 inputs and otherwise compute in float32 and return the op's output dtype.
"""

from __future__ import annotations

import math

import torch

from .._dtypes import accumulation_dtype
from ..contracts import permute_capacity

POLICIES = ("drop_probs", "drop_position", "reroute")
SCORE_FNS = ("sigmoid", "softmax")
RENORM_EPS = 1e-20


def route_scores(logits: torch.Tensor, score_fn: str) -> torch.Tensor:
    """Routing scores in the accumulation dtype (fp32, or fp64 for fp64 logits)."""
    x = logits.to(accumulation_dtype(logits))
    if score_fn == "sigmoid":
        return torch.sigmoid(x)
    if score_fn == "softmax":
        return torch.softmax(x, dim=-1)
    raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {score_fn!r}")


def group_limited_mask(key: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Experts a token may choose under group-limited routing, [T, E] bool: the E experts form
    n_group equal groups of consecutive ids; a group's score is the sum of its two largest keys;
    the topk_group best groups (ties to the lower group) are open, every other expert is closed."""
    T, E = key.shape
    group_scores = key.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    open_groups = torch.zeros(T, n_group, dtype=torch.bool, device=key.device).scatter_(1, groups, True)
    return open_groups.repeat_interleave(E // n_group, dim=1)


def moe_route(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None, score_fn: str = "sigmoid",
              renorm: bool = True, scale: float = 1.0, n_group: int = 1,
              topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert selection.

    scores = score_fn(logits); experts are chosen by scores + bias (the bias selects, it never
    weights); ties go to the lower expert index; NaN keys rank last. With n_group > 1 only the
    experts of the topk_group groups with the largest top-2 key sums may be chosen
    (group_limited_mask; DeepSeek-V3's routing). weights = scores of the chosen experts, divided
    by their sum (+1e-20) when renorm, times scale.
    Returns (weights [T,k] fp32 (fp64 for fp64 logits), ids [T,k] int32), ids in rank order.
    """
    scores = route_scores(logits, score_fn)
    key = scores if bias is None else scores + bias.to(scores.dtype)
    key = torch.nan_to_num(key, nan=-math.inf)
    if n_group > 1:
        key = key.masked_fill(~group_limited_mask(key, n_group, topk_group), -math.inf)
    ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(-1, ids)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    return weights * scale, ids.to(torch.int32)


def _rank_order(ids: torch.Tensor, weights: torch.Tensor | None, num_experts: int,
                by_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy indices sorted by (expert, priority), and their experts (invalid ids become E, last).

    Priority is the copy index, or (weight descending, copy index) when by_weight.
    """
    experts = ids.reshape(-1).long()
    experts = torch.where((experts >= 0) & (experts < num_experts), experts, torch.full_like(experts, num_experts))
    order = torch.arange(experts.numel(), device=ids.device)
    if by_weight:
        order = torch.sort(-weights.reshape(-1).to(torch.float64), stable=True).indices
    order = order[torch.sort(experts[order], stable=True).indices]
    return order, experts[order]


def moe_permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int, weights: torch.Tensor | None = None,
                capacity: int | None = None, capacity_factor: float | None = None, policy: str = "drop_probs",
                fallback_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token copies by expert.

    Copy c = t*k + j goes to expert ids[t, j]. Without a capacity every copy is kept and each
    expert's rows are in copy order. With a capacity C each expert keeps C copies:
      drop_position  the earliest copies;
      drop_probs     the highest-weight copies (ties: earlier copy first);
      reroute        as drop_probs, then each overflowing copy, in copy order, moves to the first
                     expert of fallback_ids[t] (scanned from where the token's previous
                     rerouted copy stopped) that still has room, or is dropped.
    Within an expert: kept copies in priority order, then rerouted copies in the order they came.
    Returns x_sorted [M, D] (M = T*k, or min(T*k, E*C) with a capacity; rows past offs[-1] are
    zero), row_map [M] int32 (the copy index of each row, -1 past offs[-1]) and offs [E] int32
    (cumulative row counts). capacity_factor: capacity = ceil(cf * T * k / E), as the op.
    """
    capacity = permute_capacity(ids, num_experts, capacity, capacity_factor)
    T, k = ids.shape
    n = T * k
    E = num_experts
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    by_weight = capacity is not None and policy != "drop_position"
    if by_weight and weights is None:
        raise ValueError(f"policy {policy!r} with a capacity needs weights")
    if capacity is not None and policy == "reroute" and fallback_ids is None:
        raise ValueError("policy 'reroute' needs fallback_ids")
    order, experts = _rank_order(ids, weights, E, by_weight)
    valid = experts < E
    counts = torch.bincount(experts[valid], minlength=E)
    seg_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=ids.device) - seg_start[experts.clamp(max=E - 1)]
    keep = valid if capacity is None else valid & (rank < capacity)
    segments = [order[keep & (experts == e)].tolist() for e in range(E)]
    if capacity is not None and policy == "reroute":
        room = [capacity - len(s) for s in segments]
        overflow = sorted(order[valid & ~keep].tolist())
        fb = fallback_ids.tolist()
        cursor_token, cursor = -1, 0
        for c in overflow:
            t = c // k
            if t != cursor_token:
                cursor_token, cursor = t, 0
            while cursor < len(fb[t]):
                e = fb[t][cursor]
                cursor += 1
                if 0 <= e < E and room[e] > 0:
                    room[e] -= 1
                    segments[e].append(c)
                    break
    M = n if capacity is None else min(n, E * capacity)
    row_map = torch.full((M,), -1, dtype=torch.int32)
    flat = [c for s in segments for c in s]
    row_map[: len(flat)] = torch.tensor(flat, dtype=torch.int32)
    offs = torch.tensor([len(s) for s in segments], dtype=torch.int64).cumsum(0).to(torch.int32)
    row_map = row_map.to(ids.device)
    x_sorted = torch.zeros(M, x.shape[1], dtype=x.dtype, device=x.device)
    used = row_map >= 0
    x_sorted[used] = x[row_map[used].long() // k]
    return x_sorted, row_map, offs.to(ids.device)


def moe_unpermute(y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * y_sorted[row of copy t*k+j]; dropped copies add nothing."""
    k = weights.shape[1]
    acc = accumulation_dtype(y_sorted)
    used = row_map >= 0
    copies = row_map[used].long()
    contrib = y_sorted[used].to(acc) * weights.reshape(-1)[copies].to(acc)[:, None]
    y = torch.zeros(num_tokens, y_sorted.shape[1], dtype=acc, device=y_sorted.device)
    y.index_add_(0, copies // k, contrib)
    return y.to(y_sorted.dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of expert e] = a[rows] @ b[e]; rows of expert e are [offs[e-1], offs[e]); rows
    past offs[-1] are zero. a [M,K], b [E,K,N] (any strides), offs [E] int32."""
    acc = accumulation_dtype(a)
    out = torch.zeros(a.shape[0], b.shape[2], dtype=acc, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].to(acc) @ b[e].to(acc)
        start = end
    return out.to(a.dtype)


def grouped_mm_wgrad(a: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ dy[rows of e]: the weight gradient of grouped_mm, [E, K, N]."""
    acc = accumulation_dtype(a)
    out = torch.zeros(offs.shape[0], a.shape[1], dy.shape[1], dtype=acc, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[e] = a[start:end].to(acc).T @ dy[start:end].to(acc)
        start = end
    return out.to(a.dtype)
