"""Runs the cross-entropy rows CUDA kernel (cross_entropy_rows_) on small awkward shapes, for
compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_loss.py
    compute-sanitizer --tool racecheck python tools/sanitize_loss.py
"""

import torch

import kda_dsa_ops as K


def main():
    torch.manual_seed(0)
    # vector rows, element rows (V not a multiple of the vector), one class, ignored rows and a
    # label out of range (value checks off: treated as ignored, nothing read outside the row)
    for N, V, dtype in ((3, 4096, torch.bfloat16), (4, 1003, torch.float16), (2, 1, torch.float32),
                        (5, 20000, torch.float32)):
        x = torch.randn(N, V, device="cuda", dtype=dtype)
        labels = torch.randint(0, V, (N,), device="cuda")
        labels[0] = -100
        if N > 2:
            labels[2] = V + 5
        K.cross_entropy_rows_(x, labels, -100, 0.5, True)
        K.cross_entropy_rows_(x, labels, -100, 1.0, False)
    torch.cuda.synchronize()
    print("sanitize_loss: done")


if __name__ == "__main__":
    main()
