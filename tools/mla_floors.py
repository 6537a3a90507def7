"""Floors of the MLA layout's sparse attention at 8 and 16 heads (Dqk 576, dv 512, one kv head),
counted from index sets for the kernels as built and for designs not built: the most of H 64's rate
each could reach, against the half that the DSA issue's bar 3 asks for.

    python tools/mla_floors.py [--record REC.json] [--index-sets SETS.pt --suffix " model layer 0"]

A design's floor is the time of its busiest resource at that resource's ceiling:
- tensor cores: its tiles' products at the record's bf16 matmul ceiling;
- L2: dkv's fp32 adds (16-byte red.global.add) at 3.84 TB/s and the kv rows' gathers at 8.52 TB/s,
  the two added (random 512-byte rows of a table held in L2, h200-2026-12-04-l2-rows-probe.md;
  MLA's dkv rows are 2,304 bytes);
- shared memory: 128 bytes a clock an SM, 132 SMs at 1980 MHz (nominal, not measured).
A design at H heads reaches at most (H / 64) x (H 64's time in the record) / floor of H 64's rate;
run as close to its floor as the H 64 kernel is to its own (as built, a query a block), it would
give (H / 64) x (H 64's floor) / floor.
Blocks of 64 / H consecutive queries (8 at H 8, 4 at H 16):
- packed (as built, mla_fwd_cuda.cu / mla_bwd_cuda.cu): 64 rows x the block's union of slots on
  the tensor cores; dkv added once a union slot.
- keys along the rows, a query at a time: S^T = K Q^T and O^T += V^T P^T (wgmma N = H), each kv row
  written to shared memory once and read twice as the A operand (K, V^T), Q^T and P^T (B) read once
  a 64-key tile; dkv added once a query's slot.
- pattern tiles: keys along the rows over the block's union, its slots sorted by which queries chose
  them, 64 a tile, N = H x the queries any of the tile's slots has; dkv added once a union slot and
  dq (N rows x 576) once a tile.
- split backward: dkv over pattern tiles of blocks of 128 rows (S^T, dP^T, dk, dv; dkv added
  once a union slot), and dq in a second kernel a query at a time (S^T, dP^T, dq^T = K^T dS^T in
  registers; its kv rows gathered again).
The backward's floors count the tensor cores and L2 only (its shared-memory traffic is the
forward's and more). Random sets as BENCH's (T 4096, Tk 8192, topk 2048), drawn on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
from index_sets import drawn_sets, load  # noqa: E402

RECORD = os.path.join(HERE, "..", "bench", "results", "history", "h200-2026-12-04-dsa-heads-model-e232e20.json")
DQK, DV, TILE = 576, 512, 64
FLOPS = {"fwd": 2 * (DQK + DV), "bwd": 2 * (3 * DQK + 2 * DV)}  # a row and a key: S, O; S, dP, dq, dk, dv
DKV_FLOPS, DQ_FLOPS, WIDE = 2 * (2 * DQK + 2 * DV), 2 * (2 * DQK + DV), 128  # S, dP, dk, dv; S, dP, dq; rows
ADD, GATHER = 3.84e12, 8.52e12  # L2 bytes a second: fp32 adds, gathered rows
SMEM = 128 * 132 * 1.98e9
ROW, ADDS = 2 * DQK, 4 * DQK  # bytes a kv row gathered; a key's dkv adds
A_BYTES, B_BYTES = ROW + 2 * (DQK + DV), 2 * (DQK + DV)  # a key: gathered, read as K and V^T; a row of N a tile


def block_counts(idx: torch.Tensor, heads: int, group: int = 0) -> dict[str, float]:
    """Sums over the blocks of idx [T, topk] (-1: no key) at `heads` heads (`group` queries a block,
    0: 64 / heads; the last T % group queries left out): entries, union slots, each query's 64-key
    tiles, and the pattern tiles' count and rows (N summed)."""
    group = group or 64 // heads
    idx = idx[:idx.shape[0] // group * group].long()
    Tk = int(idx.max()) + 1
    chosen = torch.zeros(idx.shape[0], Tk + 1, dtype=torch.int32)
    chosen.scatter_(1, torch.where(idx >= 0, idx, Tk), 1)  # a query's key chosen twice: counted once
    chosen = chosen[:, :Tk].view(-1, group, Tk)
    entries = int((idx >= 0).sum())
    mask = (chosen << torch.arange(group)[:, None]).sum(1)  # [blocks, Tk]: bit q, query q chose it
    union = int((mask > 0).sum())
    # the union in pattern order, then per 64-slot tile the queries any of its slots has
    ordered = mask.sort(1, descending=True).values
    pad = -Tk % TILE
    ordered = torch.cat([ordered, ordered.new_zeros(ordered.shape[0], pad)], 1).view(ordered.shape[0], -1, TILE)
    bits = ((ordered[..., None] >> torch.arange(group)) & 1).amax(2).sum(-1)  # [blocks, tiles]
    per_query = int(((idx >= 0).sum(1) + TILE - 1).div(TILE, rounding_mode="floor").sum())
    return {"entries": entries, "union": union, "query_tiles": per_query,
            "tiles": int((bits > 0).sum()), "rows": int(bits.sum()) * heads}


def floors(c: dict[str, float], wide: dict[str, float], heads: int,
           ceiling: float) -> dict[str, dict[str, tuple[float, str]]]:
    """Per design and pass: (floor in seconds, the resource that sets it); c: block_counts of the
    kernels' blocks, wide: of blocks of WIDE rows (the split backward's dkv)."""
    def worst(**times):
        name = max(times, key=times.get)
        return times[name], name.replace("_", " ")

    u, e = c["union"], c["entries"]
    l2_slot = ADDS / ADD + ROW / GATHER  # a slot's dkv adds and its gathered row
    l2_union, l2_query = u * l2_slot, e * l2_slot
    out = {"packed": {"fwd": worst(tensor=u * TILE * FLOPS["fwd"] / ceiling),
                      "bwd": worst(tensor=u * TILE * FLOPS["bwd"] / ceiling, L2=l2_union)}}
    q_work = c["query_tiles"] * TILE * heads
    out["keys along the rows"] = {
        "fwd": worst(tensor=q_work * FLOPS["fwd"] / ceiling,
                     shared_memory=(e * A_BYTES + c["query_tiles"] * heads * B_BYTES) / SMEM),
        "bwd": worst(tensor=q_work * FLOPS["bwd"] / ceiling, L2=l2_query)}
    p_work = TILE * c["rows"]
    out["pattern tiles"] = {
        "fwd": worst(tensor=p_work * FLOPS["fwd"] / ceiling, shared_memory=(u * A_BYTES + c["rows"] * B_BYTES) / SMEM),
        "bwd": worst(tensor=p_work * FLOPS["bwd"] / ceiling, L2=l2_union + c["rows"] * ADDS / ADD)}
    out["split backward"] = {"bwd": worst(
        tensor=(TILE * wide["rows"] * DKV_FLOPS + q_work * DQ_FLOPS) / ceiling,
        L2=wide["union"] * l2_slot + e * ROW / GATHER)}
    return out


def report(name: str, idx: torch.Tensor, record: dict, suffix: str) -> None:
    rows = {r["name"]: r for r in record["results"]}
    ceiling = record["meta"]["ceilings"]["matmul_tflops"] * 1e12
    idx = idx.reshape(idx.shape[0], -1)
    own = block_counts(idx, 64)
    own = floors(own, own, 64, ceiling)["packed"]  # H 64 as built: a query a block
    for heads in (8, 16):
        c = block_counts(idx, heads)
        got = floors(c, block_counts(idx, heads, WIDE // heads), heads, ceiling)
        for p, case in (("fwd", "SFA fwd H{} 576/512"), ("bwd", "SFAG H{} 576/512")):
            t64 = rows[case.format(64) + suffix]["ms"] * 1e-3
            now = rows.get(case.format(heads) + suffix)
            cells = [f"{heads / 64 * t64 / (now['ms'] * 1e-3):.0%}" if now else "-"]
            for design in got.values():
                if p not in design:
                    cells.append("-")
                    continue
                t, bound = design[p]
                shares = f"{heads / 64 * t64 / t:.0%} / {heads / 64 * own[p][0] / t:.0%}"
                cells.append(f"{t * 1e3:.2f} ms, {bound}: {shares}")
            print(f"| {name} | {heads} | {p} | {c['union'] / c['entries']:.3f} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", default=RECORD, help="a bench JSON with the H 64 rows (and the H 8 / 16 ones)")
    parser.add_argument("--index-sets", help="a file of bench/index_sets.py (its first layer)")
    parser.add_argument("--suffix", default=" model layer 0", help="the record's case names' suffix for --index-sets")
    args = parser.parse_args(argv)
    with open(args.record) as f:
        record = json.load(f)
    print("each design's floor and its bound; of H 64's rate, the most it allows / what it gives at H 64's share of"
          " its own floor (the bar: 50%)")
    print("| sets | H | pass | union share | now | packed (as built) | keys along the rows | pattern tiles "
          "| split backward |")
    print("|---|---:|---|---:|---:|---|---|---|---|")
    torch.manual_seed(0)
    report("random", drawn_sets(4096, 8192, 2048, None, None, 8, device="cpu"), record, "")
    if args.index_sets:
        sets = load(args.index_sets)
        report("the model's sets", sets[min(sets)], record, args.suffix)


if __name__ == "__main__":
    main()
