"""Runs every DSA CUDA kernel (indexer forward/backward, sparse attention forward/backward with
atomic and deterministic dkv) on small awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_dsa.py
    compute-sanitizer --tool racecheck python tools/sanitize_dsa.py
"""

import torch

import kda_dsa_ops as K


def main():
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    # indexer: varlen with an empty sequence, a sequence longer than the candidate buffer (topk +
    # 1024 entries: cut back to top-k on the way)
    lens, klens = [1, 0, 1300, 37], [3, 2, 1300, 40]
    cu_q = torch.tensor([0] + lens, device=dev).cumsum(0).int()
    cu_k = torch.tensor([0] + klens, device=dev).cumsum(0).int()
    T, Tk = sum(lens), sum(klens)
    for Hi, Di, topk in ((5, 40, 7), (64, 128, 64)):
        q = torch.randn(T, Hi, Di, device=dev, dtype=bf16, requires_grad=True)
        k = torch.randn(Tk, Di, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(T, Hi, device=dev, dtype=bf16, requires_grad=True)
        idx, sc = K.lightning_indexer(q, k, w, cu_q, cu_k, topk)
        torch.autograd.grad(sc.masked_fill(idx < 0, 0).sum(), (q, k, w))
    # sparse attention: MLA with two head blocks, GLM-5.3's NoPE MLA with more keys than the
    # indexer's 2048 (its pooled selection's tail), MLA with 8 heads (8 queries packed in a block,
    # the last block short; with 16 heads and distinct keys per query, 4 packed by counting), MLA
    # with more items than SMs (the forward's blocks take several), GQA with padded head dims, GQA
    # with 8 and 16 heads a kv head (packed: the GQA forward's packed kernel and the mma.sync
    # backward; with p unpacked on the GQA forward's other kernel; 16: distinct keys; 8 at padded
    # and at full head dims, the last block one query); -1 entries, repeats
    for T, Tk, H, Hkv, D, dv, topk in ((3, 70, 128, 1, 576, 512, 100), (2, 90, 40, 1, 512, 512, 2063),
                                       (11, 50, 8, 1, 576, 512, 70), (11, 300, 16, 1, 576, 512, 70),
                                       (150, 200, 128, 1, 576, 512, 150), (5, 9, 6, 2, 40, 24, 33),
                                       (11, 60, 16, 2, 64, 48, 40), (17, 300, 32, 4, 128, 128, 70),
                                       (9, 300, 64, 4, 128, 128, 70)):
        q = torch.randn(T, H, D, device=dev, dtype=bf16, requires_grad=True)
        kv = torch.randn(Tk, Hkv, D, device=dev, dtype=bf16, requires_grad=True)
        gate = torch.randn(T, H, dv, device=dev, dtype=bf16, requires_grad=True)
        if H // Hkv == 16:
            idx = torch.rand(T, Hkv, Tk, device=dev).argsort(-1)[..., :topk].int()
        else:
            idx = torch.randint(-1, Tk, (T, Hkv, topk), device=dev, dtype=torch.int32)
        # MLA: the Hopper forward (with and without p) and backward (atomic and deterministic
        # dkv; 8, 40 and 128 heads), and the portable ones (with p unpacked, without it packed)
        for det, want_p, portable in ((False, True, False), (True, False, False), (False, True, True),
                                      (False, False, True)):
            K.set_portable_sfa(portable)
            o, _, _ = K.sparse_attention(q, kv, idx, 0.1, dv, gate, return_p=want_p, deterministic=det)
            torch.autograd.grad(o.float().sum(), (q, kv, gate))
    K.set_portable_sfa(False)
    torch.cuda.synchronize()
    print("sanitize_dsa: done")


if __name__ == "__main__":
    main()
