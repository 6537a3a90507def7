"""Expert parallelism + FSDP2 on CPU (gloo): the model split over a (dp, ep) mesh of processes,
each with its own tokens, experts split over ep and everything else sharded by FSDP2, gives the
single-process loss and gradients (float64, no capacity drops); bad layouts fail before any work.
Context parallelism on CPU (gloo): one packed batch split along T over 2 or 4 processes gives the
single-process loss and gradients."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.parallel import (ContextParallel, apply_fsdp, build_mesh, clip_grad_norm, is_expert_param,
                                  optimizer_groups, reduce_expert_gradients, shard_experts)

from tolerances import MODEL_REL_RMS, assert_close

F64 = torch.float64
SEQ_LEN, SEQS_PER_RANK = 24, 2


def make_model(lora_rank, **overrides):
    torch.manual_seed(0)
    cfg = get_config("tiny", **{"capacity_factor": None, "dsa_topk": 16, **overrides})
    return HybridModel(cfg, lora_rank=lora_rank).double(), cfg


def batch(cfg, first_seq, seqs):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab, (64, SEQ_LEN), generator=g)[first_seq:first_seq + seqs]
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    cu = torch.arange(seqs + 1, dtype=torch.int32) * SEQ_LEN
    return tokens.flatten(), cu, labels.flatten()


def step(model, cfg, first_seq, seqs):
    model.zero_grad()
    loss = model(*batch(cfg, first_seq, seqs))["loss"]
    loss.backward()
    return loss


def _worker(rank, world, ep, lora_rank, init_file, out_dir, micro_batches=1):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, cfg = make_model(lora_rank)
    mesh = build_mesh(world, ep, cfg.experts)
    shard_experts(model, mesh, micro_batches)
    apply_fsdp(model)
    assert type(model.embed.weight).__name__ == "DTensor"  # sharded by FSDP2
    loss = step(model, cfg, rank * SEQS_PER_RANK, SEQS_PER_RANK)
    reduce_expert_gradients(model, mesh)
    dist.all_reduce(loss.detach())
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone())
             for n, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm(model, 0.0, mesh)  # the norm only
    clip_grad_norm(model, norm / 2, mesh)
    norm_after = clip_grad_norm(model, 0.0, mesh)
    torch.save({"loss": loss.detach() / world, "grads": grads, "ep_rank": mesh["ep"].get_local_rank(),
                "norm": norm, "norm_after": norm_after}, os.path.join(out_dir, f"rank{rank}.pt"))
    # a foreach optimizer step over sharded (DTensor) and local (expert) parameters together
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    torch.optim.AdamW(optimizer_groups(model), lr=1e-3, foreach=True).step()
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params) if p.grad is not None)
    dist.destroy_process_group()


@pytest.mark.parametrize("world, ep, lora_rank, micro_batches", [(2, 2, 0, 1), (4, 2, 0, 1), (2, 2, 4, 1),
                                                                   (2, 2, 0, 2)])
def test_expert_parallel_matches_single_process(world, ep, lora_rank, micro_batches):
    """micro_batches = 2: the dispatch of the second half travels while the experts compute the first."""
    model, cfg = make_model(lora_rank)
    loss = step(model, cfg, 0, world * SEQS_PER_RANK)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, ep, lora_rank, os.path.join(out_dir, "init"), out_dir, micro_batches),
                 nprocs=world)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    assert_close(ranks[0]["loss"], loss, F64, "loss", table=MODEL_REL_RMS)
    norm = clip_grad_norm(model, 0.0)
    assert norm == pytest.approx(torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt().item())
    for r in ranks:  # the global gradient norm, and clipping to half of it
        assert r["norm"] == pytest.approx(norm, rel=1e-9)
        assert r["norm_after"] == pytest.approx(norm / 2, rel=1e-5)
    local = cfg.experts // ep
    for name, g in grads.items():
        for r in ranks:
            expected = g[r["ep_rank"] * local:(r["ep_rank"] + 1) * local] if is_expert_param(name) else g
            assert_close(r["grads"][name], expected, F64, f"{name} (ep rank {r['ep_rank']})", table=MODEL_REL_RMS)
    if lora_rank:
        assert grads and all("lora_" in n for n in grads)


def test_bad_layouts_fail_before_any_work():
    with pytest.raises(ValueError, match=r"world size \(3\) must be a multiple of ep \(2\)"):
        build_mesh(3, 2, 8)
    with pytest.raises(ValueError, match=r"experts \(8\) must be divisible by ep \(3\)"):
        build_mesh(3, 3, 8)


CP_SEQS = [40, 7, 0, 61, 20]  # 128 tokens: across two shares, inside one, empty, across three (cp 4)
CP_CASES = {"kda+sparse": {}, "kda+dense+mhc": {"pattern": "KAD", "index_pattern": "FS", "hc_mult": 2},
            "deepseek indexer": {"pattern": "DK", "index_style": "deepseek", "dsa_topk": 8},
            "k-pooled indexer": {"pattern": "DK", "index_style": "deepseek", "dsa_topk": 8, "index_kpool": 4,
                                 "kda_lower_bound": -5.0},
            "images": {"image_size": 16, "patch": 8}}


def cp_batch(cfg):
    """tokens, cu_seqlens, labels and (with an image front end) images: two images of 4 tokens in
    the two sequences [6 text, image, 10 text] [3 text, image, 5 text], split by the shares' bounds
    at 4 ranks."""
    g = torch.Generator().manual_seed(99)
    lens = [20, 12] if cfg.image_size else CP_SEQS
    tokens = torch.randint(0, cfg.vocab - 1, (sum(lens),), generator=g)
    images = None
    if cfg.image_size:
        tokens[6:10] = tokens[23:27] = cfg.image_token
        images = torch.rand(2, cfg.channels, cfg.image_size, cfg.image_size, generator=g, dtype=F64)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    labels = torch.roll(tokens, -1)
    labels[cu[1:].long() - 1] = -100  # no label across a sequence's end
    labels[:5] = -100  # and shares with fewer labels than others
    return tokens, cu, labels, images


def _cp_worker(rank, world, case, lora_rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, cfg = make_model(lora_rank, **CP_CASES[case])
    tokens, cu, labels, images = cp_batch(cfg)
    cp = ContextParallel(cu)
    out = model(cp.local(tokens), cu, cp.local(labels), images, cp=cp)
    out["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for t in [out["loss"].detach(), *grads.values()]:  # the mean over the ranks, as data parallelism takes it
        dist.all_reduce(t)
        t /= world
    torch.save({"loss": out["loss"].detach(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world, case, lora_rank", [(2, "kda+sparse", 0), (4, "kda+sparse", 4),
                                                    (4, "kda+dense+mhc", 0), (2, "deepseek indexer", 4),
                                                    (4, "k-pooled indexer", 0), (4, "images", 0)])
def test_context_parallel_matches_single_process(world, case, lora_rank):
    """KDA states, the short convolutions' halos and the MLA / indexer keys (GLM-5.3's pools and
    bounded decay included) cross the shares' bounds, and images' tokens land in the shares their
    placeholders are in; the mean of the ranks' losses and gradients is the unsplit batch's
    (float64)."""
    model, cfg = make_model(lora_rank, **CP_CASES[case])
    tokens, cu, labels, images = cp_batch(cfg)
    loss = model(tokens, cu, labels, images)["loss"]
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_cp_worker, args=(world, case, lora_rank, os.path.join(out_dir, "init"), out_dir), nprocs=world)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    assert_close(ranks[0]["loss"], loss, F64, "loss", table=MODEL_REL_RMS)
    assert set(ranks[0]["grads"]) == set(grads) and (not lora_rank or all("lora_" in n for n in grads))
    for name, g in grads.items():
        assert_close(ranks[0]["grads"][name], g, F64, name, table=MODEL_REL_RMS)
