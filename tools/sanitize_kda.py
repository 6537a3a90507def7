"""Runs every KDA CUDA kernel (forward and backward) on small awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_kda.py
    compute-sanitizer --tool racecheck python tools/sanitize_kda.py
"""

import torch

import kda_dsa_ops as K


def main():
    torch.manual_seed(0)
    dev = "cuda"
    bf16, f16 = torch.bfloat16, torch.float16
    # The last two: fp16 inputs with g and beta in fp16 (the bf16 kernels' other load paths).
    for B, T, H, HV, Kd, V, lens, dtype, g_dtype in (
            (2, 70, 1, 2, 128, 128, None, bf16, torch.float32), (1, 203, 2, 2, 64, 40, [1, 64, 0, 65, 73], bf16, torch.float32),
            (1, 203, 1, 2, 64, 64, [1, 64, 0, 65, 73], bf16, torch.float32), (1, 5, 1, 1, 16, 8, None, bf16, torch.float32),
            (1, 150, 1, 1, 128, 64, [20, 130], f16, f16), (1, 9, 2, 4, 64, 128, None, f16, f16)):
        q = torch.randn(B, T, H, Kd, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(B, T, H, Kd, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(B, T, HV, V, device=dev, dtype=dtype, requires_grad=True)
        # strong decay on some channels in the second 16 steps of every chunk: the bf16 intra kernel's
        # three ways to a chunk's pairs (one factorisation where the chunk's decay is mild, by blocks
        # elsewhere: diagonal blocks factored where their own decay is mild, else one exp per pair)
        t = torch.arange(T, device=dev)
        strong = ((t % 64 // 16 == 1) & (t % 4 == 0))[None, :, None, None] & (torch.rand(Kd, device=dev) < 0.1)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, Kd, device=dev)) * torch.where(strong, 40.0, 1.0)
        g = g.to(g_dtype).requires_grad_()
        beta = torch.rand(B, T, HV, device=dev, dtype=g_dtype, requires_grad=True)
        cu = None if lens is None else torch.tensor([0] + lens, device=dev).cumsum(0).int()
        N = B if lens is None else len(lens)
        h0 = torch.randn(N, HV, Kd, V, device=dev, requires_grad=True)
        for precision in ("highest", "medium"):  # 3xTF32 and bf16-operand kernels
            o, ht = K.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, cu_seqlens=cu, matmul_precision=precision)
            torch.autograd.grad(o.float().sum() + ht.sum(), (q, k, v, g, beta, h0))
    # fla 0.6's in-kernel gate (softplus, then GLM-5.3's bounded one) and beta sigmoid on raw inputs
    q, k, v = (torch.randn(1, 150, 2, 128, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 150, 2, 128, device=dev, requires_grad=True)
    beta = torch.randn(1, 150, 2, device=dev, dtype=bf16, requires_grad=True)
    A_log = torch.randn(2, device=dev, requires_grad=True)
    dt_bias = torch.randn(2 * 128, device=dev, requires_grad=True)
    for lower_bound in (None, -5.0):
        o, _ = K.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(
            [0, 37, 150], device=dev, dtype=torch.int32), use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, safe_gate=lower_bound is not None, use_beta_sigmoid_in_kernel=True)
        torch.autograd.grad(o.float().sum(), (q, k, v, g, beta, A_log, dt_bias))
    torch.cuda.synchronize()
    print("sanitize_kda: done")


if __name__ == "__main__":
    main()
