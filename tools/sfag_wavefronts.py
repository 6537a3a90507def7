"""Shared-memory wavefronts of the GQA backward's packed blocks at 8 heads a kv head (attn_bwd_cuda.cu,
Dqk = dv = 128), counted from index sets for the kernel as built and for designs that do S, dP (and
dq) per query: what such a design can save before it is built (the kernel is bound by its
shared-memory loads: ncu has L1/TEX at 72-77% of its peak).

    python tools/sfag_wavefronts.py [--index-sets SETS.pt] [--blocks 64]

A packed block holds 8 consecutive queries (64 rows) and walks the union of their selections in
key order, 32 slots a tile. Counted a tile (a wavefront: 128 bytes of shared memory; an 8 x 8
ldmatrix matrix costs as many as the most of its 8 rows in one bank group, row % 8):
- dense (as built): each of the 8 warps issues 58 ldmatrix.x4 of conflict-free rows: S and dP 24
  (Q, K and dO fragments), dq 10, dkv 24; 1856 wavefronts.
- per query: a warp a query takes its own slots in steps of 16 key rows (S^T = K Q^T, dq^T = K^T
  dS^T, Q^T and dO^T held in registers); a step loads each of its two 8-row matrices 16 times for
  S and dP (8 x4) and 16 times for dq (8 x4.trans); a matrix without rows costs 1. dkv stays dense
  (768), and P and dS go to the dense buffers (zeroed: 64 a tile; scattered: 16 a step). Steps
  formed in slot order; queued by bank group within the tile (2 rows of each group a step: no
  conflicts, part-filled steps); by the GQA forward's queues, carried across tiles
  (forward_rule_steps); the fewest steps (each query's slots over 16, no conflicts: a bound). Then
  S and dP alone per query (slot order; the forward's queues; the fewest steps), dq dense from the
  P and dS buffers as built.
(dkv per query, added into a shared fp32 tile, is not counted: a shared-memory fp32 add is a
compare-and-swap loop on sm_90, ATOMS.CAST.SPIN.) The MLA layouts at 8 and 16 heads run their
packed blocks on the Hopper kernels (mla_bwd_cuda.cu), which this does not count.
Random and window sets as BENCH's (T 4096, Tk 8192, topk 2048; index_sets.drawn_sets), drawn on
the CPU; --index-sets adds a recorded file's first layer.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from index_sets import drawn_sets, load  # noqa: E402

TILE, STEP, QUERIES = 32, 16, 8
DENSE = 8 * 58 * 4  # the kernel's wavefronts a tile
DKV, DQ, ZERO = 8 * 24 * 4, 8 * 10 * 4, 64  # its dkv and dq; P and dS zeroed a tile
MATRIX, SCATTER = 2 * 2 * 128 // 16, 16  # a step's 8-row matrix, loaded for S and dP and for dq; P and dS a step


def members(block: torch.Tensor) -> torch.Tensor:
    """[union, queries] bool: which of the block's queries chose each slot of the union (key order)."""
    keys = block[block >= 0].unique()
    m = torch.zeros(len(keys), block.shape[0], dtype=torch.bool)
    for q in range(block.shape[0]):
        k = block[q][block[q] >= 0]
        m[torch.searchsorted(keys, k), q] = True
    return m


def forward_rule_steps(m: torch.Tensor) -> int:
    """Steps of 16 rows the GQA forward's queues take over a block (member slots m, in tiles of 32):
    a query's rows of each tile join its bank-group queues; it takes full steps (2 rows of every
    group) while each queue has 2, then steps (up to 2 a queue) until the tile before's rows are
    gone, and at the end until none waits."""
    tiles, steps = -(-m.shape[0] // TILE), 0
    for q in range(m.shape[1]):
        queues = [[] for _ in range(8)]  # per bank group: the tile of each waiting row
        for i in range(tiles):
            for r in torch.nonzero(m[i * TILE:(i + 1) * TILE, q]).flatten().tolist():
                queues[r % 8].append(i)
            while all(len(x) >= 2 for x in queues) or any(x and x[0] < i for x in queues):
                for x in queues:
                    del x[:2]
                steps += 1
        while any(queues):
            for x in queues:
                del x[:2]
            steps += 1
    return steps


def block_counts(m: torch.Tensor) -> torch.Tensor:
    """Wavefronts of one block: dense, then each design (report's columns)."""
    Q = m.shape[1]
    tiles = -(-m.shape[0] // TILE)
    m = torch.cat([m, m.new_zeros(tiles * TILE - m.shape[0], Q)]).view(tiles, TILE, Q)
    group = torch.arange(TILE) % 8
    fixed = tiles * (DKV + ZERO)
    # in slot order: a query's k-th slot of a tile falls in matrix k // 8
    rank = m.long().cumsum(1) - 1
    key = ((torch.arange(tiles)[:, None, None] * Q + torch.arange(Q)) * (TILE // 8) + rank // 8) * 8
    key = (key + group[None, :, None])[m]
    per = torch.zeros(tiles * Q * (TILE // 8) * 8, dtype=torch.long).index_add_(0, key, torch.ones_like(key))
    worst = per.view(-1, 8).amax(1)  # a matrix's wavefronts (0: no such matrix)
    in_order = (-(-m.sum(1) // STEP)).sum()
    matrices = worst.sum() + 2 * in_order - (worst > 0).sum()  # a step's matrix without rows: 1
    # queued within the tile: a step takes up to 2 rows of each bank group
    n = torch.zeros(tiles, Q, 8, dtype=torch.long).index_add_(2, group, m.long().transpose(1, 2).contiguous())
    a_tile = (-(-n // 2)).amax(2).sum()
    rule = forward_rule_steps(m.reshape(-1, Q))
    fewest = (-(-m.sum((0, 1)) // STEP)).sum()
    full, s_dp = 2 * MATRIX + SCATTER, MATRIX + SCATTER  # a conflict-free step: S, dP and dq; S and dP
    s_dp_fixed = fixed + tiles * DQ  # dq dense as built
    return torch.tensor([tiles * DENSE,
                         MATRIX * matrices + SCATTER * in_order + fixed, full * a_tile + fixed, full * rule + fixed,
                         full * fewest + fixed,
                         MATRIX // 2 * matrices + SCATTER * in_order + s_dp_fixed, s_dp * rule + s_dp_fixed,
                         s_dp * fewest + s_dp_fixed], dtype=torch.float)


def report(name: str, idx: torch.Tensor, blocks: int) -> None:
    idx = idx.reshape(idx.shape[0], -1)
    Q = QUERIES
    T = idx.shape[0] // Q * Q
    every = max(1, T // Q // blocks)
    total, distinct, entries = torch.zeros(8), 0, 0
    for b in idx[:T].view(-1, Q, idx.shape[1])[::every]:
        m = members(b)
        total += block_counts(m)
        distinct, entries = distinct + m.shape[0], entries + int((b >= 0).sum())
    cols = " | ".join(f"{x:.2f}" for x in (total / total[0]).tolist()[1:])
    print(f"| {name} | {distinct / max(entries, 1):.3f} | {cols} |")  # (index_sets.union_share's)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-sets", help="a file of bench/index_sets.py (its first layer)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks counted a case, evenly spaced")
    args = parser.parse_args(argv)
    print("wavefronts of each design against the dense kernel's (1.00)")
    print("| sets | union share | per query: slot order | queued a tile | the forward's queues | fewest steps "
          "| S, dP per query: slot order | the forward's queues | fewest steps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    report("random", drawn_sets(4096, 8192, 2048, None, None, QUERIES, device="cpu"), args.blocks)
    report("window 4096", drawn_sets(4096, 8192, 2048, 4096, None, QUERIES, device="cpu"), args.blocks)
    report("window, 90% common", drawn_sets(4096, 8192, 2048, 4096, 0.9, QUERIES, device="cpu"), args.blocks)
    if args.index_sets:
        sets = load(args.index_sets)
        report("the model's sets", sets[min(sets)], args.blocks)


if __name__ == "__main__":
    main()
