"""Training throughput and memory of the hybrid model on one device: the same model and steps on
the native kernels and on the reference ops (tokens/s, peak memory), and the planner's memory
estimate for the same plan beside the measured peak (kda_dsa_ops.plan). Peak memory is what the
CUDA allocator reports on a GPU; on the CPU it is the process's resident set (not comparable).

    python bench/bench_train.py [--config small] [--tokens 4096] [--steps 10] [--reference-steps 2] [--lora-rank 16]
                                [--quick] [--out DIR]
    python bench/bench_train.py --config kimi-linear-48b [--sequences 2]   # a real model's layer group
    python bench/bench_train.py --config glm-5.3-flash --backends native transformers   # beside transformers + peft
    python bench/bench_train.py --config glm-5.3-flash --tokens 16384 --sequences 2 --profile   # where the time goes

bf16 weights on CUDA (fp32 on the CPU), --sequences packed sequences of --tokens tokens in all per
step, AdamW on the trainable parameters. MFU: the FLOPs the step must do (kda_dsa_ops.plan.step_flops:
matrices 2 N_active per token forward, 2 N_active input gradients, 2 N_trainable weight
gradients; KDA, sparse / dense attention and the indexer by the kernels' formulas, forward and
backward) / step time / --peak-tflops, printed by part. --config also takes a layer group of a real model
(GROUPS: its released config.json shapes read by kda_dsa_ops.onboard, a few layers, the experts
one rank of expert parallelism 8 holds, routed among themselves: each such rank's expert load).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import time
from dataclasses import replace

import torch

from common import RESULTS_DIR, commit_id, gpu_tag
from kda_dsa_ops import onboard
from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.plan import Cluster, evaluate, step_flops
from kda_dsa_ops.train import peak_memory_mb


KIMI_LINEAR_48B = {  # Kimi-Linear-48B-A3B (transformers' KimiLinearConfig defaults)
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-5, "num_expert_group": 1, "topk_group": 1,
    "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4}}
DEEPSEEK_V32 = {  # DeepSeek-V3.2 (transformers' DeepseekV32Config defaults, the released YaRN rope)
    "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8,
    "topk_group": 4, "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}, "rope_theta": 10000}
GLM_53_FLASH = {  # GLM-5.3-Flash's language model (transformers' Glm5NextTextConfig defaults)
    "model_type": "glm5_next", "image_token_id": 154854, "text_config": {
        "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 45, "num_attention_heads": 64, "n_routed_experts": 288, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256, "rms_norm_eps": 1e-5, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 16, "linear_num_heads": 64, "linear_head_dim": 128,
        "linear_lower_bound": -5.0, "hc_mult": 4, "swiglu_limit": 10.0}}
EP = 8
# name: (config.json, the layer group's overrides); experts: one EP-8 rank's share, routed among themselves
GROUPS = {
    "kimi-linear-48b": (KIMI_LINEAR_48B, dict(layers=4, pattern="KKKA", ffn_pattern="M", experts=256 // EP)),
    "deepseek-v3.2": (DEEPSEEK_V32, dict(layers=1, pattern="D", ffn_pattern="M", experts=256 // EP, moe_groups=8,
                                         moe_topk_groups=4)),
    "glm-5.3-flash": (GLM_53_FLASH, dict(layers=4, pattern="KKKD", ffn_pattern="M", index_pattern="F",
                                         experts=288 // EP)),
}


def config_of(name: str):
    if name in GROUPS:
        raw, overrides = GROUPS[name]
        cfg = replace(onboard.FAMILIES[raw["model_type"]].read_config(raw), **overrides)
        cfg.validate()
        return cfg
    return get_config(name)


# our layer kinds as transformers names them (its config's layer_types / mlp_layer_types / indexer_types)
HF_ATTENTION = {"K": "linear_attention", "A": "full_attention", "D": "indexed_attention"}
HF_FFN = {"M": "sparse", "F": "dense"}
HF_INDEXER = {"F": "full", "S": "shared"}
HF_CLASS = {"glm5_next": "AutoModelForImageTextToText"}  # (its text model has no causal-LM head of its own)


def transformers_group(raw: dict, cfg, lora_rank: int):
    """The anchor: the same layer group as transformers builds it from the family's config.json (its
    modules, SDPA attention, its grouped-GEMM experts, fla's kernels for KDA where fla is
    installed), with our group's layers, experts and routing groups, and peft LoRA of rank
    lora_rank on every nn.Linear of the language model (attention projections, the indexer, dense
    and shared-expert MLPs; not the vision tower or the head; transformers' routed experts are 3-D
    parameters, which stay frozen as ours are). Returns the peft model, weights as transformers
    initialises them."""
    import peft
    import transformers

    hf = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    text = getattr(hf, "text_config", hf)
    text.num_hidden_layers = cfg.layers
    text.layer_types = [HF_ATTENTION[k] for k in cfg.kinds()]
    text.mlp_layer_types = [HF_FFN[k] for k in cfg.ffn_kinds()]
    if hasattr(text, "indexer_types"):
        text.indexer_types = [HF_INDEXER[cfg.index_kind(i)] for i in range(cfg.layers)]
    for name in ("num_local_experts", "n_routed_experts", "num_experts"):
        if hasattr(text, name):
            setattr(text, name, cfg.experts)
    for name, value in (("n_group", cfg.moe_groups), ("num_expert_group", cfg.moe_groups),
                        ("topk_group", cfg.moe_topk_groups)):
        if hasattr(text, name):
            setattr(text, name, value)
    auto = getattr(transformers, HF_CLASS.get(raw["model_type"], "AutoModelForCausalLM"))
    model = auto.from_config(hf, attn_implementation="sdpa", experts_implementation="grouped_mm")
    language = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "visual" not in n
                and not n.endswith("lm_head")]
    return peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=language))


def timed_steps(step, steps: int, warmup: int, device: torch.device) -> tuple[float, float, float]:
    """(seconds per step, the last loss, the MB resident between steps: weights, optimizer state)
    over `steps` steps after `warmup`; the peak memory counter starts after the warm-up."""
    for _ in range(warmup):
        step()
    resident = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated(device) / 2**20
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, loss.item(), resident


# A kernel's part of the step: the first pattern its name matches (ours by namespace first, so
# that our grouped GEMM counts as MoE, not as GEMM; attention before GEMM, cuDNN's SDPA kernels
# name wgmma; torch's copies before its other elementwise kernels).
PARTS = (("KDA (ours)", r"kda_dsa_ops::kda"), ("DSA (ours)", r"kda_dsa_ops::dsa"), ("MoE (ours)", r"kda_dsa_ops::moe"),
         ("mHC (ours)", r"kda_dsa_ops::hc"), ("cross-entropy (ours)", r"kda_dsa_ops::loss"),
         ("conv / SwiGLU (ours)", r"kda_dsa_ops::act"),
         ("fla (Triton)", r"chunk_|fused_recurrent|kda|gated_delta"), ("SDPA", r"sdpa|flash|fmha|attention"),
         ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|wgmma"),
         ("copies and indexing", r"copy|memcpy|memset|cat|index|scatter|gather|fill"),
         ("elementwise", r"elementwise"), ("reductions", r"reduce|norm|softmax"), ("other", r""))


def kernel_parts(kernels: dict[str, float]) -> dict[str, float]:
    """{part: time} from {kernel name: time} by PARTS."""
    parts = dict.fromkeys(name for name, _ in PARTS)
    for kernel, ms in kernels.items():
        part = next(name for name, pattern in PARTS if re.search(pattern, kernel, re.IGNORECASE))
        parts[part] = (parts[part] or 0.0) + ms
    return {name: t for name, t in parts.items() if t}


def profile_step(step, top: int = 25) -> dict:
    """One step (after the timed ones) under torch.profiler: GPU time by kernel, by part, and by
    the torch op that launched it (its self GPU time: which op the glue kernels belong to), in
    milliseconds; the per-kernel breakdown --profile prints and records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.time_range.elapsed_us() / 1e3
    ops = collections.Counter({e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()
                               if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0})
    return {"gpu_ms": sum(kernels.values()), "parts": kernel_parts(kernels), "kernels": kernels.most_common(top),
            "ops": ops.most_common(top)}


def print_profile(label: str, prof: dict) -> None:
    total = prof["gpu_ms"]
    print(f"{label}: {total:.1f} ms of GPU time in one step", flush=True)
    for part, ms in sorted(prof["parts"].items(), key=lambda kv: -kv[1]):
        print(f"  part {part:<20} {ms:9.2f} ms {100 * ms / total:5.1f}%", flush=True)
    for name, ms in prof["kernels"]:
        print(f"  {ms:9.2f} ms {100 * ms / total:5.1f}%  {name[:110]}", flush=True)
    for name, ms in prof["ops"]:
        print(f"  op {ms:9.2f} ms {100 * ms / total:5.1f}%  {name[:100]}", flush=True)


def timed_run(step, steps: int, warmup: int, device: torch.device, profile: bool) -> dict:
    """timed_steps' time and loss, the peak memory, and with profile (on a GPU) profile_step's
    breakdown; out of memory gives {"error": ..., "peak_mb"}. resident_mb: what stays between steps
    (on a GPU), so peak_mb - resident_mb is the step's activations and workspace."""
    try:
        seconds, loss, resident = timed_steps(step, steps, warmup, device)
        peak = peak_memory_mb(device)
        prof = profile_step(step) if profile and device.type == "cuda" else None
    except torch.OutOfMemoryError:
        return {"error": "out of memory", "peak_mb": peak_memory_mb(device)}
    return {"step_s": seconds, "loss": loss, "peak_mb": peak, "resident_mb": resident} | ({"profile": prof} if prof else {})


def run_anchor(raw: dict, cfg, args, device: torch.device) -> dict:
    """transformers + peft on the same tokens: --sequences rows of --tokens / --sequences (it takes
    no packed varlen batch for every family), AdamW on the LoRA parameters."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers_group(raw, cfg, args.lora_rank).to(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    per_row = args.tokens // args.sequences
    tokens = torch.randint(0, cfg.vocab, (args.sequences, per_row), generator=g).to(device)

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = {"backend": "transformers + peft"} | timed_run(step, args.steps, args.warmup, device, args.profile)
    if "error" not in run:
        run |= {"tokens_per_s": tokens.numel() / run["step_s"], "trainable": sum(p.numel() for p in trainable)}
    return run


def run(cfg, backend: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = HybridModel(cfg, lora_rank=args.lora_rank, backend=backend, recompute=args.recompute,
                            offload=args.offload).to(dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (args.tokens,), generator=g).to(device)
    labels = torch.roll(tokens, -1)
    cu = torch.linspace(0, args.tokens, args.sequences + 1).round().to(torch.int32).to(device)

    def step():
        loss = model(tokens, cu, labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # The reference ops (a Python loop over tokens for KDA) take far longer per step: fewer steps.
    steps, warmup = (args.reference_steps, 1) if backend == "reference" else (args.steps, args.warmup)
    run = {"backend": backend} | timed_run(step, steps, warmup, device, args.profile)
    if "error" not in run:
        run |= {"tokens_per_s": args.tokens / run["step_s"],
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    return run


def write_record(args, device: torch.device, result: dict) -> None:
    """The run's JSON under --out (default bench/results), named by GPU, date, config and memory variant."""
    meta = {"commit": commit_id(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    out_dir = args.out or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    tag = gpu_tag() if device.type == "cuda" else "cpu"
    suffix = "" if args.config in ("small", "tiny") else f"-{args.config}"
    if args.config in GROUPS:  # a memory variant of the group's standard run (16k tokens, everything kept)
        suffix += "".join([f"-{args.tokens // 1024}k" if args.tokens != 16384 else "",
                           f"-{args.recompute}" if args.recompute != "none" else "", "-offload" if args.offload else ""])
    with open(os.path.join(out_dir, f"{tag}-{datetime.date.today().isoformat()}-train{suffix}.json"), "w") as f:
        json.dump({"meta": meta, "result": result}, f, indent=1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help=f"a preset or a real model's layer group: {sorted(GROUPS)}")
    p.add_argument("--sequences", type=int, default=1, help="packed sequences per step (--tokens in all)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reference-steps", type=int, default=2, help="timed steps of the reference run (after one warm-up)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--recompute", choices=HybridModel.RECOMPUTE, default="none")
    p.add_argument("--offload", action="store_true", help="saved activations in pinned host memory (nn.offload)")
    p.add_argument("--backends", nargs="+", default=["native", "reference"],
                   help="native, reference, and for a real model's layer group transformers (its modules with "
                        "peft LoRA: the anchor)")
    p.add_argument("--memory-gb", type=float, default=141.0, help="device memory for the planner")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU (H200: 989)")
    p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
    p.add_argument("--quick", action="store_true", help="3 timed steps of 1024 tokens")
    p.add_argument("--profile", action="store_true",
                   help="on a GPU: one more step under torch.profiler, its GPU time by part, kernel and torch op")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.reference_steps, args.tokens = 3, 1, 1024
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config_of(args.config)
    seqlens = torch.linspace(0, args.tokens, args.sequences + 1).round().int().diff().tolist()
    flops = step_flops(cfg, args.lora_rank, seqlens)
    print("step GFLOPs (plan.step_flops): " + ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in flops.items() if v),
          flush=True)
    planned = evaluate(cfg, Cluster(1, args.memory_gb, 1.0), 1, args.tokens, args.recompute, args.offload,
                       args.lora_rank)
    result = {"config": args.config, "tokens": args.tokens, "sequences": args.sequences, "lora_rank": args.lora_rank,
              "recompute": args.recompute, "offload": args.offload, "runs": [], "step_flops": flops,
              "peak_tflops": args.peak_tflops, "planned_bytes": planned.memory,
              "planned_total_mb": planned.total / 2**20}
    runs = result["runs"]
    for backend in args.backends:
        if backend == "transformers" and args.config not in GROUPS:
            raise SystemExit(f"--backends transformers needs a real model's layer group: {sorted(GROUPS)}")
        runs.append(run_anchor(GROUPS[args.config][0], cfg, args, device) if backend == "transformers"
                    else run(cfg, backend, args, device))
        r = runs[-1]
        if "error" in r:
            print(f"{args.config} {backend:>9}: {r['error']}", flush=True)
        else:
            print(f"{args.config} {backend:>9}: {r['tokens_per_s']:,.0f} tok/s, step {r['step_s']:.3f} s, "
                  f"peak {r['peak_mb']:,.0f} MB", flush=True)
            if "profile" in r:
                print_profile(f"{args.config} {backend}", r["profile"])
            r["mfu"] = sum(flops.values()) / r["step_s"] / (args.peak_tflops * 1e12)  # required FLOPs / time / peak
            print(f"{args.config} {r['backend']:>9}: MFU {100 * r['mfu']:.1f}% of {args.peak_tflops:g} TFLOP/s",
                  flush=True)
        write_record(args, device, result)  # after every run: a later run that fails or is cut loses nothing
        if device.type == "cuda":
            torch.cuda.empty_cache()
    native = next((r for r in runs if r["backend"] == "native"), None)
    reference = next((r for r in runs if r["backend"] == "reference" and "error" not in r), None)
    timed = native is not None and "error" not in native
    if timed and reference:
        result["native_speedup"] = native["tokens_per_s"] / reference["tokens_per_s"]
        print(f"native / reference tokens/s: {result['native_speedup']:.2f}x")
    anchor = next((r for r in runs if r["backend"] == "transformers + peft" and "error" not in r), None)
    if timed and anchor:
        result["native_over_transformers"] = native["tokens_per_s"] / anchor["tokens_per_s"]
        print(f"native / transformers + peft tokens/s: {result['native_over_transformers']:.2f}x, peak memory "
              f"{native['peak_mb'] / anchor['peak_mb']:.2f}x theirs")
    if native:
        result["measured_over_planned"] = native["peak_mb"] / result["planned_total_mb"]
        print(f"planned {result['planned_total_mb']:,.0f} MB vs measured peak {native['peak_mb']:,.0f} MB "
              f"({result['measured_over_planned']:.2f}x)")
    write_record(args, device, result)
    return result


if __name__ == "__main__":
    main()
