"""The LM head's linear cross-entropy (h W^T, then the mean CE over the tokens), forward+backward on
the GPU: ours (kda_dsa_ops.nn.chunked_linear_cross_entropy) beside cut-cross-entropy 25.1.1's
linear_cross_entropy and Liger's fused linear cross-entropy (each when installed: wheels in .whl/),
and the plain composition (the logits, then F.cross_entropy) as the anchor. Time and peak memory
above the inputs at the real vocabularies (GLM-5.3-Flash 154,880 x 4096, Kimi Linear 163,840 x
2304), bf16, the head frozen (LoRA: the gradient w.r.t. h only) and trained (h and W). Before
timing, each loss and gradient is compared with the composition's.
FLOPs: the products the step must do, 2 T V D forward and per gradient.

    python bench/bench_ce.py [--tokens 16384] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import Result, bench_ms, measure_ceilings, rel_rms, write_results
from kda_dsa_ops.nn.loss import chunked_linear_cross_entropy

CASES = [("glm-5.3-flash", 154880, 4096), ("kimi-linear-48b", 163840, 2304)]


def implementations() -> dict:
    """name: loss(h, W, labels) for the installed implementations, the anchor first."""
    impls = {"composition": lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y),
             "ours": chunked_linear_cross_entropy}
    try:
        from cut_cross_entropy import linear_cross_entropy

        impls["cut-cross-entropy"] = linear_cross_entropy
    except Exception as err:  # noqa: BLE001 (any import failure: not compared)
        print(f"  cut-cross-entropy unavailable: {err}", flush=True)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        impls["liger"] = lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
    except Exception as err:  # noqa: BLE001
        print(f"  liger-kernel unavailable: {err}", flush=True)
    return impls


def peak_above_inputs_mb(fn) -> float:
    """Peak allocated memory of one fn() above what was allocated before it, in MB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def bench_case(label: str, V: int, D: int, T: int, train_head: bool, impls: dict) -> list[Result]:
    g = torch.Generator(device="cuda").manual_seed(V + D)
    h = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16).requires_grad_(train_head)
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    wrt = (h, w) if train_head else (h,)

    def step(fn):
        loss = fn(h, w, y)
        return (loss, *torch.autograd.grad(loss, wrt))

    expected = step(impls["composition"])
    times, peaks, parity = {}, {}, {}
    for name, fn in impls.items():
        try:
            got = step(fn)
            parity[name] = {n: rel_rms(a, b) for n, a, b in zip(("loss", "dh", "dW"), got, expected)}
            peaks[name] = peak_above_inputs_mb(lambda fn=fn: step(fn))
            times[name] = bench_ms(lambda fn=fn: step(fn))
        except torch.OutOfMemoryError:
            print(f"  {label} {name}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        print(f"  {label} head {'trained' if train_head else 'frozen'} {name}: {times[name]:.2f} ms, "
              f"peak {peaks[name]:,.0f} MB above the inputs, vs composition {parity[name]}", flush=True)
    flops = 2 * T * V * D * (1 + len(wrt))
    shape = {"T": T, "V": V, "D": D, "head": "trained" if train_head else "frozen"}
    base = times.get("composition", 0.0)
    return [Result("ce", f"{label} head {shape['head']} {name}", shape, ms, flops, 0.0,
                   "composition" if base else "", base,
                   {"peak_mb": peaks[name], "composition_peak_mb": peaks.get("composition"), "parity": parity[name]})
            for name, ms in times.items() if name != "composition"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--quick", action="store_true", help="the first vocabulary, the head frozen")
    parser.add_argument("--out", default=None, help="directory for the JSON/markdown/PNG results")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    impls = implementations()
    results = []
    for label, V, D in CASES[:1] if args.quick else CASES:
        for train_head in (False,) if args.quick else (False, True):
            results += bench_case(label, V, D, args.tokens, train_head, impls)
            torch.cuda.empty_cache()
    print(write_results("ce", results, ceilings, args.out))


if __name__ == "__main__":
    main()
