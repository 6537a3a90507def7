"""Per-kernel device time of one chunk_kda forward and forward+backward (torch.profiler) at each
internal precision (matmul_precision "highest" and "medium"), to see where the time goes:
python tools/profile_kda.py [--ncu] [B T H D [softplus | bounded]]; the log-decay is fla's usual
logsigmoid(x + 2) (softplus) or GLM-5.3's bounded gate's, -5 sigmoid(x). With --ncu, one
"medium" step between cudaProfilerStart and Stop for `ncu --profile-from-start off`."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import kda_dsa_ops as K


def main():
    ncu = "--ncu" in sys.argv
    argv = [a for a in sys.argv if a != "--ncu"]
    B, T, H, D = (int(x) for x in argv[1:5]) if len(argv) >= 5 else (2, 8192, 32, 128)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    x = torch.randn(B, T, H, D, device="cuda")
    bounded = len(argv) >= 6 and argv[5] == "bounded"
    g = (-5 * torch.sigmoid(x) if bounded else torch.nn.functional.logsigmoid(x + 2)).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ins = (q, k, v, g, beta)

    for precision in ("medium",) if ncu else ("highest", "medium"):
        def step(precision=precision):
            o, _ = K.chunk_kda(*ins, use_qk_l2norm_in_kernel=True, matmul_precision=precision)
            torch.autograd.grad(o, ins, torch.ones_like(o))

        step()
        torch.cuda.synchronize()
        if ncu:
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"matmul_precision={precision!r}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
