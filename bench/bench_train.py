"""Training throughput and memory of the hybrid model on one device: the same model and steps on
the native kernels and on the reference ops (tokens/s, peak memory), and the planner's memory
estimate for the same plan beside the measured peak (kda_dsa_ops.plan). Peak memory is what the
CUDA allocator reports on a GPU; on the CPU it is the process's resident set (not comparable).

    python bench/bench_train.py [--config small] [--tokens 4096] [--steps 10] [--reference-steps 2] [--lora-rank 16]
                                [--quick] [--out DIR]

bf16 weights on CUDA (fp32 on the CPU), one sequence of --tokens tokens per step, AdamW on the
trainable parameters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

from common import RESULTS_DIR, commit_id, gpu_tag
from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.plan import Cluster, evaluate
from kda_dsa_ops.train import peak_memory_mb


def run(cfg, backend: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = HybridModel(cfg, lora_rank=args.lora_rank, backend=backend, recompute=args.recompute).to(device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (args.tokens,), generator=g).to(device)
    labels = torch.roll(tokens, -1)
    cu = torch.tensor([0, args.tokens], dtype=torch.int32, device=device)

    def step():
        loss = model(tokens, cu, labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # The reference ops (a Python loop over tokens for KDA) take far longer per step: fewer steps.
    steps, warmup = (args.reference_steps, 1) if backend == "reference" else (args.steps, args.warmup)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {"backend": backend, "step_s": seconds, "tokens_per_s": args.tokens / seconds,
            "peak_mb": peak_memory_mb(device), "loss": loss.item()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reference-steps", type=int, default=2, help="timed steps of the reference run (after one warm-up)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--recompute", choices=HybridModel.RECOMPUTE, default="none")
    p.add_argument("--backends", nargs="+", default=["native", "reference"])
    p.add_argument("--memory-gb", type=float, default=141.0, help="device memory for the planner")
    p.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
    p.add_argument("--quick", action="store_true", help="3 timed steps of 1024 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.reference_steps, args.tokens = 3, 1, 1024
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = get_config(args.config)
    runs = []
    for backend in args.backends:
        runs.append(run(cfg, backend, args, device))
        print(f"{args.config} {backend:>9}: {runs[-1]['tokens_per_s']:,.0f} tok/s, step {runs[-1]['step_s']:.3f} s, "
              f"peak {runs[-1]['peak_mb']:,.0f} MB", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    planned = evaluate(cfg, Cluster(1, args.memory_gb, 1.0), 1, args.tokens, args.recompute, False, args.lora_rank)
    result = {"config": args.config, "tokens": args.tokens, "lora_rank": args.lora_rank, "recompute": args.recompute,
              "runs": runs, "planned_bytes": planned.memory, "planned_total_mb": planned.total / 2**20}
    native = next((r for r in runs if r["backend"] == "native"), None)
    reference = next((r for r in runs if r["backend"] == "reference"), None)
    if native and reference:
        result["native_speedup"] = native["tokens_per_s"] / reference["tokens_per_s"]
        print(f"native / reference tokens/s: {result['native_speedup']:.2f}x")
    if native:
        result["measured_over_planned"] = native["peak_mb"] / result["planned_total_mb"]
        print(f"planned {result['planned_total_mb']:,.0f} MB vs measured peak {native['peak_mb']:,.0f} MB "
              f"({result['measured_over_planned']:.2f}x)")
    meta = {"commit": commit_id(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    out_dir = args.out or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    tag = gpu_tag() if device.type == "cuda" else "cpu"
    with open(os.path.join(out_dir, f"{tag}-{datetime.date.today().isoformat()}-train.json"), "w") as f:
        json.dump({"meta": meta, "result": result}, f, indent=1)
    return result


if __name__ == "__main__":
    main()
