"""Runs the hyper-connection CUDA kernels (hc_mix forward and backward) on small awkward shapes,
for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_hc.py
    compute-sanitizer --tool racecheck python tools/sanitize_hc.py
"""

import torch

import kda_dsa_ops as K


def main():
    torch.manual_seed(0)
    dev = "cuda"
    # (T, n, m, D, with z and b, dtype): the 4-stream and 8-stream kernels, vector and element
    # rows (D not a multiple of the step), one token, a token count past one block's reach
    for T, n, m, D, add, dtype in ((3, 4, 1, 4096, False, torch.bfloat16), (5, 4, 4, 4096, True, torch.bfloat16),
                                   (2, 8, 8, 37, True, torch.float16), (1, 3, 5, 1, True, torch.float32),
                                   (70, 6, 1, 520, False, torch.float32)):
        x = torch.randn(T, n, D, device=dev, dtype=dtype, requires_grad=True)
        a = torch.randn(T, m, n, device=dev, requires_grad=True)
        z = torch.randn(T, D, device=dev, dtype=dtype, requires_grad=True) if add else None
        b = torch.randn(T, m, device=dev, requires_grad=True) if add else None
        y = K.hc_mix(x, a, z, b)
        torch.autograd.grad(y.float().sum(), [t for t in (x, a, z, b) if t is not None])
    torch.cuda.synchronize()
    print("sanitize_hc: done")


if __name__ == "__main__":
    main()
