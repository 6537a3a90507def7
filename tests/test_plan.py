"""The parallel-plan search and memory planner: its arithmetic for one plan by hand, its
activation count (meta device) against a real forward, the source material's plan (FSDP2 + EP64
on 128 devices, LoRA on the 2.8 T model) fitting, and no plan with expert holes."""

import torch

from kda_dsa_ops import plan as P
from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.nn import layers
from kda_dsa_ops.parallel import is_expert_param
from kda_dsa_ops.plan import (Cluster, block_activation_bytes, evaluate, parameter_counts, saved_bytes, search,
                              step_flops)


def test_one_plan_by_hand():
    cfg = get_config("tiny")
    cluster = Cluster(devices=4, memory_gb=1.0, link_gbps=100.0, tflops=10.0, efficiency=0.5)
    p = evaluate(cfg, cluster, ep=2, tokens=64, recompute="none", offload=False, lora_rank=0)
    model = HybridModel(cfg)
    params = sum(q.numel() for q in model.parameters())
    experts = sum(q.numel() for n, q in model.named_parameters() if is_expert_param(n))
    unit = max(sum(q.numel() for n, q in b.named_parameters() if not is_expert_param(n)) for b in model.blocks)
    act = block_activation_bytes(cfg, 64, 0, "none")
    copies = 64 * cfg.moe_topk
    assert p.dp == 2
    assert p.memory == {
        "weights (bf16, sharded)": params * 2 / 4,
        "gathered FSDP unit + local experts": (2 * unit + experts / cfg.layers / 2) * 2,
        "trainable state": params * 16 / 4,                      # lora 0: everything trains
        "activations": 3 * act["K"] + act["D"],                   # KKKD, every block's activations kept
        "all-to-all buffers": 4 * copies * cfg.latent * 2,
    }
    assert p.a2a_bytes == cfg.layers * 4 * copies * cfg.latent * 2 / 2  # half the copies leave the rank
    active = params - experts + experts * cfg.moe_topk / cfg.experts
    compute = 6 * active * 64 / (10e12 * 0.5)
    gathered = (params - experts) * 2 * 3 / 4 + experts / 2 * 2 * 1 / 2
    fsdp = (2 * gathered + params * 4 * 3 / 4) / 100e9
    assert abs(p.step_s - (max(compute, fsdp) + p.a2a_bytes / 100e9)) < 1e-12
    assert p.fits == (p.total <= 1e9)


def test_offloaded_recompute_counts_the_block_in_its_backward():
    """Recompute with offload: two blocks' saved inputs on the device (the one in its backward and
    the one prefetched) plus the recomputed block's full activations, which offload does not move."""
    cfg = get_config("tiny")
    cluster = Cluster(devices=1, memory_gb=1.0, link_gbps=100.0, tflops=10.0, efficiency=0.5)
    for recompute in ("attention", "block"):
        p = evaluate(cfg, cluster, ep=1, tokens=64, recompute=recompute, offload=True, lora_rank=0)
        saved = block_activation_bytes(cfg, 64, 0, recompute)
        full = block_activation_bytes(cfg, 64, 0, "none")
        pairs = [saved[a] + saved[b] for a, b in zip(cfg.kinds(), cfg.kinds()[1:])]
        assert p.memory["activations"] == max(pairs) + full[cfg.kinds()[0]], recompute


def test_a_context_parallel_plan_by_hand():
    """cp 4: a share's activations plus the MLA layers' gathered key rows, the share's all-to-all,
    and per layer the KDA pairs / the MLA key rows of the other shares each way."""
    cfg = get_config("tiny")
    cluster = Cluster(devices=8, memory_gb=1.0, link_gbps=100.0, tflops=10.0, efficiency=0.5)
    p = evaluate(cfg, cluster, ep=2, tokens=256, recompute="none", offload=False, lora_rank=0, cp=4)
    assert (p.dp, p.share) == (1, 64)
    act = block_activation_bytes(cfg, 64, 0, "none")
    rows = (cfg.dsa_kv_rank + cfg.dsa_rope_dim + cfg.index_dim) * 2  # a D layer's key row, bf16
    assert p.memory["activations"] == 3 * act["K"] + act["D"] + (256 - 64) * rows
    assert p.memory["all-to-all buffers"] == 4 * 64 * cfg.moe_topk * cfg.latent * 2
    pair = cfg.kda_value_heads * cfg.kda_head_dim * 2 * cfg.kda_head_dim * 4  # [HV, K, 2K] fp32 (K = V)
    assert p.cp_bytes == 3 * 2 * 3 * pair + 2 * 3 * 64 * rows
    one = evaluate(cfg, cluster, ep=2, tokens=256, recompute="none", offload=False, lora_rank=0)
    assert one.cp_bytes == 0 and one.memory["activations"] > p.memory["activations"]


def test_context_parallelism_fits_a_sequence_one_device_cannot():
    """A 256k-token sequence of `small` with every activation kept: 222 GB on one device, 28 GB a
    device over eight."""
    cfg = get_config("small")
    cluster = Cluster(devices=8, memory_gb=40, link_gbps=400)
    plans = [p for p in search(cfg, cluster, lora_rank=16, seq_lens=[262144], cps=(1, 3, 8))
             if p.recompute == "none" and not p.offload]
    assert {p.cp for p in plans} == {1, 8}  # 3 divides neither the sequence nor the 8 ranks
    one, eight = [p.fits for p in plans if p.cp == 1], [p.fits for p in plans if p.cp == 8]
    assert len(one) == 4 and len(eight) == 1  # ep 1, 2, 4, 8; cp 8 leaves ep 1 only (cp divides devices / ep)
    assert not any(one) and all(eight)


def test_step_flops_by_part():
    """MFU's numerator: matrices linear in the tokens (weight gradients only for what trains),
    KDA linear, dense attention quadratic, sparse attention over min(topk, t + 1) keys per query."""
    cfg = get_config("tiny", pattern="KAD")  # dsa_topk 64
    one, two, lora = step_flops(cfg, 0, [64]), step_flops(cfg, 0, [128]), step_flops(cfg, 4, [64])
    assert one["matrices weight gradients"] == one["matrices forward"] == one["matrices input gradients"]
    assert 0 < lora["matrices weight gradients"] < 0.5 * lora["matrices forward"]  # the adapters only
    assert lora["matrices forward"] > one["matrices forward"]  # the adapters' products come on top
    assert lora["indexer backward"] == 0 < one["indexer backward"]  # a frozen indexer needs no backward
    for part in ("matrices forward", "KDA forward", "KDA backward"):
        assert two[part] == 2 * one[part]
    assert two["dense attention forward"] == one["dense attention forward"] * (128 * 129) / (64 * 65)
    assert two["sparse attention forward"] == one["sparse attention forward"] * (2080 + 64 * 64) / 2080
    assert one["KDA backward"] == 2 * one["KDA forward"] and one["dense attention backward"] == 2.5 * one[
        "dense attention forward"]
    K = cfg.kda_head_dim
    assert cfg.kinds() == ["K", "A", "D", "K"]
    assert one["KDA forward"] == 2 * 64 * cfg.kda_value_heads * (2 * 64 * K * 5 + 2 * K * K * 3)


def test_meta_activation_count_matches_a_real_forward():
    """Block by block, what the meta count says a block saves is what a real forward (CPU) saves;
    for a dense attention block, with torch's math attention (what the CPU runs) swapped for the
    fused kernel's saves (what a GPU runs), which the planner counts."""
    cfg = get_config("tiny")
    torch.manual_seed(0)
    model = HybridModel(cfg).to(torch.bfloat16)
    T = 48
    cu, pos = torch.tensor([0, T], dtype=torch.int32), torch.arange(T)
    x = torch.randn(T, cfg.hidden, dtype=torch.bfloat16, requires_grad=True)

    def attention(device):  # one sequence through layers.attend, as the dense block calls it
        q, k = (torch.zeros(T, cfg.dsa_heads, cfg.dsa_nope_dim + cfg.dsa_rope_dim, dtype=torch.bfloat16,
                            device=device, requires_grad=True) for _ in range(2))
        v = torch.zeros(T, cfg.dsa_heads, cfg.dsa_v_dim, dtype=torch.bfloat16, device=device, requires_grad=True)
        return saved_bytes(lambda: layers.attend(q, k, v, scale=0.1, is_causal=True), [])

    with P.fused_attention():
        fused = attention("meta")
    swap = fused - attention("cpu")
    assert swap < 0  # the math path saves the [H, T, T] probabilities
    for recompute in HybridModel.RECOMPUTE:
        meta = block_activation_bytes(cfg, T, 0, recompute)
        for block in model.blocks:
            real = saved_bytes(lambda: block(x, cu, pos, model.backend, recompute), list(model.parameters()))
            attended = block.kind == "A" and recompute == "none"  # (recomputed attention saves nothing inside)
            assert real + (swap if attended else 0) == meta[block.kind], (recompute, block.kind)


def test_the_source_plan_fits():
    """FSDP2 + EP64 on 128 devices of 141 GB, LoRA fine-tuning of the 2.8 T model."""
    cfg = get_config("k3-2.8t")
    counts = parameter_counts(cfg, 16)
    assert 2.7e12 < counts.params < 2.9e12 and counts.trainable < 1e9
    cluster = Cluster(devices=128, memory_gb=141, link_gbps=400)
    plans = search(cfg, cluster, lora_rank=16, seq_lens=[8192])
    ep64 = [p for p in plans if p.ep == 64 and p.fits]
    assert ep64, "FSDP2 + EP64 on 128 x 141 GB must fit"
    assert all(p.dp == 2 for p in ep64)


def test_no_plan_has_expert_holes():
    cfg = get_config("tiny")  # 8 experts
    plans = search(cfg, Cluster(devices=6, memory_gb=100, link_gbps=10), lora_rank=0, seq_lens=[32])
    assert {p.ep for p in plans} == {1, 2}  # 3 and 6 would leave expert holes


def test_cli_prints_the_ranked_plans(capsys):
    P.main(["--config", "tiny", "--devices", "2", "--memory-gb", "1", "--seq-lens", "32", "--top", "3"])
    out = capsys.readouterr().out
    assert "plans without expert holes" in out and "fits" in out
