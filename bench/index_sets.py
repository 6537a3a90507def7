"""The index sets the DSA benchmarks run on: drawn at random (from all keys, from a window before each
query, with a share of keys common to a packed block's queries, or causal over one sequence), or
recorded from a checkpoint's own indexers over a text, and the overlap that decides what packing
queries buys (union_share).

    python bench/index_sets.py CHECKPOINT --text FILE [--tokenizer DIR] [--tokens 8192] [--layers N] --out SETS.pt
    python bench/index_sets.py CHECKPOINT --ids FILE ... --out SETS.pt      # token ids, whitespace-separated
    python bench/bench_dsa.py --parts model --index-sets SETS.pt            # the kernels on them

Recording loads the checkpoint (kda_dsa_ops.from_pretrained, bf16; --layers: only the first N
layers), runs one forward over the text's first --tokens tokens as one sequence and keeps every
sparse layer's choice (HybridModel.index_selections). It prints each layer's union share at 8, 4
and 2 queries a block (how the MLA kernels pack H 8 / 16 / 32) and writes the sets atomically.
"""

from __future__ import annotations

import argparse
import os

import torch

FORMAT = "kda_dsa_ops index sets 1"
# queries a packed block holds at H 8, 16, 32 (64 rows a block, H rows a query)
GROUPS = {8: 8, 16: 4, 32: 2}


def drawn_sets(T: int, Tk: int, topk: int, window, shared, group: int, device="cuda") -> torch.Tensor:
    """[T, 1, topk] distinct keys per query, on `device`: from all Tk keys (window None), or from the
    `window` keys up to the query's own position (a query t of the T at the end of the context sits
    at key Tk - T + t); shared: the share of its keys that a query has in common with its packed
    block's `group` queries (drawn from the window before the block's first query, the rest its
    own from the same window)."""
    if window is None:
        return torch.rand(T, Tk, device=device).topk(topk, dim=-1).indices.int()[:, None]
    t = torch.arange(T, device=device)[:, None]
    if shared is None:
        first = Tk - T + t - window + 1
        return (torch.rand(T, window, device=device).topk(topk, dim=-1).indices + first).int()[:, None]
    first = Tk - T + t // group * group - window + 1
    common = int(shared * topk)
    score = torch.rand(T // group, window, device=device).repeat_interleave(group, 0)
    mine = score.topk(common, dim=-1).indices
    own = torch.rand(T, window, device=device).scatter_(1, mine, -1.0).topk(topk - common, dim=-1).indices
    return (torch.cat([mine, own], 1) + first).int()[:, None]


def causal_sets(T: int, topk: int, device="cuda") -> torch.Tensor:
    """[T, 1, topk] one causal sequence's random sets (T = Tk): query t's min(topk, t + 1) distinct keys
    drawn from keys 0 .. t, -1 for the rest (a training sequence's geometry, as recorded sets have it)."""
    later = torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)  # keys after the query
    top = torch.rand(T, T, device=device).masked_fill_(later, -1).topk(topk, dim=-1)
    return torch.where(top.values >= 0, top.indices, -1).int()[:, None]


def union_share(idx: torch.Tensor, group: int) -> float:
    """For idx [T, Hkv, topk] (-1: no key): the distinct keys of each `group` consecutive queries on
    a kv head, summed, over their entries with a key: the share of a packed block's work that is not
    a repeat of another query's (1 / group: the queries chose the same keys; 1: none shared). The
    last T % group queries are left out."""
    T, topk = idx.shape[0] // group * group, idx.shape[-1]
    rows = idx[:T].transpose(0, 1).reshape(-1, group * topk).sort(1).values
    valid = rows >= 0
    distinct = valid[:, :1].sum() + (valid[:, 1:] & (rows[:, 1:] != rows[:, :-1])).sum()
    return float(distinct) / max(int(valid.sum()), 1)


def record(checkpoint: str, tokens: torch.Tensor, layers: int | None = None,
           device: str | torch.device | None = None) -> dict[int, torch.Tensor]:
    """{layer: [T, topk] int32} chosen by the checkpoint's indexers over tokens [T] (one sequence)."""
    from kda_dsa_ops import onboard

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    overrides = {} if layers is None else {"layers": layers}
    model = onboard.from_pretrained(checkpoint, dtype=torch.bfloat16, device=device, **overrides).eval()
    cu = torch.tensor([0, tokens.numel()], dtype=torch.int32, device=device)
    return {i: s.cpu() for i, s in model.index_selections(tokens.to(device), cu).items()}


def save(path: str, sets: dict[int, torch.Tensor], source: str) -> None:
    """Writes the sets to path through a temporary file in its directory (no half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"format": FORMAT, "source": source, "sets": sets}, tmp)
    os.replace(tmp, path)


def load(path: str) -> dict[int, torch.Tensor]:
    """The sets that save wrote: {layer: [T, topk] int32}."""
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a file of index sets written by bench/index_sets.py")
    return data["sets"]


def read_tokens(args) -> torch.Tensor:
    if args.ids is not None:
        with open(args.ids) as f:
            ids = [int(v) for v in f.read().split()]
    else:
        from transformers import AutoTokenizer

        with open(args.text) as f:
            ids = AutoTokenizer.from_pretrained(args.tokenizer or args.checkpoint)(f.read())["input_ids"]
    if len(ids) < args.tokens:
        print(f"the input has {len(ids)} tokens, fewer than --tokens {args.tokens}: all are used", flush=True)
    return torch.tensor(ids[: args.tokens], dtype=torch.int64)


def main(argv=None) -> dict[int, torch.Tensor]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory kda_dsa_ops.from_pretrained loads")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a text file, tokenized by the checkpoint's tokenizer (transformers)")
    source.add_argument("--ids", help="a file of token ids, whitespace-separated")
    parser.add_argument("--tokenizer", default=None, help="the tokenizer's directory (default: the checkpoint's)")
    parser.add_argument("--tokens", type=int, default=8192, help="the sequence length (default 8192)")
    parser.add_argument("--layers", type=int, default=None, help="load and run only the first N layers")
    parser.add_argument("--device", default=None, help="default: cuda where there is one")
    parser.add_argument("--out", required=True, help="the file to write (torch.save)")
    args = parser.parse_args(argv)
    tokens = read_tokens(args)
    sets = record(args.checkpoint, tokens, args.layers, args.device)
    if not sets:
        raise SystemExit(f"{args.checkpoint}: no sparse layer with an indexer of its own among the layers run")
    for i, s in sets.items():
        shares = " / ".join(f"{union_share(s[:, None], g):.3f}" for g in GROUPS.values())
        print(f"layer {i}: {s.shape[0]} queries, topk {s.shape[1]}, union share at H 8 / 16 / 32 "
              f"({' / '.join(map(str, GROUPS.values()))} queries a block): {shares}", flush=True)
    save(args.out, sets, os.path.basename(os.path.normpath(args.checkpoint)))
    print(f"wrote {args.out}", flush=True)
    return sets


if __name__ == "__main__":
    main()
