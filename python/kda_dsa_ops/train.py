"""Training on the kernels: full or LoRA fine-tuning of the hybrid model on a generated
multi-query associative-recall task, single-process or under torchrun with FSDP2 + expert
parallelism; progress lines, torch.distributed.checkpoint checkpoints with exact resume, and a
loss curve.

    python -m kda_dsa_ops.train --config tiny --out runs/base
    torchrun --nproc-per-node 2 -m kda_dsa_ops.train --config tiny --ep 2 --lora-rank 16 \\
        --init-from runs/base/final --task shifted --out runs/lora
    torchrun --nproc-per-node 8 -m kda_dsa_ops.train --init-from <a Kimi Linear / DeepSeek-V3.2 / GLM-5.3 dir> \\
        --ep 8 --lora-rank 16 --data tokens.npy --seq-len 4096
    torchrun --nproc-per-node 4 -m kda_dsa_ops.train --cp 4 --seqs 1 --data tokens.npy --seq-len 131072

The task: each sequence lists key-value pairs, then asks for the values of some of its keys; the
labels are those values (every other token is unlabelled). --task shifted draws keys and values
from other parts of the vocabulary (what a LoRA run then adapts the trained model to). --data
trains on a user's tokens instead (next-token prediction, see token_stream). --init-from takes our
own torch.distributed.checkpoint directories or a checkpoint directory with a config.json (the
real families and our own format, see onboard): the model then has that checkpoint's shapes.
--cp N splits each batch along T over N ranks (context parallelism, parallel.ContextParallel):
they hold one batch between them, each rank a 1/N share of its tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from . import onboard
from .models import HybridModel, get_config
from .parallel import (ContextParallel, apply_fsdp, build_mesh, check_layout, clip_grad_norm, is_expert_param,
                       optimizer_groups, reduce_expert_gradients, shard_experts)


def recall_batch(vocab: int, seqs: int, pairs: int, queries: int, seed: int, task: str = "base"):
    """Packed associative-recall sequences: tokens [T] int64, cu_seqlens [seqs + 1] int32, labels [T]."""
    g = torch.Generator().manual_seed(seed)
    quarter = vocab // 4
    key0, val0 = (0, quarter) if task == "base" else (2 * quarter, 3 * quarter)
    keys = torch.stack([torch.randperm(quarter, generator=g)[:pairs] for _ in range(seqs)]) + key0
    values = torch.randint(0, quarter, (seqs, pairs), generator=g) + val0
    asked = torch.stack([torch.randperm(pairs, generator=g)[:queries] for _ in range(seqs)])
    context = torch.stack([keys, values], dim=-1).flatten(1)                # k1 v1 k2 v2 ...
    tokens = torch.cat([context, keys.gather(1, asked)], dim=1)             # ... then the asked keys
    labels = torch.full_like(tokens, -100)
    labels[:, 2 * pairs:] = values.gather(1, asked)
    length = tokens.shape[1]
    return tokens.flatten(), torch.arange(seqs + 1, dtype=torch.int32) * length, labels.flatten()


def token_stream(path: str, tokenizer_dir: str | None = None, dtype: str = "int32") -> torch.Tensor:
    """A user's tokens as one 1-D int64 stream: a .npy array of token ids (any integer dtype, any
    shape: read in order), a .bin file of raw little-endian ids of `dtype` (int32, uint16 or
    uint32), or a .jsonl file of {"text": ...} lines encoded with the tokenizer.json found in
    tokenizer_dir (the checkpoint's directory), documents joined in order."""
    if path.endswith(".npy"):
        import numpy as np

        return torch.from_numpy(np.load(path).astype("int64").reshape(-1))
    if path.endswith(".bin"):
        import numpy as np

        if dtype not in ("int32", "uint16", "uint32"):
            raise SystemExit(f"--data-dtype must be int32, uint16 or uint32, got {dtype!r}")
        return torch.from_numpy(np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<")).astype("int64"))
    if path.endswith(".jsonl"):
        tokenizer_file = os.path.join(tokenizer_dir or "", "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise SystemExit(f"--data {path}: a .jsonl of texts needs {tokenizer_file} (pass --init-from a checkpoint "
                             "directory that holds one)")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_file)
        ids = []
        with open(path) as f:
            for line in f:
                if line.strip():
                    ids += tokenizer.encode(json.loads(line)["text"]).ids
        return torch.tensor(ids, dtype=torch.int64)
    raise SystemExit(f"--data {path}: expected a .npy, .bin or .jsonl file")


def stream_batch(stream: torch.Tensor, seqs: int, seq_len: int, step: int, rank: int, world: int):
    """Step `step`'s sequences of this rank: consecutive windows of seq_len tokens (wrapping
    around the stream), labels the next token within each window (its last one unlabelled)."""
    if stream.numel() < seq_len:
        raise SystemExit(f"--data holds {stream.numel()} tokens, fewer than --seq-len {seq_len}")
    windows = stream.numel() // seq_len
    first = ((step * world + rank) * seqs) % windows
    rows = [(first + i) % windows for i in range(seqs)]
    tokens = torch.stack([stream[r * seq_len:(r + 1) * seq_len] for r in rows])
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    return tokens.flatten(), torch.arange(seqs + 1, dtype=torch.int32) * seq_len, labels.flatten()


def cp_layout(world: int, rank: int, ep: int, cp: int):
    """(this rank's context-parallel group or None, the batch it shares, the number of batches):
    the ranks of the (dp, ep) mesh (rank = dp index * ep + ep index) with the same ep index and
    dp indices in one block of cp hold one batch between them. Every rank creates every group."""
    if cp == 1:
        return None, rank, world
    dp_index, ep_index = divmod(rank, ep)
    mine = None
    for block in range(world // ep // cp):
        for e in range(ep):
            group = dist.new_group([(block * cp + i) * ep + e for i in range(cp)])
            if (block, e) == (dp_index // cp, ep_index):
                mine = group
    return mine, dp_index // cp * ep + ep_index, world // cp


def parse_args(argv=None):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(prog="python -m kda_dsa_ops.train", description=__doc__, formatter_class=Formatter)
    p.add_argument("--config", default="tiny", choices=["tiny", "small"],
                   help="HybridConfig preset (k3-2.8t, the full-size shapes, is for kda_dsa_ops.plan only)")
    p.add_argument("--backend", choices=["native", "reference"], default="native", help="kernels or reference ops")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides the experts and world size)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree: each batch split along T over this many ranks (divides world / ep)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="with --ep: split each MoE layer's tokens so that all-to-all overlaps expert compute")
    p.add_argument("--lora-rank", type=int, default=0, help="0: train every parameter; > 0: LoRA adapters only")
    p.add_argument("--init-from", default=None,
                   help="checkpoint to start from: one of ours, or a directory with a config.json (kimi_linear, "
                        "deepseek_v32, glm5_next, kda_dsa_ops), whose shapes then replace --config")
    p.add_argument("--data", default=None,
                   help="train on these tokens (.npy / .bin of token ids, or .jsonl of texts with the tokenizer.json "
                        "of --init-from) instead of the recall task")
    p.add_argument("--data-dtype", default="int32", help="element type of a .bin --data file (int32, uint16, uint32)")
    p.add_argument("--seq-len", type=int, default=512, help="with --data: tokens per sequence")
    p.add_argument("--recompute", choices=HybridModel.RECOMPUTE, default="none",
                   help="recompute attention or whole blocks in the backward instead of keeping activations")
    p.add_argument("--offload", action="store_true", help="keep saved activations in pinned host memory")
    p.add_argument("--task", choices=["base", "shifted"], default="base", help="key/value vocabulary of the task")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seqs", type=int, default=32, help="sequences per rank and step")
    p.add_argument("--pairs", type=int, default=4, help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=4, help="asked keys per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="raise the learning rate linearly to --lr over this many steps (0: constant)")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the global gradient norm to this (0: no clipping; the norm is reported either way)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--checkpoint-every", type=int, default=0, help="0: only at the end")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--out", default="runs/train", help="directory for checkpoints, the log and the loss curve")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present")
    return p.parse_args(argv)


def _expert_key(key: str, tag: str) -> str:
    """Experts are local slices under EP: each rank's own entry in the checkpoint."""
    return f"{key}@{tag}" if is_expert_param(key) else key


def _state(model, opt, tag: str, include_frozen: bool):
    options = StateDictOptions(ignore_frozen_params=not include_frozen)
    if opt is None:
        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    else:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
    model_sd = {_expert_key(k, tag): v for k, v in model_sd.items()}
    if optim_sd is not None:
        optim_sd = dict(optim_sd, state={_expert_key(k, tag): v for k, v in optim_sd["state"].items()})
    return model_sd, optim_sd


def _unrename(sd: dict, tag: str) -> dict:
    return {k.removesuffix(f"@{tag}"): v for k, v in sd.items()}


MANIFEST = "manifest.json"  # {file: SHA-256} of every file of a complete checkpoint


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _dcp(call, *args, **kwargs):
    """dcp.save or dcp.load; in a single process as such (no_dist), without DCP's warning that it
    assumes one (which it gives even when told)."""
    single = not dist.is_initialized()
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return call(*args, no_dist=single, **kwargs)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(path: str, model, opt, step: int, tag: str) -> None:
    """Writes the checkpoint into <path>.partial, records each file's SHA-256 in its manifest, then
    puts it in path's place: the previous checkpoint moves to <path>.previous first and is removed
    only once the new one is in place, so a crash at any moment leaves a complete checkpoint at
    path or at <path>.previous (complete_checkpoint finds it)."""
    lora = model.lora_rank > 0  # LoRA checkpoints: adapters only
    model_sd, optim_sd = _state(model, opt, tag, include_frozen=not lora)
    staging, previous = f"{path}.partial", f"{path}.previous"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and os.path.isdir(staging):
        shutil.rmtree(staging)  # what a crash mid-save left
    _barrier()
    _dcp(dcp.save, {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=staging)
    _barrier()
    if rank0:
        files = sorted(f for f in os.listdir(staging) if f != MANIFEST)
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump({name: _digest(os.path.join(staging, name)) for name in files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(path):
            if os.path.isdir(previous):
                shutil.rmtree(previous)
            os.rename(path, previous)
        os.rename(staging, path)
        if os.path.isdir(previous):
            shutil.rmtree(previous)
    _barrier()


def verify_checkpoint(path: str) -> None:
    """Every file the manifest lists is there with its recorded SHA-256 (SystemExit naming the
    damaged file otherwise)."""
    manifest = os.path.join(path, MANIFEST)
    try:
        with open(manifest) as f:
            digests = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"checkpoint {path} is incomplete or damaged: {MANIFEST} unreadable ({err})") from None
    for name, digest in digests.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or _digest(file) != digest:
            raise SystemExit(f"checkpoint {path} is damaged: {file} is missing or does not match the SHA-256 "
                             f"recorded when it was saved")


def complete_checkpoint(path: str) -> str | None:
    """path, or the <path>.previous a crash mid-save left, whichever holds a complete checkpoint."""
    for candidate in (path, f"{path}.previous"):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
    return None


def _check_expert_layout(path: str, saved: set, tag: str) -> None:
    """The experts' split over ranks (the @ep<r>of<n> of their keys) is this run's (SystemExit
    naming the --ep the checkpoint was saved with otherwise)."""
    layouts = {int(m.group(1)) for m in (re.search(r"@ep\d+of(\d+)$", k) for k in saved) if m}
    ours = int(tag.rsplit("of", 1)[1])
    if layouts and layouts != {ours}:
        raise SystemExit(f"checkpoint {path} was saved with --ep {min(layouts)} (its experts split over that many "
                         f"ranks); this run has --ep {ours}: run it with --ep {min(layouts)}")


def load_checkpoint(path: str, model, opt, tag: str) -> int:
    """Restores what the checkpoint holds (model, and optimizer when opt is given), its files first
    checked against the manifest; returns its step."""
    verify_checkpoint(path)
    model_sd, optim_sd = _state(model, opt, tag, include_frozen=True)
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    _check_expert_layout(path, saved, tag)
    model_sd = {k: v for k, v in model_sd.items() if f"model.{k}" in saved}
    state = {"model": model_sd, "step": torch.tensor(0)}
    if opt is not None:
        state["optim"] = optim_sd
    _dcp(dcp.load, state, checkpoint_id=path)
    options = StateDictOptions(strict=False)
    if opt is None:
        set_model_state_dict(model, _unrename(state["model"], tag), options=options)
    else:
        set_state_dict(model, opt, model_state_dict=_unrename(state["model"], tag),
                       optim_state_dict=dict(state["optim"], state=_unrename(state["optim"]["state"], tag)),
                       options=options)
    return int(state["step"])


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def plot_losses(history: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no loss curve ({path}): matplotlib is not installed (pip install matplotlib); the history is in "
              "log.json", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(title)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="loss")
    ax2 = ax.twinx()
    ax2.plot([h["step"] for h in history], [h["recall"] for h in history], color="tab:orange", label="recall")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2.set_ylabel("recall")
    fig.legend(loc="center right", bbox_to_anchor=(0.88, 0.5))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def warmup_lr(step: int, lr: float, warmup_steps: int) -> float:
    """The learning rate of 0-based step `step`: lr * (step + 1) / warmup_steps during the warmup,
    lr after it. A function of the step alone, so a resumed run continues the same schedule."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else lr


def check_args(args) -> None:
    """Flags no run could use, rejected before any work, each named."""
    problems = []
    for flag in ("steps", "seqs", "pairs", "queries", "seq_len", "log_every", "micro_batches", "ep", "cp"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("lora_rank", "checkpoint_every", "warmup_steps"):
        if getattr(args, flag) < 0:
            problems.append(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.queries > args.pairs:
        problems.append(f"--queries ({args.queries}) cannot exceed --pairs ({args.pairs}): a sequence asks only for "
                        "keys it lists")
    if not 0 < args.lr < float("inf"):
        problems.append(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.max_grad_norm < float("inf"):
        problems.append(f"--max-grad-norm must be a finite number >= 0, got {args.max_grad_norm}")
    if problems:
        raise SystemExit("bad arguments: " + "; ".join(problems))


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_args(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hf_init = bool(args.init_from) and os.path.isfile(os.path.join(args.init_from, "config.json"))
    try:
        cfg = onboard.read_config(args.init_from) if hf_init else get_config(args.config, capacity_factor=None)
    except onboard.CheckpointError as err:
        raise SystemExit(f"--init-from {args.init_from}: {err}") from None
    stream = token_stream(args.data, args.init_from if hf_init else None, args.data_dtype) if args.data else None
    if stream is not None and stream.numel() and int(stream.max()) >= cfg.vocab:
        raise SystemExit(f"--data has token id {int(stream.max())}, beyond the model's vocabulary of {cfg.vocab}")
    if stream is None and args.pairs > cfg.vocab // 4:
        raise SystemExit(f"--pairs ({args.pairs}) exceeds the {cfg.vocab // 4} keys the recall task draws from a "
                         f"vocabulary of {cfg.vocab}")
    try:
        check_layout(world, args.ep, cfg.experts)  # before any process group or model exists
    except ValueError as err:
        raise SystemExit(f"bad layout: {err} (launch with torchrun --nproc-per-node <a multiple of ep>)") from None
    if (world // args.ep) % args.cp:
        raise SystemExit(f"bad layout: --cp {args.cp} must divide the {world // args.ep} data-parallel ranks (world "
                         f"size {world} / ep {args.ep})")
    batch_tokens = args.seqs * (args.seq_len if stream is not None else 2 * args.pairs + args.queries)
    if batch_tokens % args.cp:
        raise SystemExit(f"--cp {args.cp} splits each batch's {batch_tokens} tokens into equal shares: make "
                         "--seqs times the sequence length a multiple of it")
    mesh = None
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = build_mesh(world, args.ep, cfg.experts, device.type)
    rank = dist.get_rank() if world > 1 else 0
    cp_group, data_rank, data_world = cp_layout(world, rank, args.ep, args.cp)
    tag = f"ep{mesh['ep'].get_local_rank()}of{args.ep}" if mesh is not None else "ep0of1"
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = HybridModel(cfg, lora_rank=args.lora_rank, backend=args.backend, recompute=args.recompute,
                        offload=args.offload).to(device)
    if mesh is not None:
        shard_experts(model, mesh, args.micro_batches)
    if hf_init:  # before FSDP: each rank reads the shared weights and only its own experts
        report = onboard.load(model, args.init_from, device.type)
        if rank == 0:
            print(report.text(), flush=True)
    if mesh is not None:
        apply_fsdp(model)
    if args.init_from and not hf_init:
        load_checkpoint(args.init_from, model, None, tag)
    opt = torch.optim.AdamW(optimizer_groups(model), lr=args.lr)
    os.makedirs(args.out, exist_ok=True)
    latest = os.path.join(args.out, "latest")
    resume_from = complete_checkpoint(latest) if args.resume else None
    start = load_checkpoint(resume_from, model, opt, tag) if resume_from else 0
    # On CUDA: fp32 master weights, products in bf16 (the CUDA grouped GEMM takes bf16/fp16).
    precision = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                 else contextlib.nullcontext())
    history = []
    tokens_seen, clock = 0, time.perf_counter()
    for step in range(start, args.steps):
        if stream is not None:
            tokens, cu, labels = stream_batch(stream, args.seqs, args.seq_len, step, data_rank, data_world)
        else:
            tokens, cu, labels = recall_batch(cfg.vocab, args.seqs, args.pairs, args.queries,
                                              seed=args.seed * 1_000_003 + step * 1009 + data_rank, task=args.task)
        tokens_seen += tokens.numel() * data_world
        cp = ContextParallel(cu, cp_group) if cp_group is not None else None
        if cp is not None:
            tokens, labels = cp.local(tokens), cp.local(labels)
        with precision:
            out = model(tokens.to(device), cu.to(device), labels.to(device), cp=cp)
        out["loss"].backward()
        stats = torch.stack([out["loss"].detach().float(), out["accuracy"].float()])
        if world > 1:
            dist.all_reduce(stats)
            stats /= world
        if not torch.isfinite(stats[0]):  # every rank sees the mean: all stop here, before the update
            raise SystemExit(f"step {step + 1}: the loss is not finite (on at least one rank); stopped before "
                             f"the optimizer step (checkpoints in {args.out} hold the last good weights)")
        if mesh is not None:
            reduce_expert_gradients(model, mesh)
        grad_norm = clip_grad_norm(model, args.max_grad_norm, mesh)
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, args.lr, args.warmup_steps)
        opt.step()
        opt.zero_grad()
        model.update_router_biases()
        load = next(b.mlp for b in model.blocks if b.ffn_kind == "M").expert_load
        record = {"step": step + 1, "loss": stats[0].item(), "recall": stats[1].item(), "grad_norm": grad_norm}
        history.append(record)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            elapsed = time.perf_counter() - clock
            print(f"step {step + 1:>5}/{args.steps}  loss {record['loss']:.4f}  recall {record['recall']:.3f}  "
                  f"grad norm {grad_norm:.3g}  "
                  f"{tokens_seen / elapsed:,.0f} tok/s  expert load max/mean {(load.max() / load.mean()).item():.2f}  "
                  f"peak {peak_memory_mb(device):,.0f} MB", flush=True)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(latest, model, opt, step + 1, tag)
    final = os.path.join(args.out, "final")
    save_checkpoint(final, model, opt, args.steps, tag)
    if rank == 0:
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump({"args": vars(args), "history": history}, f, indent=1)
        name = os.path.basename(os.path.normpath(args.init_from)) if hf_init else args.config
        what = f"LoRA rank {args.lora_rank}" if args.lora_rank else "every parameter"
        data = os.path.basename(args.data) if args.data else f"the {args.task} recall task"
        plot_losses(history, os.path.join(args.out, "loss.png"), f"{name}: {what} on {data}")
    if world > 1:
        dist.destroy_process_group()
    return {"history": history}


if __name__ == "__main__":
    main()
