"""Parallel-plan search and memory planner for FSDP2 x EP (LoRA) fine-tuning.

    python -m kda_dsa_ops.plan --config k3-2.8t --devices 128 --memory-gb 141 --link-gbps 400

Lists plans (EP degree, context-parallel degree, micro-batch, recomputation, offload) that fit,
ranked by estimated tokens/s per device, with per-device memory split into sharded bf16 weights,
the gathered FSDP unit, trainable state (fp32 parameters, gradients and Adam moments of the
trainable parameters), activations and all-to-all buffers; and the all-to-all and
context-parallel bytes per step. Rejects plans with expert holes (experts % ep != 0) and plans
over memory. With context parallelism (cp > 1) a sequence of `tokens` is split over cp ranks:
each holds a share's activations plus the gathered key rows of its MLA layers (at most the whole
sequence before its share) and exchanges, per KDA layer, one (transition, state) pair per rank
and, per MLA layer, the key rows (forward gather, backward reduce-scatter).

Counts come from the implementation, not from formulas kept beside it: parameters from the model
built on the meta device, activations from the tensors one block saves for its backward on the
meta device (no memory is used for either).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .models import HybridConfig, HybridModel, get_config
from .nn import layers
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


@contextmanager
def fused_attention():
    """Dense attention as the GPU runs it. On the meta device torch's SDPA takes its math path,
    which saves the [H, Tq, Tk] fp32 probabilities; on a GPU a fused kernel runs, which saves q, k,
    v, the output and the rows' log-sum-exp: layers.attend calls the memory-efficient kernel (its
    meta kernel) while this holds."""
    plain = layers.attend

    def fused(q, k, v, is_causal=False, scale=None):
        q, k, v = (t[None].transpose(1, 2) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)
        return out[0][0].transpose(0, 1)

    layers.attend = fused
    try:
        yield
    finally:
        layers.attend = plain


@lru_cache(maxsize=None)
def block_activation_bytes(cfg: HybridConfig, tokens: int, lora_rank: int, recompute: str) -> dict:
    """Saved-for-backward bytes of one block of each kind ("K", "D") on `tokens` tokens (one
    sequence), bf16, counted on the meta device; recompute as in HybridModel."""
    with torch.device("meta"), fused_attention():
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


KDA_CHUNK = 64


def step_flops(cfg: HybridConfig, lora_rank: int, seqlens: list[int]) -> dict:
    """The FLOPs one training step must do on packed sequences of these lengths, by part (the
    numerator of MFU, docs/benchmarks.md):

      matrices      forward 2 N_active and input gradients 2 N_active per token, weight gradients
                    2 N_trainable per token; N_active counts every matrix a token passes (the routed
                    experts at moe_topk / experts of theirs, the LM head; not the embedding lookup,
                    nor the vision tower's, which run on patches), N_trainable the trainable ones
      KDA           forward per token and value head 2 C K 5 + 2 K V 3 (C = 64), backward twice that
      sparse MLA    SFA 2 S H (Dqk + Dv), SFAG 2 S H (2 Dv + 3 Dqk) over the S = sum_t min(topk, t + 1)
                    selected keys (Dqk = kv_rank + rope, Dv = kv_rank: the absorbed form the kernels
                    run); the indexer 2 Hi Di per visible key (pool) per query, and where it trains
                    (no LoRA) 4 Hi Di per selected key for its backward
      dense MLA     causal attention 2 H (Dqk + Dv) per visible key per query, backward 2.5x
    """
    with torch.device("meta"):
        model = HybridModel(cfg, lora_rank=lora_rank)
    active = trainable = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed.weight" or name.startswith("vision."):
            continue
        share = cfg.moe_topk / cfg.experts if is_expert_param(name) else 1.0
        active += share * p.numel()
        trainable += share * p.numel() if p.requires_grad else 0.0
    T = sum(seqlens)
    visible = sum(L * (L + 1) // 2 for L in seqlens)               # causal (query, key) pairs
    selected = sum(sum(min(cfg.dsa_topk, t + 1) for t in range(L)) for L in seqlens)
    kinds = cfg.kinds()
    K = cfg.kda_head_dim
    kda = T * cfg.kda_value_heads * (2 * KDA_CHUNK * K * 5 + 2 * K * K * 3)
    H, latent = cfg.dsa_heads, cfg.dsa_kv_rank
    dqk, dv = latent + cfg.dsa_rope_dim, latent
    own = sum(1 for i, kind in enumerate(kinds) if kind == "D" and cfg.index_kind(i) == "F")
    index_keys = visible / cfg.index_kpool if cfg.index_kpool else visible
    dense = 2 * H * (cfg.dsa_nope_dim + cfg.dsa_rope_dim + cfg.dsa_v_dim) * visible
    return {
        "matrices forward": 2 * active * T,
        "matrices input gradients": 2 * active * T,
        "matrices weight gradients": 2 * trainable * T,
        "KDA forward": kinds.count("K") * kda,
        "KDA backward": kinds.count("K") * 2 * kda,
        "sparse attention forward": kinds.count("D") * 2 * selected * H * (dqk + dv),
        "sparse attention backward": kinds.count("D") * 2 * selected * H * (2 * dv + 3 * dqk),
        "indexer forward": own * 2 * cfg.index_heads * cfg.index_dim * index_keys,
        "indexer backward": (own * 4 * cfg.index_heads * cfg.index_dim * selected) if lora_rank == 0 else 0.0,
        "dense attention forward": kinds.count("A") * dense,
        "dense attention backward": kinds.count("A") * 2.5 * dense,
    }


@dataclass
class Plan:
    ep: int
    dp: int               # batches in one step per ep index (devices / ep / cp)
    tokens: int           # the micro-batch: one sequence of this length, over cp devices
    recompute: str
    offload: bool
    cp: int = 1
    memory: dict = field(default_factory=dict)  # bytes per device by part
    a2a_bytes: float = 0.0                      # all-to-all bytes sent per device per step
    cp_bytes: float = 0.0                       # context-parallel bytes received per device per step
    step_s: float = 0.0
    fits: bool = False

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def share(self) -> int:
        """Tokens per device."""
        return self.tokens // self.cp


def key_row_bytes(cfg: HybridConfig, kind: str) -> int:
    """Bytes per token an MLA layer of `kind` gathers and keeps under context parallelism (bf16):
    the latent key rows, with the sparse layer's indexer keys, or the dense layer's expanded keys
    and values."""
    latent = cfg.dsa_kv_rank + cfg.dsa_rope_dim
    if kind == "D":
        return (latent + cfg.index_dim) * BF16
    return (latent + cfg.dsa_heads * (cfg.dsa_nope_dim + cfg.dsa_rope_dim + cfg.dsa_v_dim)) * BF16


def evaluate(cfg: HybridConfig, cluster: Cluster, ep: int, tokens: int, recompute: str, offload: bool,
             lora_rank: int, cp: int = 1) -> Plan:
    """Memory and step-time estimate of one plan (see the module docstring)."""
    n = cluster.devices
    c = parameter_counts(cfg, lora_rank)
    plan = Plan(ep=ep, dp=n // ep // cp, tokens=tokens, recompute=recompute, offload=offload, cp=cp)
    share = plan.share
    act = block_activation_bytes(cfg, share, lora_rank, recompute)
    before = tokens - share  # key rows of the sequence before the last share
    per_layer = [act[kind] + (before * key_row_bytes(cfg, kind) if kind != "K" else 0) for kind in cfg.kinds()]
    # Offloaded activations are on the device two blocks at a time: the block in its backward and
    # the one before it, prefetched (nn.offload).
    pairs = [a + b for a, b in zip(per_layer, per_layer[1:])] or per_layer
    activations = max(pairs) if offload else sum(per_layer)
    if recompute != "none":
        # the block being recomputed holds its full activations during its backward, offloaded or not
        activations += block_activation_bytes(cfg, share, lora_rank, "none")[cfg.kinds()[0]]
    copies = share * cfg.moe_topk
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
    flops = 6 * active * share * (4 / 3 if recompute == "block" else 1.0)
    compute_s = flops / (cluster.tflops * 1e12 * cluster.efficiency)
    # FSDP traffic per device: the non-expert weights gathered over all ranks and this rank's expert
    # slice over its dp ranks, once for the forward and once for the backward; the trainable
    # gradients reduce-scattered in fp32.
    replicas = n // ep  # the ranks holding the same experts
    gathered = ((c.params - c.expert_params) * BF16 * (n - 1) / n
                + c.expert_params / ep * BF16 * (replicas - 1) / replicas)
    fsdp_s = (2 * gathered + c.trainable * 4 * (n - 1) / n) / (cluster.link_gbps * GB)
    # context parallelism, forward and backward: per KDA layer every other rank's (transition,
    # state) pair in fp32; per MLA layer the other shares' key rows
    pair = cfg.kda_value_heads * cfg.kda_head_dim * 2 * cfg.kda_head_dim * 4
    plan.cp_bytes = sum(2 * (cp - 1) * (pair if kind == "K" else share * key_row_bytes(cfg, kind))
                        for kind in cfg.kinds())
    plan.step_s = max(compute_s, fsdp_s) + (plan.a2a_bytes + plan.cp_bytes) / (cluster.link_gbps * GB)
    plan.fits = plan.total <= cluster.memory_gb * GB
    return plan


def search(cfg: HybridConfig, cluster: Cluster, lora_rank: int, seq_lens: list[int],
           cps: tuple[int, ...] = (1,)) -> list[Plan]:
    """Every plan without expert holes (and, for each cp in cps, whose sequences and data-parallel
    ranks it divides), ranked: fitting ones by tokens per second per device, then the rest."""
    plans = []
    for ep in range(1, cluster.devices + 1):
        if cluster.devices % ep or cfg.experts % ep:
            continue
        for cp in cps:
            for tokens in seq_lens:
                if (cluster.devices // ep) % cp or tokens % cp:
                    continue
                for recompute in HybridModel.RECOMPUTE:
                    for offload in (False, True):
                        plans.append(evaluate(cfg, cluster, ep, tokens, recompute, offload, lora_rank, cp))
    return sorted(plans, key=lambda p: (not p.fits, -p.share / p.step_s))


def format_plans(plans: list[Plan], limit: int) -> str:
    head = (f"{'ep':>4} {'cp':>3} {'dp':>4} {'tokens':>7} {'recompute':>9} {'offload':>7} | {'weights':>8} "
            f"{'gathered':>8} {'train':>7} {'activ':>8} {'a2a buf':>8} {'total GB':>9} | {'a2a GB/step':>11} "
            f"{'cp GB/step':>10} {'step s':>7} {'tok/s/dev':>9}  fits")
    rows = [head, "-" * len(head)]
    for p in plans[:limit]:
        m = [v / GB for v in p.memory.values()]
        rows.append(f"{p.ep:>4} {p.cp:>3} {p.dp:>4} {p.tokens:>7} {p.recompute:>9} {str(p.offload):>7} | "
                    f"{m[0]:>8.1f} {m[1]:>8.1f} {m[2]:>7.2f} {m[3]:>8.1f} {m[4]:>8.2f} {p.total / GB:>9.1f} | "
                    f"{p.a2a_bytes / GB:>11.2f} {p.cp_bytes / GB:>10.2f} {p.step_s:>7.3f} "
                    f"{p.share / p.step_s:>9.0f}  {'yes' if p.fits else 'NO'}")
    return "\n".join(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="k3-2.8t", help="HybridConfig preset")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--memory-gb", type=float, required=True, help="memory per device")
    p.add_argument("--link-gbps", type=float, default=400.0, help="collective bandwidth per device, GB/s")
    p.add_argument("--tflops", type=float, default=700.0, help="dense bf16 TFLOP/s per device")
    p.add_argument("--lora-rank", type=int, default=16, help="0: every parameter trained")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384],
                   help="sequence lengths (tokens per device without context parallelism)")
    p.add_argument("--cp", type=int, nargs="+", default=[1], help="context-parallel degrees to consider")
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
    plans = search(cfg, cluster, args.lora_rank, args.seq_lens, tuple(args.cp))
    fitting = sum(p.fits for p in plans)
    print(f"{len(plans)} plans without expert holes, {fitting} fit\n")
    print(format_plans(plans, args.top))
    return plans


if __name__ == "__main__":
    main()
