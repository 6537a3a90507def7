"""Parallel-plan search and memory planner for FSDP2 x EP (LoRA) fine-tuning.

    python -m kda_dsa_ops.plan --config k3-2.8t --devices 128 --memory-gb 141 --link-gbps 400

Lists plans (EP degree, micro-batch, recomputation, offload) that fit, ranked by estimated
tokens/s per device, with per-device memory split into sharded bf16 weights, the gathered FSDP unit, trainable
state (fp32 parameters, gradients and Adam moments of the trainable parameters), activations and
all-to-all buffers; and the all-to-all bytes per step. Rejects plans with expert holes
(experts % ep != 0) and plans over memory.

Counts come from the implementation, not from formulas kept beside it: parameters from the model
built on the meta device, activations from the tensors one block saves for its backward on the
meta device (no memory is used for either).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .models import HybridConfig, HybridModel, get_config
from .parallel import is_expert_param

GB = 1e9
BF16 = 2
ADAM_STATE_BYTES = 16  # fp32 parameter + fp32 gradient + two fp32 Adam moments per trainable parameter


@dataclass(frozen=True)
class Cluster:
    devices: int
    memory_gb: float
    link_gbps: float          # all-to-all / collective bandwidth per device, GB/s
    tflops: float = 700.0     # dense bf16 per device (an H200 measures ~700 in bench/)
    efficiency: float = 0.4   # share of it the step achieves


@dataclass(frozen=True)
class Counts:
    params: int
    expert_params: int
    trainable: int
    largest_unit: int        # non-expert parameters of the largest FSDP unit (a block)
    expert_params_per_layer: int


@lru_cache(maxsize=None)
def parameter_counts(cfg: HybridConfig, lora_rank: int) -> Counts:
    with torch.device("meta"):
        model = HybridModel(cfg, lora_rank=lora_rank)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    units = [sum(p.numel() for n, p in b.named_parameters() if not is_expert_param(n)) for b in model.blocks]
    return Counts(params, experts, trainable, max(units), experts // max(cfg.ffn_kinds().count("M"), 1))


def saved_bytes(fn, params) -> int:
    """Bytes of the tensors autograd saves for the backward while fn() runs, leaving out the
    parameters (and views of them) that it saves: they are weights, counted as such."""
    total = [0]
    param_ids = {id(p) for p in params}

    def pack(t):
        base = t._base if t._base is not None else t
        if id(t) not in param_ids and id(base) not in param_ids:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


@lru_cache(maxsize=None)
def block_activation_bytes(cfg: HybridConfig, tokens: int, lora_rank: int, recompute: str) -> dict:
    """Saved-for-backward bytes of one block of each kind ("K", "D") on `tokens` tokens (one
    sequence), bf16, counted on the meta device; recompute as in HybridModel."""
    with torch.device("meta"):
        model = HybridModel(cfg, lora_rank=lora_rank).to(torch.bfloat16)
        cu = torch.tensor([0, tokens], dtype=torch.int32)
        pos = torch.arange(tokens)
        streams = (cfg.hc_mult,) if cfg.hc_mult > 1 else ()  # the residual streams of hyper-connections
        x = torch.zeros(tokens, *streams, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)
        out = {}
        for block in model.blocks:
            if block.kind not in out:
                out[block.kind] = saved_bytes(lambda: block(x, cu, pos, model.backend, recompute),
                                              list(model.parameters()))
    return out


@dataclass
class Plan:
    ep: int
    dp: int
    tokens: int           # tokens per device per micro-batch (one sequence of this length)
    recompute: str
    offload: bool
    memory: dict = field(default_factory=dict)  # bytes per device by part
    a2a_bytes: float = 0.0                      # all-to-all bytes sent per device per step
    step_s: float = 0.0
    fits: bool = False

    @property
    def total(self) -> float:
        return sum(self.memory.values())


def evaluate(cfg: HybridConfig, cluster: Cluster, ep: int, tokens: int, recompute: str, offload: bool,
             lora_rank: int) -> Plan:
    """Memory and step-time estimate of one plan (see the module docstring)."""
    n = cluster.devices
    c = parameter_counts(cfg, lora_rank)
    plan = Plan(ep=ep, dp=n // ep, tokens=tokens, recompute=recompute, offload=offload)
    act = block_activation_bytes(cfg, tokens, lora_rank, recompute)
    per_layer = [act[kind] for kind in cfg.kinds()]
    # Offloaded activations are on the device two blocks at a time: the block in its backward and
    # the one before it, prefetched (nn.offload).
    pairs = [a + b for a, b in zip(per_layer, per_layer[1:])] or per_layer
    activations = max(pairs) if offload else sum(per_layer)
    if recompute != "none" and not offload:
        # the block being recomputed holds its full activations during its backward
        activations += block_activation_bytes(cfg, tokens, lora_rank, "none")[cfg.kinds()[0]]
    copies = tokens * cfg.moe_topk
    plan.memory = {
        "weights (bf16, sharded)": c.params * BF16 / n,
        "gathered FSDP unit + local experts": (2 * c.largest_unit + c.expert_params_per_layer / ep) * BF16,
        "trainable state": c.trainable * ADAM_STATE_BYTES / n,
        "activations": activations,
        "all-to-all buffers": 4 * copies * cfg.moe_width * BF16,  # dispatch + combine, send + receive
    }
    moe_layers = cfg.ffn_kinds().count("M")
    plan.a2a_bytes = moe_layers * 2 * 2 * copies * cfg.moe_width * BF16 * (ep - 1) / ep  # fwd + bwd, there and back
    active = c.params - c.expert_params + c.expert_params * cfg.moe_topk / cfg.experts
    flops = 6 * active * tokens * (4 / 3 if recompute == "block" else 1.0)
    compute_s = flops / (cluster.tflops * 1e12 * cluster.efficiency)
    # FSDP traffic per device: the non-expert weights gathered over all ranks and this rank's expert
    # slice over its dp ranks, once for the forward and once for the backward; the trainable
    # gradients reduce-scattered in fp32.
    gathered = ((c.params - c.expert_params) * BF16 * (n - 1) / n
                + c.expert_params / ep * BF16 * (plan.dp - 1) / plan.dp)
    fsdp_s = (2 * gathered + c.trainable * 4 * (n - 1) / n) / (cluster.link_gbps * GB)
    plan.step_s = max(compute_s, fsdp_s) + plan.a2a_bytes / (cluster.link_gbps * GB)
    plan.fits = plan.total <= cluster.memory_gb * GB
    return plan


def search(cfg: HybridConfig, cluster: Cluster, lora_rank: int, seq_lens: list[int]) -> list[Plan]:
    """Every plan without expert holes, ranked: fitting ones by tokens per second, then the rest."""
    plans = []
    for ep in range(1, cluster.devices + 1):
        if cluster.devices % ep or cfg.experts % ep:
            continue
        for tokens in seq_lens:
            for recompute in HybridModel.RECOMPUTE:
                for offload in (False, True):
                    plans.append(evaluate(cfg, cluster, ep, tokens, recompute, offload, lora_rank))
    return sorted(plans, key=lambda p: (not p.fits, -p.tokens / p.step_s))


def format_plans(plans: list[Plan], limit: int) -> str:
    head = (f"{'ep':>4} {'dp':>4} {'tokens':>7} {'recompute':>9} {'offload':>7} | {'weights':>8} {'gathered':>8} "
            f"{'train':>7} {'activ':>8} {'a2a buf':>8} {'total GB':>9} | {'a2a GB/step':>11} {'step s':>7} "
            f"{'tok/s/dev':>9}  fits")
    rows = [head, "-" * len(head)]
    for p in plans[:limit]:
        m = [v / GB for v in p.memory.values()]
        rows.append(f"{p.ep:>4} {p.dp:>4} {p.tokens:>7} {p.recompute:>9} {str(p.offload):>7} | {m[0]:>8.1f} "
                    f"{m[1]:>8.1f} {m[2]:>7.2f} {m[3]:>8.1f} {m[4]:>8.2f} {p.total / GB:>9.1f} | "
                    f"{p.a2a_bytes / GB:>11.2f} {p.step_s:>7.3f} {p.tokens / p.step_s:>9.0f}  "
                    f"{'yes' if p.fits else 'NO'}")
    return "\n".join(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-2.8t", help="HybridConfig preset")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--memory-gb", type=float, required=True, help="memory per device")
    p.add_argument("--link-gbps", type=float, default=400.0, help="collective bandwidth per device, GB/s")
    p.add_argument("--tflops", type=float, default=700.0, help="dense bf16 TFLOP/s per device")
    p.add_argument("--lora-rank", type=int, default=16, help="0: every parameter trained")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384], help="tokens per device")
    p.add_argument("--top", type=int, default=15, help="rows to print")
    return p.parse_args(argv)


def main(argv=None) -> list[Plan]:
    args = parse_args(argv)
    cfg = get_config(args.config)
    cluster = Cluster(args.devices, args.memory_gb, args.link_gbps, args.tflops)
    c = parameter_counts(cfg, args.lora_rank)
    print(f"{args.config}: {c.params / 1e9:,.1f} B parameters ({c.expert_params / 1e9:,.1f} B in {cfg.experts} "
          f"experts x {cfg.layers} layers), {c.trainable / 1e6:,.1f} M trainable (LoRA rank {args.lora_rank}); "
          f"{args.devices} devices x {args.memory_gb:g} GB")
    plans = search(cfg, cluster, args.lora_rank, args.seq_lens)
    fitting = sum(p.fits for p in plans)
    print(f"{len(plans)} plans without expert holes, {fitting} fit\n")
    print(format_plans(plans, args.top))
    return plans


if __name__ == "__main__":
    main()
