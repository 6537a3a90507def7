"""MoE demo on the native kernels: route tokens, permute them by expert, run a SwiGLU expert
layer with grouped_mm, combine, and backpropagate; the same block on the float64 reference
ops gives the parity column. Runs on the CPU; uses the CUDA kernels when a GPU is present.

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


CONFIGS = {
    "tiny": MoEDemoConfig(tokens=512, hidden=64, ffn=128, experts=8, topk=2, capacity_factor=1.25),
    "small": MoEDemoConfig(tokens=8192, hidden=1024, ffn=512, experts=64, topk=8, capacity_factor=1.25),
}


class NativeOps:
    name = "native"
    route = staticmethod(lambda logits, k, bias: K.moe_route(logits, k, bias))
    permute = staticmethod(lambda x, ids, E, w, cap, policy, fb: K.moe_permute(x, ids, E, w, cap, policy=policy,
                                                                              fallback_ids=fb))
    grouped_mm = staticmethod(K.grouped_mm)
    unpermute = staticmethod(K.moe_unpermute)


class ReferenceOps:
    name = "reference"
    route = staticmethod(lambda logits, k, bias: R.moe_route(logits, bias, k))
    permute = staticmethod(lambda x, ids, E, w, cap, policy, fb: R.moe_permute(x, ids, E, w, cap, policy, fb))
    grouped_mm = staticmethod(R.grouped_mm)
    unpermute = staticmethod(R.moe_unpermute)


def moe_block(ops, x, router, bias, w_gate_up, w_down, cfg: MoEDemoConfig, policy: str, timings: dict):
    """One routed-expert layer; records each op's time into timings[op]."""

    def timed(name, fn, *args):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args)
        if x.is_cuda:
            torch.cuda.synchronize()
        timings[name] = timings.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return out

    logits = x.to(router.dtype) @ router  # the router runs in fp32 (fp64 for the reference)
    weights, ids = timed("moe_route", ops.route, logits, cfg.topk, bias)
    capacity = R.expert_capacity(cfg.tokens, cfg.topk, cfg.experts, cfg.capacity_factor)
    fallback = torch.topk(logits.detach(), min(cfg.experts, cfg.topk + 4), dim=-1).indices[:, cfg.topk:]
    fallback = fallback.to(torch.int32).contiguous()
    xs, row_map, offs = timed("moe_permute", ops.permute, x, ids, cfg.experts, weights.detach(), capacity, policy,
                              fallback)
    h = timed("grouped_mm (gate+up)", ops.grouped_mm, xs, w_gate_up, offs)
    gate, up = h.chunk(2, dim=-1)
    ys = timed("grouped_mm (down)", ops.grouped_mm, (F.silu(gate) * up).contiguous(), w_down, offs)
    y = timed("moe_unpermute", ops.unpermute, ys, row_map, weights, cfg.tokens)
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
    for ops, p in ((NativeOps, native), (ReferenceOps, ref)):
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
        results[ops.name] = (y.detach(), loss.item(), grads, timings, offs)

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


if __name__ == "__main__":
    main()
