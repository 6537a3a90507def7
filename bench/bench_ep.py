"""Expert parallelism + FSDP2 over NCCL on the GPUs of one host: equivalence with one GPU, weak
scaling, all-to-all bandwidth and how much of it the micro-batch overlap hides.

    torchrun --nproc-per-node N bench/bench_ep.py [--config small] [--tokens 4096] [--steps 20] [--out DIR]

On a machine without a GPU it runs on CPU processes over gloo (a smoke test of the script:
its times say nothing about GPUs).

- equivalence: the ep = N run (each rank its own sequence) against the unsharded model on one GPU,
  fed all N sequences packed and fed them one at a time: loss and every trainable gradient,
  relative RMS (bf16 autocast on all); and the one-GPU run against a repeat of itself (the noise
  floor of the kernels' atomic accumulations).
- weak scaling: --tokens per GPU fixed; step time (median and interquartile range, the two
  settings' steps alternated) and tokens/s for every ep dividing N and the experts, with the
  dispatch in one piece (micro-batches 1) and in two overlapped halves (2).
- all-to-all: all_to_all_single over the ep group with the per-layer dispatch and combine sizes of
  this model (tokens x top-k rows of the latent width, bf16), GB/s sent per GPU.
- hidden share: (step time with micro-batches 1 - with 2) / (the step's all-to-all time, 4 per
  MoE layer: dispatch and combine forward and backward, timed alone); an estimate, since the
  split also changes the experts' GEMM sizes; reported (else null, with the raw difference as
  overlap_gain_s) only where the split is faster beyond both settings' interquartile ranges.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from common import RESULTS_DIR, commit_id, gpu_tag, rel_rms
from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.parallel import apply_fsdp, build_mesh, optimizer_groups, reduce_expert_gradients, shard_experts

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def free_cache():
    if CUDA:
        torch.cuda.empty_cache()


def batch(cfg, rank: int, tokens: int, device):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, cfg.vocab, (tokens,), generator=g)
    labels = torch.roll(x, -1)
    labels[-1] = -100
    return x.to(device), torch.tensor([0, tokens], dtype=torch.int32, device=device), labels.to(device)


def global_batch(cfg, world: int, tokens: int, device):
    parts = [batch(cfg, r, tokens, device) for r in range(world)]
    cu = torch.arange(world + 1, dtype=torch.int32, device=device) * tokens
    return torch.cat([p[0] for p in parts]), cu, torch.cat([p[2] for p in parts])


def make_model(cfg, args, device, mesh=None, micro_batches=1):
    torch.manual_seed(0)  # the same weights on every rank and in the one-GPU model
    model = HybridModel(cfg, lora_rank=args.lora_rank).to(device)
    if mesh is not None:
        shard_experts(model, mesh, micro_batches)
        apply_fsdp(model)
    return model


def loss_and_grads(model, inputs, mesh=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        loss = model(*inputs)["loss"]
    loss.backward()
    if mesh is not None:
        reduce_expert_gradients(model, mesh)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
             for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def equivalence(cfg, args, device, world) -> dict:
    mesh = build_mesh(world, world, cfg.experts, DEV)
    model = make_model(cfg, args, device, mesh)
    loss, grads = loss_and_grads(model, batch(cfg, dist.get_rank(), args.tokens, device), mesh)
    del model
    out = {}
    if dist.get_rank() == 0:
        ref = make_model(cfg, args, device)
        # The one-GPU model fed (a) all N sequences packed in one batch and (b) one sequence at a
        # time, gradients averaged: (b) runs the same GEMM shapes as each rank, so the two tell the
        # rounding of different shapes (and the routing flips it causes) from a real mismatch.
        ref_loss, ref_grads = loss_and_grads(ref, global_batch(cfg, world, args.tokens, device))

        def per_sequence():
            runs = [loss_and_grads(ref, batch(cfg, r, args.tokens, device)) for r in range(world)]
            return (sum(l for l, _ in runs) / world, {n: sum(g[n] for _, g in runs) / world for n in runs[0][1]})

        seq, seq_again = per_sequence(), per_sequence()
        del ref
        # (c) the one-GPU per-sequence run against itself, repeated: the noise floor of the
        # kernels' atomic accumulations (dkv of the sparse attention, dk of the indexer).
        for label, (a_loss, a_grads), (r_loss, r_grads) in (("packed", (loss, grads), (ref_loss, ref_grads)),
                                                            ("per_sequence", (loss, grads), seq),
                                                            ("one_gpu_rerun", seq_again, seq)):
            errs = {}
            for n, g in a_grads.items():
                r = r_grads[n]
                errs[n] = rel_rms(g, r if r.shape == g.shape else r[:g.shape[0]])  # rank 0 holds the first experts
            worst = sorted(errs, key=errs.get, reverse=True)
            out[label] = {"loss": a_loss.item(), "loss_one_gpu": r_loss.item(),
                          "loss_rel_err": abs(a_loss.item() / r_loss.item() - 1),
                          "grad_rel_rms_median": sorted(errs.values())[len(errs) // 2],
                          "grad_rel_rms_worst": {n: errs[n] for n in worst[:5]}, "grads_compared": len(errs),
                          "grad_rel_rms": errs}
    free_cache()
    return out


def step_times(cfg, args, device, world, ep) -> dict:
    """Step times with micro-batches 1 and 2, their steps alternated (drift and clock changes hit
    both alike): {mb: (median, p25, p75)} in seconds, the slowest rank's time per step."""
    mesh = build_mesh(world, ep, cfg.experts, DEV)
    runs = {}
    for mb in (1, 2):
        model = make_model(cfg, args, device, mesh, mb)
        runs[mb] = (model, torch.optim.AdamW(optimizer_groups(model), lr=1e-4), [])
    inputs = batch(cfg, dist.get_rank(), args.tokens, device)
    for i in range(args.warmup + args.steps):
        for mb, (model, opt, times) in runs.items():
            sync()
            dist.barrier()
            start = time.perf_counter()
            with torch.autocast(DEV, dtype=torch.bfloat16):
                loss = model(*inputs)["loss"]
            loss.backward()
            reduce_expert_gradients(model, mesh)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            t = torch.tensor(time.perf_counter() - start, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times.append(t.item())
    out = {}
    for mb, (_, _, times) in runs.items():
        q = torch.tensor(times).quantile(torch.tensor([0.5, 0.25, 0.75])).tolist()
        out[mb] = tuple(q)
    del runs
    free_cache()
    return out


def all_to_all_gbps(cfg, args, device, world) -> dict:
    mesh = build_mesh(world, world, cfg.experts, DEV)
    group = mesh["ep"].get_group()
    rows = args.tokens * cfg.moe_topk
    x = torch.randn(rows, cfg.moe_width, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(5):
        dist.all_to_all_single(y, x, group=group)
    sync()
    n = 20
    start = time.perf_counter()
    for _ in range(n):
        dist.all_to_all_single(y, x, group=group)
    sync()
    seconds = (time.perf_counter() - start) / n
    sent = x.numel() * x.element_size() * (world - 1) / world  # bytes leaving each GPU
    return {"bytes_per_gpu": x.numel() * x.element_size(), "seconds": seconds, "gbps_per_gpu": sent / seconds / 1e9}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
    dist.init_process_group("nccl" if CUDA else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = get_config(args.config, capacity_factor=None)
    say = print if rank == 0 else (lambda *a, **k: None)
    result = {"config": args.config, "world": world, "tokens_per_gpu": args.tokens, "lora_rank": args.lora_rank}
    result["equivalence"] = equivalence(cfg, args, device, world)
    for label, e in result["equivalence"].items():
        say(f"equivalence vs one GPU ({label}): loss rel err {e['loss_rel_err']:.2e}, gradient rel RMS median "
            f"{e['grad_rel_rms_median']:.2e}, worst {e['grad_rel_rms_worst']}", flush=True)
    a2a = all_to_all_gbps(cfg, args, device, world)
    result["all_to_all"] = a2a
    say(f"all-to-all ({a2a['bytes_per_gpu'] / 2**20:.1f} MiB per GPU): {a2a['seconds'] * 1e3:.3f} ms, "
        f"{a2a['gbps_per_gpu']:.0f} GB/s sent per GPU", flush=True)
    moe_layers = cfg.ffn_kinds().count("M")
    scaling = []
    for ep in [e for e in range(1, world + 1) if world % e == 0 and cfg.experts % e == 0]:
        row = {"ep": ep}
        for mb, (median, p25, p75) in step_times(cfg, args, device, world, ep).items():
            row[f"step_s_mb{mb}"], row[f"step_s_mb{mb}_iqr"] = median, (p25, p75)
            row[f"tokens_per_s_mb{mb}"] = args.tokens * world / median
        if ep > 1:
            a2a_step = 4 * moe_layers * a2a["seconds"]
            row["a2a_s_per_step"] = a2a_step
            row["overlap_gain_s"] = row["step_s_mb1"] - row["step_s_mb2"]
            # a share only where the two settings' interquartile ranges do not overlap and the split
            # is the faster one; otherwise the overlap hid nothing that can be measured here
            separated = row["step_s_mb2_iqr"][1] < row["step_s_mb1_iqr"][0]
            row["hidden_share"] = row["overlap_gain_s"] / a2a_step if separated else None
        scaling.append(row)
        say(row, flush=True)
    result["scaling"] = scaling
    if rank == 0:
        meta = {"commit": commit_id(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "gpu": torch.cuda.get_device_name() if CUDA else "cpu (gloo)", "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if CUDA else None}
        out_dir = args.out or RESULTS_DIR
        os.makedirs(out_dir, exist_ok=True)
        tag = gpu_tag() if CUDA else "cpu"
        path = os.path.join(out_dir, f"{tag}x{world}-{datetime.date.today().isoformat()}-ep.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "result": result}, f, indent=1)
        say(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
