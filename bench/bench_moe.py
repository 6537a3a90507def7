"""MoE benchmarks on the GPU (docs/benchmarks.md shapes).

grouped GEMM: E = 112 local experts, (K, N) = (3584, 6144) and (3072, 3584), 128 / 512 / 2048
tokens per expert, uniform and skewed (log-normal) loads; forward with b row-major [E,K,N] and
with b the transpose view of [E,N,K], and the weight gradient; each beside torch._grouped_mm.
routing and permutation are memory-bound: GB/s against the copy ceiling, beside the PyTorch
composition a user would otherwise write.

    python bench/bench_moe.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import math

import torch

import kda_dsa_ops as K
from common import Result, bench_ms, measure_ceilings, rel_rms, write_results

E_LOCAL = 112
GEMM_SHAPES = [(3584, 6144), (3072, 3584)]
TOKENS_PER_EXPERT = [128, 512, 2048]


def expert_counts(E: int, tokens_per_expert: int, skewed: bool) -> list[int]:
    if not skewed:
        return [tokens_per_expert] * E
    g = torch.Generator().manual_seed(E * 7919 + tokens_per_expert)
    w = torch.empty(E).log_normal_(0.0, 1.0, generator=g)
    share = w / w.sum() * E * tokens_per_expert
    counts = share.floor().long()
    rest = E * tokens_per_expert - int(counts.sum())
    counts[torch.argsort(share - counts, descending=True)[:rest]] += 1
    return counts.tolist()


def baseline_ms(fn) -> float:
    """Time of a baseline, or 0.0 (reported as missing) when the baseline rejects the case."""
    try:
        fn()
    except RuntimeError as err:
        print(f"  baseline unavailable: {str(err).splitlines()[0]}", flush=True)
        return 0.0
    return bench_ms(fn)


def bench_grouped_gemm(quick: bool) -> list[Result]:
    results = []
    shapes = GEMM_SHAPES[:1] if quick else GEMM_SHAPES
    for K_, N in shapes:
        b_kn = torch.randn(E_LOCAL, K_, N, device="cuda", dtype=torch.bfloat16)
        b_nk = torch.randn(E_LOCAL, N, K_, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for tpe in TOKENS_PER_EXPERT:
            for skewed in (False, True):
                counts = expert_counts(E_LOCAL, tpe, skewed)
                M = sum(counts)
                offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
                a = torch.randn(M, K_, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
                load = "skewed" if skewed else "uniform"
                shape = {"E": E_LOCAL, "K": K_, "N": N, "tokens_per_expert": tpe, "load": load,
                         "max_tokens": max(counts)}
                flops = 2.0 * M * K_ * N
                for layout, b in (("b[E,K,N]", b_kn), ("b=[E,N,K]^T", b_nk)):
                    theirs = baseline_ms(lambda: torch._grouped_mm(a, b, offs=offs))
                    err = rel_rms(K.grouped_mm(a, b, offs), torch._grouped_mm(a, b.contiguous(), offs=offs))
                    assert err < 8e-3, f"grouped_mm differs from torch._grouped_mm: rel RMS {err:.2e}"
                    ours = bench_ms(lambda: K.grouped_mm(a, b, offs))
                    results.append(Result("grouped_mm", f"fwd {layout} K{K_} N{N} {tpe}/e {load}", shape, ours,
                                          flops, 2.0 * (M * K_ + E_LOCAL * K_ * N + M * N), "torch._grouped_mm",
                                          theirs, {"rel_rms_vs_torch": err}))
                    print(f"{results[-1].name}: {ours:.3f} ms ({results[-1].tflops():.0f} TFLOP/s), torch {theirs:.3f} ms"
                          f" -> {results[-1].speedup():.2f}x", flush=True)
                err = rel_rms(K.grouped_mm_wgrad(a, dy, offs), torch._grouped_mm(a.t(), dy, offs=offs))
                assert err < 8e-3, f"grouped_mm_wgrad differs from torch._grouped_mm: rel RMS {err:.2e}"
                ours = bench_ms(lambda: K.grouped_mm_wgrad(a, dy, offs))
                theirs = baseline_ms(lambda: torch._grouped_mm(a.t(), dy, offs=offs))
                results.append(Result("grouped_mm", f"wgrad K{K_} N{N} {tpe}/e {load}", shape, ours, flops,
                                      2.0 * (M * K_ + M * N + E_LOCAL * K_ * N), "torch._grouped_mm", theirs,
                                      {"rel_rms_vs_torch": err}))
                print(f"{results[-1].name}: {ours:.3f} ms ({results[-1].tflops():.0f} TFLOP/s), torch {theirs:.3f} ms"
                      f" -> {results[-1].speedup():.2f}x", flush=True)
                del a, dy
        del b_kn, b_nk
        torch.cuda.empty_cache()
    return results


def torch_route(logits, bias, k):
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias, k, dim=-1).indices
    w = scores.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20), ids.int()


def torch_permute(x, ids, E):
    k = ids.shape[1]
    order = torch.argsort(ids.view(-1), stable=True)
    offs = torch.bincount(ids.view(-1), minlength=E).cumsum(0).int()
    return x[order // k], order.int(), offs


def torch_unpermute(ys, row_map, w, T):
    k = w.shape[1]
    contrib = ys.float() * w.view(-1)[row_map.long()][:, None]
    return torch.zeros(T, ys.shape[1], device=ys.device).index_add_(0, row_map.long() // k, contrib).to(ys.dtype)


def bench_routing(quick: bool) -> list[Result]:
    results = []
    T, E, k, D = 65536, 896, 16, 7168
    logits = torch.randn(T, E, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.01
    ms = bench_ms(lambda: K.moe_route(logits, k, bias))
    base = bench_ms(lambda: torch_route(logits, bias, k))
    results.append(Result("moe", f"route T{T} E{E} k{k} sigmoid", {"T": T, "E": E, "k": k}, ms, 0.0,
                          T * E * 4.0 + T * k * 8.0, "torch sigmoid+topk", base))
    logits.requires_grad_()
    w, _ = K.moe_route(logits, k, bias)
    g = torch.randn_like(w)
    ms = bench_ms(lambda: torch.autograd.grad(w, logits, g, retain_graph=True))
    # Sigmoid scores depend on their own logit only: the gradient is written whole (zero but at
    # the chosen experts) and only the chosen logits are read, with the weights' gradient and ids.
    results.append(Result("moe", f"route bwd T{T} E{E} k{k}", {"T": T, "E": E, "k": k}, ms, 0.0,
                          T * E * 4.0 + T * k * 16.0))
    del logits, w, g

    T, E, k = (4096, 128, 8) if quick else (16384, 128, 8)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w, ids = K.moe_route(torch.randn(T, E, device="cuda"), k)
    fallback = torch.topk(torch.randn(T, E, device="cuda"), 16, dim=-1).indices.int()
    row_bytes = D * 2
    moved = T * row_bytes + T * k * row_bytes  # read x once, write every copy
    shape = {"T": T, "E": E, "k": k, "D": D}
    ms = bench_ms(lambda: K.moe_permute(x, ids, E))
    base = bench_ms(lambda: torch_permute(x, ids, E))
    results.append(Result("moe", f"permute T{T} D{D} k{k}", shape, ms, 0.0, moved, "torch argsort+gather", base))
    for policy in ("drop_probs", "reroute"):
        ms = bench_ms(lambda: K.moe_permute(x, ids, E, w, capacity_factor=1.0, policy=policy, fallback_ids=fallback))
        cap = math.ceil(T * k / E)
        results.append(Result("moe", f"permute cf1.0 {policy} T{T} D{D} k{k}", dict(shape, capacity=cap), ms, 0.0,
                              T * row_bytes + min(T * k, E * cap) * row_bytes))
    xs, row_map, _ = K.moe_permute(x, ids, E)
    ms = bench_ms(lambda: K.moe_unpermute(xs, row_map, w, T))
    base = bench_ms(lambda: torch_unpermute(xs, row_map, w, T))
    results.append(Result("moe", f"unpermute T{T} D{D} k{k}", shape, ms, 0.0, moved, "torch index_add", base))
    for r in results:
        print(f"{r.name}: {r.ms:.3f} ms, {r.gbps():.0f} GB/s" + (f", baseline {r.baseline_ms:.3f} ms" if r.baseline_ms
                                                                  else ""), flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one GEMM shape and a smaller permutation")
    parser.add_argument("--out", default=None, help="directory for the JSON/markdown/PNG results")
    parser.add_argument("--only", choices=["gemm", "routing"], default=None, help="run one part")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    results = []
    if args.only in (None, "gemm"):
        results += bench_grouped_gemm(args.quick)
    if args.only in (None, "routing"):
        results += bench_routing(args.quick)
    print(write_results("moe", results, ceilings, args.out))


if __name__ == "__main__":
    main()
