"""Demo of the native kernels beside the float64 reference ops (the parity columns):
1. an MoE layer: route tokens, permute them by expert, a SwiGLU expert layer with grouped_mm,
   combine, and backpropagate;
2. a KDA attention step: chunk_kda forward and backward (q/k L2-normalised in the kernel, an
   initial state, two packed sequences) against the naive recurrence.
Runs on the CPU; uses the CUDA kernels when a GPU is present.

    python -m kda_dsa_ops.demo [--config tiny|small] [--device cpu|cuda] [--policy ...]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kda_dsa_ops as K
from kda_dsa_ops import reference as R


@dataclass(frozen=True)
class MoEDemoConfig:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int
    capacity_factor: float


@dataclass(frozen=True)
class KDADemoConfig:
    seqlens: tuple  # packed sequences
    heads: int
    value_heads: int
    head_dim: int


CONFIGS = {
    "tiny": MoEDemoConfig(tokens=512, hidden=64, ffn=128, experts=8, topk=2, capacity_factor=1.25),
    "small": MoEDemoConfig(tokens=8192, hidden=1024, ffn=512, experts=64, topk=8, capacity_factor=1.25),
}
KDA_CONFIGS = {
    "tiny": KDADemoConfig(seqlens=(200, 56), heads=2, value_heads=4, head_dim=32),
    "small": KDADemoConfig(seqlens=(1300, 748), heads=8, value_heads=8, head_dim=128),
}


def moe_block(ops, x, router, bias, w_gate_up, w_down, cfg: MoEDemoConfig, policy: str, timings: dict):
    """One routed-expert layer on ops (kda_dsa_ops or kda_dsa_ops.reference: the same names and
    signatures); records each op's time into timings[op]."""

    def timed(name, fn, *args, **kwargs):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if x.is_cuda:
            torch.cuda.synchronize()
        timings[name] = timings.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return out

    logits = x.to(router.dtype) @ router  # the router runs in fp32 (fp64 for the reference)
    weights, ids = timed("moe_route", ops.moe_route, logits, cfg.topk, bias)
    fallback = torch.topk(logits.detach(), min(cfg.experts, cfg.topk + 4), dim=-1).indices[:, cfg.topk:]
    fallback = fallback.to(torch.int32).contiguous()
    xs, row_map, offs = timed("moe_permute", ops.moe_permute, x, ids, cfg.experts, weights.detach(),
                              capacity_factor=cfg.capacity_factor, policy=policy, fallback_ids=fallback)
    h = timed("grouped_mm (gate+up)", ops.grouped_mm, xs, w_gate_up, offs)
    gate, up = h.chunk(2, dim=-1)
    ys = timed("grouped_mm (down)", ops.grouped_mm, (F.silu(gate) * up).contiguous(), w_down, offs)
    y = timed("moe_unpermute", ops.moe_unpermute, ys, row_map, weights, cfg.tokens)
    return y, offs


def run(cfg: MoEDemoConfig, device: str, policy: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    E, D, Fd = cfg.experts, cfg.hidden, cfg.ffn
    params = {
        "x": torch.randn(cfg.tokens, D),
        "router": torch.randn(D, E) / D ** 0.5,
        "bias": torch.randn(E) * 0.05,
        "w_gate_up": torch.randn(E, D, 2 * Fd) / D ** 0.5,
        "w_down": torch.randn(E, Fd, D) / Fd ** 0.5,
    }
    native = {k: v.to(device=device, dtype=torch.float32 if k in ("router", "bias") else dtype) for k, v in
              params.items()}
    # The reference sees exactly the native inputs, upcast to float64.
    ref = {k: v.detach().to("cpu", torch.float64) for k, v in native.items()}
    ref["bias"] = ref["bias"].float()
    for group in (native, ref):
        for k in ("x", "router", "w_gate_up", "w_down"):
            group[k].requires_grad_()

    print(f"kda_dsa_ops {K.__version__} {K.build_info()['backends']} | config {cfg} | device {device} "
          f"({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}) | {dtype} | policy {policy}")
    results = {}
    for ops, p in ((K, native), (R, ref)):
        # One untimed pass first: times exclude one-off costs (CUDA module loading, allocator growth).
        moe_block(ops, p["x"], p["router"], p["bias"], p["w_gate_up"], p["w_down"], cfg, policy, {})[0].sum().backward()
        for k in ("x", "router", "w_gate_up", "w_down"):
            p[k].grad = None
        timings: dict = {}
        y, offs = moe_block(ops, p["x"], p["router"], p["bias"], p["w_gate_up"], p["w_down"], cfg, policy, timings)
        loss = y.to(torch.promote_types(y.dtype, torch.float32)).pow(2).mean()
        start = time.perf_counter()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        timings["backward (all ops)"] = (time.perf_counter() - start) * 1e3
        grads = {k: p[k].grad for k in ("x", "router", "w_gate_up", "w_down")}
        results["native" if ops is K else "reference"] = (y.detach(), loss.item(), grads, timings, offs)

    y, loss, grads, t_native, offs = results["native"]
    y_ref, loss_ref, grads_ref, t_ref, _ = results["reference"]
    counts = torch.diff(offs.cpu(), prepend=torch.zeros(1, dtype=offs.dtype))

    def rel(a, b):
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        return (a - b).norm().item() / max(b.norm().item(), 1e-300)

    print(f"tokens per expert after capacity: min {int(counts.min())}, max {int(counts.max())}, "
          f"kept {int(counts.sum())} of {cfg.tokens * cfg.topk} copies")
    print(f"\n{'op (second call)':<24}{'native ms':>12}{'reference ms':>15}")
    for name in t_native:
        print(f"{name:<24}{t_native[name]:>12.3f}{t_ref[name]:>15.3f}")
    print(f"\n{'parity (relative RMS vs float64 reference)':<44}")
    print(f"  {'output':<20}{rel(y, y_ref):.2e}")
    print(f"  {'loss':<20}{abs(loss - loss_ref) / abs(loss_ref):.2e}")
    for k in grads:
        print(f"  {'grad ' + k:<20}{rel(grads[k], grads_ref[k]):.2e}")


def run_kda(cfg: KDADemoConfig, device: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T, H, HV, D = sum(cfg.seqlens), cfg.heads, cfg.value_heads, cfg.head_dim
    cu = torch.tensor((0,) + cfg.seqlens).cumsum(0).to(torch.int32)
    inputs = {
        "q": torch.randn(1, T, H, D), "k": torch.randn(1, T, H, D), "v": torch.randn(1, T, HV, D),
        "g": F.logsigmoid(torch.randn(1, T, HV, D) + 2.0), "beta": torch.rand(1, T, HV),
        "initial_state": torch.randn(len(cfg.seqlens), HV, D, D) * 0.1,
    }
    native = {k: v.to(device, dtype if k in ("q", "k", "v") else torch.float32).requires_grad_()
              for k, v in inputs.items()}
    ref = {k: v.detach().to("cpu", torch.float64).requires_grad_() for k, v in native.items()}
    print(f"\nKDA: {len(cfg.seqlens)} packed sequences {cfg.seqlens}, H {H}, HV {HV}, K = V = {D} | {dtype}")

    def step(fn, p, cu_seqlens, **kw):
        o, ht = fn(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                   output_final_state=True, cu_seqlens=cu_seqlens, **kw)
        loss = o.to(torch.promote_types(o.dtype, torch.float32)).pow(2).mean() + ht.pow(2).mean()
        return o, ht, torch.autograd.grad(loss, list(p.values()))

    def timed(fn):
        fn()  # first call untimed (module loading, allocator growth)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, (time.perf_counter() - start) * 1e3

    (o, ht, grads), ms = timed(lambda: step(K.chunk_kda, native, cu.to(device), use_qk_l2norm_in_kernel=True))
    (o_ref, ht_ref, grads_ref), ms_ref = timed(lambda: step(R.chunk_kda, ref, cu, use_qk_l2norm_in_kernel=True))

    def rel(a, b):
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        return (a - b).norm().item() / max(b.norm().item(), 1e-300)

    print(f"{'chunk_kda fwd+bwd (second call)':<34}{ms:>10.3f} ms   reference recurrence {ms_ref:.3f} ms")
    print("parity (relative RMS vs float64 reference)")
    print(f"  {'output':<20}{rel(o, o_ref):.2e}")
    print(f"  {'final state':<20}{rel(ht, ht_ref):.2e}")
    for name, a, b in zip(native, grads, grads_ref):
        print(f"  {'grad ' + name:<20}{rel(a, b):.2e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny", help="problem size (default: tiny)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when the CUDA kernels and a GPU are present, else cpu")
    parser.add_argument("--policy", choices=["drop_probs", "drop_position", "reroute"], default="reroute",
                        help="capacity overflow policy (default: reroute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if K.cuda_available() else "cpu")
    run(CONFIGS[args.config], device, args.policy, args.seed)
    run_kda(KDA_CONFIGS[args.config], device, args.seed)


if __name__ == "__main__":
    main()
