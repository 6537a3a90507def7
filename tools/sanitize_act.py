"""Runs the fused-activation CUDA kernels (short_conv and swiglu, forward and backward) on small
awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_act.py
    compute-sanitizer --tool racecheck python tools/sanitize_act.py
"""

import torch

import kda_dsa_ops as K


def main():
    torch.manual_seed(0)
    dev = "cuda"
    # (sequence lengths, C, W, halo, dtype): the 4- and 8-tap kernels, vector and element rows,
    # sequences shorter than the taps, a halo longer than the batch, a row chunk boundary
    for lens, C, W, halo, dtype in (([3, 70], 1024, 4, True, torch.bfloat16), ([1], 37, 4, True, torch.float16),
                                    ([2, 5, 1], 24, 8, False, torch.float32), ([130], 8, 5, True, torch.bfloat16),
                                    ([4], 2049, 1, False, torch.float32)):
        T = sum(lens)
        cu = torch.tensor([0] + lens).cumsum(0).to(dev)
        pos = torch.arange(T, device=dev) - torch.repeat_interleave(cu[:-1], torch.tensor(lens, device=dev))
        x = torch.randn(T, C, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(C, W, device=dev, requires_grad=True)
        h = torch.randn(W - 1, C, device=dev, dtype=dtype, requires_grad=True) if halo else None
        y = K.short_conv(x, w, pos, h)
        torch.autograd.grad(y.float().sum(), [t for t in (x, w, h) if t is not None])
    for shape, limit, dtype in (((5, 4096), 10.0, torch.bfloat16), ((3, 2, 14), 0.0, torch.float16),
                                ((1, 2), 1.0, torch.float32)):
        gu = torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
        torch.autograd.grad(K.swiglu(gu, limit).float().sum(), [gu])
    torch.cuda.synchronize()
    print("sanitize_act: done")


if __name__ == "__main__":
    main()
