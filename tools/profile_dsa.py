"""One sparse attention forward and backward at the docs/benchmarks.md shape (T 4096, Tk 8192, H 64, MLA
576/512, topk 2048, gated) with per-kernel device times (torch.profiler); to read a kernel's
hardware counters, run it under Nsight Compute, e.g.
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:mla_fwd \
        -c 1 python tools/profile_dsa.py
python tools/profile_dsa.py [H]"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import kda_dsa_ops as K


def main():
    H = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    T, Tk, Dqk, dv, topk = 4096, 8192, 576, 512, 2048
    torch.manual_seed(0)
    q = torch.randn(T, H, Dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(Tk, 1, Dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn(T, H, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.rand(T, Tk, device="cuda").topk(topk, dim=-1).indices.int()[:, None]
    do = torch.randn(T, H, dv, device="cuda", dtype=torch.bfloat16)

    def step():
        o, _, _ = K.sparse_attention(q, kv, idx, Dqk ** -0.5, dv, gate)
        torch.autograd.grad(o, (q, kv, gate), do)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
