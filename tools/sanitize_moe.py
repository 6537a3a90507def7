"""Runs every MoE CUDA kernel once on small awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_moe.py
    compute-sanitizer --tool racecheck python tools/sanitize_moe.py
"""

import torch

import kda_dsa_ops as K


def main():
    torch.manual_seed(0)
    dev = "cuda"
    T, E, k = 37, 13, 3
    logits = torch.randn(T, E, device=dev, requires_grad=True)
    w, ids = K.moe_route(logits, k, torch.randn(E, device=dev))
    torch.autograd.grad(w.sum(), logits)
    for dtype, E_ in ((torch.float32, 64), (torch.bfloat16, 96)):  # rows copied in bulk, warps walking many tokens
        K.moe_route(torch.randn(40000, E_, device=dev, dtype=dtype), 8, torch.randn(E_, device=dev))
    for groups, topk_groups in ((8, 4), (64, 3)):  # group-limited routing (DeepSeek-V3: 256 experts, 8 groups)
        K.moe_route(torch.randn(4000, 256, device=dev, dtype=torch.bfloat16), 8, torch.randn(256, device=dev),
                    n_group=groups, topk_group=topk_groups)
    fallback = torch.topk(torch.randn(T, E, device=dev), 6, dim=-1).indices.int()
    x = torch.randn(T, 40, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for capacity, policy in ((None, "drop_probs"), (5, "drop_probs"), (5, "drop_position"), (4, "reroute")):
        xs, row_map, offs = K.moe_permute(x, ids, E, w, capacity, policy=policy, fallback_ids=fallback)
        y = K.moe_unpermute(xs, row_map, w, T)
        torch.autograd.grad(y.float().sum(), (x, w), allow_unused=True)
    counts = [0, 1, 127, 128, 129, 5, 0, 300]
    offs = torch.tensor(counts, device=dev).cumsum(0).int()
    M = sum(counts) + 3
    for K_, N in ((72, 264), (520, 128)):
        a = torch.randn(M, K_, device=dev, dtype=torch.bfloat16)
        for b in (torch.randn(len(counts), K_, N, device=dev, dtype=torch.bfloat16),
                  torch.randn(len(counts), N, K_, device=dev, dtype=torch.bfloat16).transpose(1, 2)):
            out = K.grouped_mm(a, b, offs)
            K.grouped_mm_wgrad(a, out, offs)
    torch.cuda.synchronize()
    print("sanitize_moe: all kernels ran")


if __name__ == "__main__":
    main()
