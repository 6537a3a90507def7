"""DSA benchmarks on the GPU (docs/benchmarks.md shapes), each beside the PyTorch composition a user would
otherwise write, measured in the same run; the outputs are compared before timing.

LI       T = Tk = 8192, Hi = 64, Di = 128, topk = 2048, causal: fused scoring + top-k vs chunked
         einsum + ReLU + weighted sum + masked topk; the backward vs autograd of the same.
SFA      T = 4096, Tk = 8192, H = 64 and 128, Dqk = 576, dv = 512 (MLA), topk = 2048, gated: forward
         and backward (SFAG, atomic and deterministic dkv) vs gather + einsum + softmax in chunks.
heads    the same shape at H = 8, 16, 32, 64, 128 (MLA 576/512) and GLM-5.3's NoPE 512/512 at H = 16
         and 64: SFA forward and SFAG TFLOP/s, random index sets (the small head counts' share of H 64).
gqa      4 kv heads of 128 / 128 with G = 8, 16, 32, 64, 128 query heads each, random index sets, and
         at G = 8, 16, 32 sets from a window and with shared keys: SFA forward and SFAG TFLOP/s (each
         case's share of G 64 on random sets).
model    index sets a checkpoint's indexers chose over a text (bench/index_sets.py records them): H = 8
         .. 128 (MLA 576/512) and GQA 4 x G = 8 .. 64 (128/128), SFA forward and SFAG TFLOP/s beside
         64 heads' on the same sets.
shared   GLM-5.3-Flash's sparse attention layer (its layer group's config), 8192 tokens, forward +
         backward: with its own indexer and as a shared-indexer layer (the indices of an earlier one).

    python bench/bench_dsa.py [--quick] [--parts li sfa heads gqa model shared] [--index-sets FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import os

import torch

import kda_dsa_ops as K
from common import Result, bench_ms, measure_ceilings, rel_rms, write_results
from index_sets import drawn_sets, load, union_share

BF16 = torch.bfloat16
CHUNK = 512  # queries per chunk of the compositions (their [chunk, topk, D] gathers must fit)


def torch_indexer(q, k, w, topk):
    """Causal single-sequence indexer as a chunked composition: [chunk, Tk] scores at a time."""
    T, Tk = q.shape[0], k.shape[0]
    idx, sc = [], []
    keys = torch.arange(Tk, device=q.device)
    for t0 in range(0, T, CHUNK):
        qc, wc = q[t0:t0 + CHUNK], w[t0:t0 + CHUNK]
        s = torch.einsum("thd,sd->ths", qc, k).relu_()
        s = torch.einsum("ths,th->ts", s.float(), wc.float())
        rows = torch.arange(t0, t0 + qc.shape[0], device=q.device)
        s = s.masked_fill(keys[None, :] > rows[:, None] + (Tk - T), float("-inf"))
        top = s.topk(topk, dim=-1)
        idx.append(torch.where(torch.isfinite(top.values), top.indices, -1).int())
        sc.append(top.values)
    return torch.cat(idx), torch.cat(sc)


def torch_sparse_attn(q, kv, idx, scale, dv, gate):
    """MLA sparse attention as a chunked composition (gather the selected rows, dense softmax)."""
    outs = []
    for t0 in range(0, q.shape[0], CHUNK):
        ic = idx[t0:t0 + CHUNK, 0]
        sel = kv[:, 0][ic.clamp(min=0).long()]                       # [c, topk, Dqk]
        logits = torch.einsum("thd,tsd->ths", q[t0:t0 + CHUNK], sel).float() * scale
        logits = logits.masked_fill((ic < 0)[:, None, :], float("-inf"))
        p = torch.softmax(logits, -1).to(q.dtype)
        o = torch.einsum("ths,tsd->thd", p, sel[..., :dv])
        outs.append(o * torch.sigmoid(gate[t0:t0 + CHUNK]))
    return torch.cat(outs)


def bench_indexer(quick: bool) -> list[Result]:
    T, Hi, Di, topk = (4096 if quick else 8192), 64, 128, 2048
    torch.manual_seed(0)
    q = torch.randn(T, Hi, Di, device="cuda", dtype=BF16)
    k = torch.randn(T, Di, device="cuda", dtype=BF16)
    w = torch.randn(T, Hi, device="cuda", dtype=BF16)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    idx, sc = K.lightning_indexer(q, k, w, cu, cu, topk)
    idx_ref, sc_ref = torch_indexer(q, k, w, topk)
    # The composition sums in a different order: scores agree to rounding, the selected sets
    # differ only where two scores are within rounding of each other at the cut.
    chosen = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda").scatter_(1, (idx_ref + 1).long(), True)
    agree = chosen.gather(1, (idx + 1).long()).float().mean().item()
    print(f"LI parity: scores rel RMS {rel_rms(sc.nan_to_num(neginf=0), sc_ref.nan_to_num(neginf=0)):.2e} "
          f"(the composition rounds q.k to bf16), {agree:.4f} of the selected keys also selected by the composition",
          flush=True)
    flops = 2 * T * T * Hi * Di / 2
    shape = dict(T=T, Tk=T, Hi=Hi, Di=Di, topk=topk)
    fwd = bench_ms(lambda: K.lightning_indexer(q, k, w, cu, cu, topk))
    base = bench_ms(lambda: torch_indexer(q, k, w, topk))
    results = [Result("dsa", f"LI fwd T{T}", shape, fwd, flops, 0.0, "torch chunked einsum+topk", base)]
    g = torch.randn(T, topk, device="cuda").masked_fill(idx < 0, 0)
    ops = torch.ops.kda_dsa_ops
    bwd = bench_ms(lambda: ops.lightning_indexer_bwd(q, k, w, idx, g))
    results.append(Result("dsa", f"LI bwd T{T}", shape, bwd, 3 * 2 * T * topk * Hi * Di, 0.0))
    for r in results:
        print(f"{r.name}: {r.ms:.3f} ms, {r.tflops():.0f} TFLOP/s" +
              (f", composition {r.baseline_ms:.3f} ms ({r.speedup():.1f}x)" if r.baseline_ms else ""), flush=True)
    return results


def bench_attention(quick: bool) -> list[Result]:
    results = []
    T, Tk, Dqk, dv, topk = (2048 if quick else 4096), 8192, 576, 512, 2048
    scale = Dqk ** -0.5
    for H in ([64] if quick else [64, 128]):
        torch.manual_seed(0)
        q = torch.randn(T, H, Dqk, device="cuda", dtype=BF16)
        kv = torch.randn(Tk, 1, Dqk, device="cuda", dtype=BF16)
        gate = torch.randn(T, H, dv, device="cuda", dtype=BF16)
        # topk distinct keys per query (a causal pattern at the end of an 8192-key context)
        idx = torch.rand(T, Tk, device="cuda").topk(topk, dim=-1).indices.int()[:, None]
        o, lse, _ = K.sparse_attention(q, kv, idx, scale, dv, gate)
        o_ref = torch_sparse_attn(q, kv, idx, scale, dv, gate)
        print(f"SFA H{H} parity: o rel RMS vs composition {rel_rms(o, o_ref):.2e}", flush=True)
        shape = dict(T=T, Tk=Tk, H=H, Dqk=Dqk, dv=dv, topk=topk)
        ops = torch.ops.kda_dsa_ops
        fwd = bench_ms(lambda: ops.sparse_attn_fwd(q, kv, idx, scale, dv, gate, False))
        base = bench_ms(lambda: torch_sparse_attn(q, kv, idx, scale, dv, gate)) if H == 64 else 0.0
        results.append(Result("dsa", f"SFA fwd H{H}", shape, fwd, 2 * T * topk * H * (Dqk + dv), 0.0,
                              "torch gather+einsum+softmax" if base else "", base))
        do = torch.randn_like(o)
        bwd_flops = 2 * T * topk * H * (2 * dv + 3 * Dqk)
        for det in (False, True):
            ms = bench_ms(lambda: ops.sparse_attn_bwd(do, q, kv, idx, o, lse, scale, dv, gate, det))
            results.append(Result("dsa", f"SFAG H{H}{' deterministic' if det else ''}", shape, ms, bwd_flops))
        if H == 64:
            qg, kvg, gg = (t.detach().requires_grad_() for t in (q, kv, gate))
            base_fb = bench_ms(lambda: torch.autograd.grad(torch_sparse_attn(qg, kvg, idx, scale, dv, gg), (qg, kvg, gg), do))
            ours_fb = bench_ms(lambda: torch.autograd.grad(K.sparse_attention(qg, kvg, idx, scale, dv, gg)[0],
                                                           (qg, kvg, gg), do))
            results.append(Result("dsa", f"SFA fwd+bwd H{H}", shape, ours_fb,
                                  2 * T * topk * H * (Dqk + dv) + bwd_flops, 0.0, "torch composition + autograd",
                                  base_fb))
        del q, kv, gate, idx, o, lse, do
        torch.cuda.empty_cache()
    for r in results:
        print(f"{r.name}: {r.ms:.3f} ms, {r.tflops():.0f} TFLOP/s" +
              (f", composition {r.baseline_ms:.3f} ms ({r.speedup():.1f}x)" if r.baseline_ms else ""), flush=True)
    return results


# (H, Dqk, window, shared); dv 512. window: each query's keys drawn from the `window` keys up to its
# own position (a query t of the T at the end of the context sits at key Tk - T + t); None: from all
# Tk. shared: the share of its keys that a query has in common with the 64 / H queries of its packed
# block (drawn from the window before the block's first query; the rest its own, from the same
# window), the overlap a trained indexer gives neighbouring queries in some measure.
HEAD_CASES = [(8, 576, None, None), (16, 576, None, None), (32, 576, None, None), (64, 576, None, None),
              (128, 576, None, None), (16, 512, None, None), (64, 512, None, None), (8, 576, 4096, None),
              (16, 576, 4096, None), (32, 576, 4096, None), (8, 576, 4096, 0.5), (8, 576, 4096, 0.75),
              (8, 576, 4096, 0.9), (16, 576, 4096, 0.5), (16, 576, 4096, 0.75), (16, 576, 4096, 0.9)]


def case_inputs(T: int, Tk: int, kv_heads: int, G: int, Dqk: int, dv: int, device="cuda"):
    """A case's q [T, kv_heads G, Dqk], kv [Tk, kv_heads, Dqk] and gate [T, kv_heads G, dv]: random
    bf16 drawn after seeding 0 (index sets drawn next come from the same seed)."""
    torch.manual_seed(0)
    return (torch.randn(T, kv_heads * G, Dqk, device=device, dtype=BF16),
            torch.randn(Tk, kv_heads, Dqk, device=device, dtype=BF16),
            torch.randn(T, kv_heads * G, dv, device=device, dtype=BF16))


def sfa_calls(q, kv, idx, gate, deterministic: bool = False):
    """One case's SFA forward and SFAG (atomic or deterministic dkv), as two calls to time."""
    ops = torch.ops.kda_dsa_ops
    Dqk, dv = q.shape[-1], gate.shape[-1]
    scale = Dqk ** -0.5
    o, lse, _ = K.sparse_attention(q, kv, idx, scale, dv, gate)
    do = torch.randn_like(o)
    return (lambda: ops.sparse_attn_fwd(q, kv, idx, scale, dv, gate, False),
            lambda: ops.sparse_attn_bwd(do, q, kv, idx, o, lse, scale, dv, gate, deterministic))


def fwd_and_sfag(q, kv, idx, gate, label: str, shape: dict, extra: dict) -> list[Result]:
    """SFA forward and SFAG (atomic dkv) of one case, timed: "SFA fwd <label>", "SFAG <label>"; the
    FLOPs those of the entries with a key (-1: none)."""
    (_, H, Dqk), dv = q.shape, gate.shape[-1]
    pairs = int((idx >= 0).sum()) * (H // idx.shape[1])  # (query head, key) pairs
    fwd, bwd = (bench_ms(call) for call in sfa_calls(q, kv, idx, gate))
    return [Result("dsa", f"SFA fwd {label}", shape, fwd, 2 * pairs * (Dqk + dv), extra=extra),
            Result("dsa", f"SFAG {label}", shape, bwd, 2 * pairs * (2 * dv + 3 * Dqk), extra=extra)]


def print_beside(results: list[Result], layout, full) -> None:
    """Each result's TFLOP/s and its share of the same kind's (forward, SFAG) on the same layout(r)
    where full(r) (64 heads a kv head, random sets), with the packed block's union share where
    measured."""
    at = {(r.name.split(" ")[0], layout(r)): r.tflops() for r in results if full(r)}
    for r in results:
        key = (r.name.split(" ")[0], layout(r))
        share = f", {r.tflops() / at[key]:.0%} of 64 heads" if key in at and not full(r) else ""
        union = f", union {r.extra['union']:.2f}" if "union" in r.extra else ""
        print(f"{r.name}: {r.ms:.3f} ms, {r.tflops():.0f} TFLOP/s{share}{union}", flush=True)


def bench_heads() -> list[Result]:
    """SFA forward and SFAG (atomic dkv) at every head count of HEAD_CASES, T 4096, Tk 8192, topk 2048,
    gated, distinct keys per query drawn at random (from all keys, or from a window before the
    query: neighbouring queries then share more keys, or with a set share of their keys in common
    with their packed block's queries: index_sets.drawn_sets); each case's TFLOP/s printed beside its
    layout's H 64 on random sets. Below 64 heads the MLA kernels pack 64 / H queries a block: the
    share of the block's slots that its union keeps (1/group: every query chose the same keys; 1:
    no key shared) is printed with it."""
    T, Tk, dv, topk = 4096, 8192, 512, 2048
    results = []
    for H, Dqk, window, shared in HEAD_CASES:
        q, kv, gate = case_inputs(T, Tk, 1, H, Dqk, dv)
        idx = drawn_sets(T, Tk, topk, window, shared, max(64 // H, 1))
        shape = dict(T=T, Tk=Tk, H=H, Dqk=Dqk, dv=dv, topk=topk, window=window, shared=shared)
        sets = ("" if window is None else f" window {window}") + ("" if shared is None else f" shared {shared}")
        results += fwd_and_sfag(q, kv, idx, gate, f"H{H} {Dqk}/{dv}{sets}", shape,
                                {"union": round(union_share(idx, 64 // H), 3)} if H < 64 else {})
        del q, kv, gate, idx
        torch.cuda.empty_cache()
    print_beside(results, lambda r: r.shape["Dqk"], lambda r: r.shape["H"] == 64 and r.shape["window"] is None)
    return results


# (G, window, shared) of the gqa part, as in HEAD_CASES.
GQA_CASES = [(8, None, None), (16, None, None), (32, None, None), (64, None, None), (128, None, None),
             (8, 4096, None), (16, 4096, None), (32, 4096, None), (8, 4096, 0.9), (16, 4096, 0.9)]


def bench_gqa() -> list[Result]:
    """GQA on the mma.sync kernels: 4 kv heads of Dqk = dv = 128, G = 8 .. 128 query heads each, T 4096,
    Tk 8192, topk 2048 per kv head, gated, index sets as in bench_heads (each kv head its own): SFA
    forward and SFAG TFLOP/s beside G 64's on random sets. Below 64 the kernels pack 64 / G queries
    a block on each kv head: the union share is printed with it."""
    T, Tk, topk, Hkv, D = 4096, 8192, 2048, 4, 128
    results = []
    for G, window, shared in GQA_CASES:
        q, kv, gate = case_inputs(T, Tk, Hkv, G, D, D)
        idx = torch.cat([drawn_sets(T, Tk, topk, window, shared, max(64 // G, 1)) for _ in range(Hkv)], 1)
        shape = dict(T=T, Tk=Tk, Hkv=Hkv, G=G, Dqk=D, dv=D, topk=topk, window=window, shared=shared)
        sets = ("" if window is None else f" window {window}") + ("" if shared is None else f" shared {shared}")
        results += fwd_and_sfag(q, kv, idx, gate, f"GQA {Hkv}x{G} {D}/{D}{sets}", shape,
                                {"union": round(union_share(idx, 64 // G), 3)} if G < 64 else {})
        del q, kv, gate, idx
        torch.cuda.empty_cache()
    print_beside(results, lambda r: "gqa", lambda r: r.shape["G"] == 64 and r.shape["window"] is None)
    return results


def bench_model(path: str, layers: list[int] | None) -> list[Result]:
    """SFA forward and SFAG (atomic dkv) on index sets a checkpoint's indexer chose (bench/index_sets.py
    wrote them to path; T = Tk = the text's tokens, one causal sequence), of `layers` (default the
    first recorded): at H = 8 .. 128 in the MLA layout (576/512), and as GQA with 4 kv heads of 128 /
    128 (each given the layer's sets) at G = 8 .. 64; gated, random q, kv and gate. Each case's
    TFLOP/s beside 64 heads' on the same sets and layout, with the packed block's union share."""
    sets = load(path)
    Hkv, results = 4, []
    for layer in layers if layers is not None else [min(sets)]:
        if layer not in sets:
            raise SystemExit(f"{path}: no index sets of layer {layer} (it has layers {sorted(sets)})")
        idx = sets[layer].cuda()[:, None]
        T, topk = idx.shape[0], idx.shape[-1]
        cases = ([("mla", H, 1, 576, 512) for H in (8, 16, 32, 64, 128)] +
                 [("gqa", G, Hkv, 128, 128) for G in (8, 16, 32, 64)])
        for layout, G, kv_heads, Dqk, dv in cases:
            q, kv, gate = case_inputs(T, T, kv_heads, G, Dqk, dv)
            heads = idx.expand(T, kv_heads, topk).contiguous()
            shape = dict(T=T, Tk=T, Hkv=kv_heads, G=G, Dqk=Dqk, dv=dv, topk=topk, layer=layer, layout=layout,
                         sets=os.path.basename(path))
            label = f"H{G} {Dqk}/{dv}" if layout == "mla" else f"GQA {kv_heads}x{G} {Dqk}/{dv}"
            results += fwd_and_sfag(q, kv, heads, gate, f"{label} model layer {layer}", shape,
                                    {"union": round(union_share(heads, 64 // G), 3)} if G < 64 else {})
            del q, kv, gate, heads
            torch.cuda.empty_cache()
    print_beside(results, lambda r: (r.shape["layer"], r.shape["layout"]), lambda r: r.shape["G"] == 64)
    return results


def bench_shared() -> list[Result]:
    """GLM-5.3-Flash's sparse attention layer as bench_train's layer group configures it (64 heads,
    NoPE latent 512, k-pooled indexer, LoRA rank 16), one 8192-token sequence, bf16, forward +
    backward of the layer's output: a layer with its own indexer, and a shared-indexer layer given the
    first one's indices, which skips the indexer. Neither asks the attention for probabilities (the
    pooled indexer has no KL loss); their second pass over the keys, what a layer with a KL loss
    adds, is timed alone beside them."""
    from bench_train import config_of
    from kda_dsa_ops.models.hybrid import HybridBlock
    from kda_dsa_ops.nn.backend import get_backend
    from kda_dsa_ops.nn import positions_in_sequence

    cfg, T = config_of("glm-5.3-flash"), 8192
    backend = get_backend("native")
    torch.manual_seed(0)
    own, shared = (HybridBlock(cfg, "D", "F" if cfg.dense_ffn else "M", 16, 16, own_indexer=o).cuda().to(BF16)
                   for o in (True, False))
    x = torch.randn(T, cfg.hidden, device="cuda", dtype=BF16, requires_grad=True)
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    pos = positions_in_sequence(cu, T)
    with torch.no_grad():
        indices = own.attention(x, cu, pos, backend)[2]
    dy = torch.randn(T, cfg.hidden, device="cuda", dtype=BF16)

    def step(block, shared_indices=None):
        y = block.attention(x, cu, pos, backend, shared_indices)[0]
        torch.autograd.backward(y, dy, inputs=[x])

    shape = dict(T=T, H=cfg.dsa_heads, Dqk=cfg.dsa_kv_rank + cfg.dsa_rope_dim, topk=cfg.dsa_topk,
                 kpool=cfg.index_kpool)
    q = torch.randn(T, cfg.dsa_heads, shape["Dqk"], device="cuda", dtype=BF16)
    kv = torch.randn(T, 1, shape["Dqk"], device="cuda", dtype=BF16)
    ops = torch.ops.kda_dsa_ops
    scale = shape["Dqk"] ** -0.5
    fwd = [bench_ms(lambda: ops.sparse_attn_fwd(q, kv, indices[:, None], scale, cfg.dsa_kv_rank, None, p, False))
           for p in (False, True)]
    results = [Result("dsa", "GLM-5.3 sparse layer, own indexer, fwd+bwd", shape, bench_ms(lambda: step(own))),
               Result("dsa", "GLM-5.3 sparse layer, shared indexer, fwd+bwd", shape,
                      bench_ms(lambda: step(shared, indices))),
               Result("dsa", "SFA fwd at that shape, p's pass", shape, fwd[1] - fwd[0])]
    for r in results:
        print(f"{r.name}: {r.ms:.3f} ms", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="half the sequence lengths, H = 64 only")
    parser.add_argument("--parts", nargs="+", choices=["li", "sfa", "heads", "gqa", "model", "shared"],
                        default=["li", "sfa"], help="which ops to time (default li and sfa)")
    parser.add_argument("--index-sets", default=None, help="the model part's index sets (bench/index_sets.py)")
    parser.add_argument("--index-layers", type=int, nargs="+", default=None,
                        help="the model part's layers (default: the first in the file)")
    parser.add_argument("--out", default=None, help="directory for the JSON/markdown/PNG results")
    args = parser.parse_args()
    if "model" in args.parts and args.index_sets is None:
        parser.error("--parts model needs --index-sets FILE (written by bench/index_sets.py)")
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    results = ((bench_indexer(args.quick) if "li" in args.parts else []) +
               (bench_attention(args.quick) if "sfa" in args.parts else []) +
               (bench_heads() if "heads" in args.parts else []) +
               (bench_gqa() if "gqa" in args.parts else []) +
               (bench_model(args.index_sets, args.index_layers) if "model" in args.parts else []) +
               (bench_shared() if "shared" in args.parts else []))
    print(write_results("dsa", results, ceilings, args.out))


if __name__ == "__main__":
    main()
