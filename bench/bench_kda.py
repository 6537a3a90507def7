"""KDA benchmarks on the GPU (docs/benchmarks.md shapes): chunk_kda forward and forward+backward beside
flash-linear-attention's chunk_kda (when installed; warmed up first, its Triton compile and
autotuning kept out of the figures) and beside causal SDPA (flash) at the same shape.

Inputs as a model produces them: bf16 q, k, v and beta, fp32 log-decay g = logsigmoid(.), q/k
L2-normalised in the kernel. This package's kernels are timed at both internal precisions
(matmul_precision "medium": bf16 operands, fla's precision and the default for bf16 inputs;
"highest": 3xTF32 products, opt-in). Before timing, the outputs and gradients are compared (relative RMS of each
against an fp32 run of this package's kernels, and ours at "medium" against fla).
FLOPs: forward 2*C*K*5 + 2*K*V*3 per token and head (C = 64); forward+backward counted as 3x.

    python bench/bench_kda.py [--quick | --cases I,J | --long | --gate] [--no-fla | --fla-cases N] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

import kda_dsa_ops as K
from kda_dsa_ops import reference as R
from common import Result, bench_ms, measure_ceilings, rel_rms, write_results

CHUNK = 64
SHAPES = [(2, 8192, 32, 128), (8, 4096, 32, 128), (1, 32768, 64, 128)]
VARLEN = [1300, 547, 2048, 963, 271, 3063]  # packed into T = 8192, H = 32, K = V = 128


def make_inputs(B, T, H, D, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(B * 131 + T + H)
    q = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
    gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device="cuda", generator=g) + 2.0)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def fwd_flops(B, T, H, D):
    return B * T * H * (2 * CHUNK * D * 5 + 2 * D * D * 3)


def fwd_bytes(B, T, H, D):
    return B * T * H * (2 * D * 2 + D * 2 + D * 4 + 2 + D * 2)


PRECISIONS = ("highest", "medium")
NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta"]


def run_kda(fn, ins, cu):
    return fn(*ins, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]


def fwd_bwd(fn, ins, cu, do):
    o = run_kda(fn, ins, cu)
    return torch.autograd.grad(o, ins, do)


def ours(precision):
    return lambda *a, **kw: K.chunk_kda(*a, matmul_precision=precision, **kw)


def outputs(fn, ins, cu, do) -> list:
    return [run_kda(fn, ins, cu)] + list(fwd_bwd(fn, ins, cu, do))


def load_fla():
    try:
        from fla.ops.kda import chunk_kda
    except Exception as err:  # noqa: BLE001 (any import failure means: no baseline)
        print(f"  flash-linear-attention unavailable: {err}", flush=True)
        return None
    return chunk_kda


def compare(ins, cu, do, fla) -> dict:
    """Relative RMS differences against this package's kernels on fp32 inputs (precision "highest"):
    ours at each precision and fla on the bf16 inputs; ours at "medium" against fla."""
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    ref = outputs(ours("highest"), ref_ins, cu, do.float())
    mine = {p: outputs(ours(p), ins, cu, do) for p in PRECISIONS}
    out = {f"ours_{p}_vs_fp32": {n: rel_rms(a, b) for n, a, b in zip(NAMES, mine[p], ref)} for p in PRECISIONS}
    if fla is not None:
        theirs = outputs(fla, ins, None if cu is None else cu.long(), do)
        out["fla_vs_fp32"] = {n: rel_rms(a, b) for n, a, b in zip(NAMES, theirs, ref)}
        out["ours_medium_vs_fla"] = {n: rel_rms(a, b) for n, a, b in zip(NAMES, mine["medium"], theirs)}
    return out


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def bench_case(label, B, T, H, D, lens, fla, use_sdpa) -> list[Result]:
    ins = make_inputs(B, T, H, D)
    cu = None if lens is None else torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    shape = {"B": B, "T": T, "H": H, "K": D, "V": D, "varlen": lens}
    first = {(p, "fwd"): first_call_ms(lambda: run_kda(ours(p), ins, cu)) for p in PRECISIONS}
    first.update({(p, "fwd+bwd"): first_call_ms(lambda: fwd_bwd(ours(p), ins, cu, do)) for p in PRECISIONS})
    fla_first = {}
    if fla is not None:
        cu64 = None if cu is None else cu.long()
        fla_first = {"fwd": first_call_ms(lambda: run_kda(fla, ins, cu64)),
                     "fwd+bwd": first_call_ms(lambda: fwd_bwd(fla, ins, cu64, do))}
        print(f"  {label}: fla first calls (compile + autotune) {fla_first['fwd'] / 1e3:.1f} s fwd, "
              f"{fla_first['fwd+bwd'] / 1e3:.1f} s fwd+bwd", flush=True)
    parity = compare(ins, cu, do, fla)
    print(f"  {label}: parity {parity}", flush=True)
    q, k, v = (t.detach().transpose(1, 2) for t in ins[:3])
    results = []
    for mode, mult in (("fwd", 1), ("fwd+bwd", 3)):
        flops, nbytes = mult * fwd_flops(B, T, H, D), mult * fwd_bytes(B, T, H, D)
        baselines = []  # (name, ms, extra) measured once per mode
        if fla is not None:
            cu64 = None if cu is None else cu.long()
            theirs = ((lambda: run_kda(fla, ins, cu64)) if mode == "fwd" else (lambda: fwd_bwd(fla, ins, cu64, do)))
            baselines.append(("fla chunk_kda", bench_ms(theirs), {"fla_first_call_ms": fla_first[mode]}))
        if use_sdpa:
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            if mode == "fwd":
                sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
            else:
                dos = do.transpose(1, 2)
                sdpa = lambda: torch.autograd.grad(  # noqa: E731
                    torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True), (qs, ks, vs), dos)
            baselines.append(("sdpa causal", bench_ms(sdpa), {}))
        for p in PRECISIONS:
            fn = ours(p)
            ms = bench_ms((lambda: run_kda(fn, ins, cu)) if mode == "fwd" else (lambda: fwd_bwd(fn, ins, cu, do)))
            extra = {"matmul_precision": p, "first_call_ms": first[(p, mode)], "parity": parity}
            name = f"{mode} {label} {p}"
            results += [Result("kda", name, shape, ms, flops, nbytes, base, base_ms, dict(extra, **more))
                        for base, base_ms, more in baselines]
            if not baselines:
                results.append(Result("kda", name, shape, ms, flops, nbytes, extra=extra))
            print(f"  {name}: {ms:.3f} ms", flush=True)
    return results


def long_case(T, H, D, windowed) -> Result:
    """One layer's forward+backward at the default precision (bf16 products), its time and peak
    memory (torch.cuda.max_memory_allocated, inputs, outputs and gradients included); windowed
    False runs the whole call as one (kda_dsa_ops.ops.kda.WINDOW_TOKEN_HEADS past its size)."""
    from kda_dsa_ops.ops import kda as kda_ops

    window = kda_ops.WINDOW_TOKEN_HEADS
    kda_ops.WINDOW_TOKEN_HEADS = window if windowed else T * H
    try:
        torch.cuda.empty_cache()
        ins = make_inputs(1, T, H, D)
        do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        grads = fwd_bwd(K.chunk_kda, ins, None, do)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        peak = torch.cuda.max_memory_allocated()
        io = sum(t.numel() * t.element_size() for t in [*ins, do, *grads])
        del ins, do, grads
    finally:
        kda_ops.WINDOW_TOKEN_HEADS = window
    torch.cuda.empty_cache()
    name = f"long fwd+bwd (1,{T},{H},{D}) {'windowed' if windowed else 'one call'}"
    print(f"  {name}: {ms:.0f} ms, peak {peak / 1e9:.1f} GB (inputs, o, dO and gradients {io / 1e9:.1f} GB)",
          flush=True)
    return Result("kda", name, {"B": 1, "T": T, "H": H, "K": D, "V": D}, ms, 3 * fwd_flops(1, T, H, D),
                  3 * fwd_bytes(1, T, H, D), extra={"peak_gb": peak / 1e9, "io_gb": io / 1e9})


def bench_long() -> list[Result]:
    """The memory cases of docs/benchmarks.md: T = 2^20 at H = 8 windowed and as one call, then the
    longest power-of-two-multiple sequence one H = 64 layer runs."""
    results = []
    for windowed in (True, False):
        long_case(1 << 20, 8, 128, windowed)  # a first call (allocator and launch warm-up), not recorded
        results.append(long_case(1 << 20, 8, 128, windowed))
    for T in (768 << 10, 640 << 10, 512 << 10, 384 << 10):
        try:
            results.append(long_case(T, 64, 128, True))
            break
        except torch.OutOfMemoryError:
            print(f"  (1,{T},64,128): out of memory", flush=True)
            torch.cuda.empty_cache()
    return results


GATES = {"softplus": None, "bounded": -5.0}  # Kimi Linear's gate; GLM-5.3's (lower_bound -5, safe_gate)


def bench_gate(B=2, T=8192, H=32, D=128) -> list[Result]:
    """The in-kernel gate's cost (fla 0.6's use_gate_in_kernel with A_log, dt_bias and
    use_beta_sigmoid_in_kernel) at the default precision, for the softplus gate and GLM-5.3's
    bounded one: chunk_kda on the raw gate and beta against the same call on the log-decay and
    beta computed first (the baseline: the same decay, so the same path through the kernels), and
    against the gate and sigmoid written in torch before the kernels."""
    q, k, v, _, _ = make_inputs(B, T, H, D)
    gen = torch.Generator(device="cuda").manual_seed(7)
    g_raw = torch.randn(B, T, H, D, device="cuda", generator=gen).requires_grad_()
    beta_raw = torch.randn(B, T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    A_log = (torch.randn(H, device="cuda", generator=gen) * 0.5).requires_grad_()
    dt_bias = torch.randn(H * D, device="cuda", generator=gen).requires_grad_()
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    leaves = (q, k, v, g_raw, beta_raw, A_log, dt_bias)
    results = []
    for gate_name, lower_bound in GATES.items():
        options = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       safe_gate=lower_bound is not None, use_beta_sigmoid_in_kernel=True)
        with torch.no_grad():
            g_pre = R.kda_gate(g_raw, A_log, dt_bias, lower_bound)
            beta_pre = torch.sigmoid(beta_raw.float()).to(torch.bfloat16)
        plain_ins = [t.detach().requires_grad_() for t in (q, k, v, g_pre, beta_pre)]
        variants = {
            "log-decay inputs": (lambda: K.chunk_kda(*plain_ins, use_qk_l2norm_in_kernel=True)[0], plain_ins),
            "gate in the kernels": (lambda: K.chunk_kda(q, k, v, g_raw, beta_raw, use_qk_l2norm_in_kernel=True,
                                                        **options)[0], leaves),
            "gate in torch": (lambda: K.chunk_kda(q, k, v, R.kda_gate(g_raw, A_log, dt_bias, lower_bound),
                                                  torch.sigmoid(beta_raw.float()), use_qk_l2norm_in_kernel=True)[0],
                              leaves),
        }
        about = "softplus" if lower_bound is None else f"lower bound {lower_bound:g}"
        shape = {"B": B, "T": T, "H": H, "K": D, "V": D, "gate": f"{about}, dt_bias, beta sigmoid"}
        for mode, mult in (("fwd", 1), ("fwd+bwd", 3)):
            times = {}
            for name, (fn, wrt) in variants.items():
                step = fn if mode == "fwd" else (lambda fn=fn, wrt=wrt: torch.autograd.grad(fn(), wrt, do))
                times[name] = bench_ms(step)
                print(f"  {gate_name} gate, {mode}, {name}: {times[name]:.3f} ms", flush=True)
            base = "log-decay inputs"
            for name in ("gate in the kernels", "gate in torch"):
                results.append(Result("kda", f"{mode} ({B},{T},{H},{D}) {gate_name} gate: {name}", shape, times[name],
                                      mult * fwd_flops(B, T, H, D), mult * fwd_bytes(B, T, H, D),
                                      f"ours, {base}", times[base], {"matmul_precision": "medium"}))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    parser.add_argument("--cases", default=None,
                        help="comma-separated indices of the cases to run (0-2 the SHAPES, 3 the varlen case)")
    parser.add_argument("--no-fla", action="store_true", help="skip the flash-linear-attention baseline")
    parser.add_argument("--fla-cases", type=int, default=None,
                        help="compare with fla on the first N cases only (its first calls take minutes per shape)")
    parser.add_argument("--long", action="store_true",
                        help="the memory cases only (1M tokens at H 8, the longest at H 64)")
    parser.add_argument("--gate", action="store_true",
                        help="the in-kernel gate's cost only (raw gate and beta against log-decay inputs; the "
                             "softplus gate and GLM-5.3's bounded one)")
    parser.add_argument("--out", default=None, help="directory for the JSON/markdown/PNG results")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    if args.long:
        print(write_results("kda-long", bench_long(), ceilings, args.out))
        return
    if args.gate:
        print(write_results("kda-gate", bench_gate(), ceilings, args.out))
        return
    fla = None if args.no_fla else load_fla()
    cases = [(f"({B},{T},{H},{D})", B, T, H, D, None) for B, T, H, D in SHAPES]
    cases.append((f"varlen T={sum(VARLEN)} H=32", 1, sum(VARLEN), 32, 128, VARLEN))
    if args.quick:
        cases = cases[:1]
    elif args.cases is not None:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    results = []
    for i, (label, B, T, H, D, lens) in enumerate(cases):
        with_fla = fla if args.fla_cases is None or i < args.fla_cases else None
        results += bench_case(label, B, T, H, D, lens, with_fla, use_sdpa=lens is None)
    print(write_results("kda", results, ceilings, args.out))


if __name__ == "__main__":
    main()
