"""A/B of builds of the extension on DSA cases, in one call: each build runs in a process of its own
(so that each loads its own library), the builds in turn, for a number of rounds, and the times of
every round are printed side by side (how the history notes' A/B tables are measured).

    python bench/ab_dsa.py --build main=python/kda_dsa_ops/_C.abi3.so --build fill=FILL.so \\
        --cases gqa:8:w gqa:8:m:d gqa:64 mla:16 mla:16:p [--passes fwd sfag] [--rounds 2] [--index-sets SETS.pt]

A build is NAME=PATH: an extension library, xz-compressed or not (this tree's Python package is
put around it), or a directory put first on PYTHONPATH (a package of its own). A case is
LAYOUT:HEADS[:SETS][:d][:p]: gqa (4 kv heads of 128 / 128) or mla (one kv head of 576 / 512), HEADS
query heads a kv head; SETS r random (the default), w the 4096 keys before each query, s the same
with 90% of a packed block's keys in common, c causal random over one sequence (T = Tk = TK), m
--index-sets' first layer (T = Tk its tokens); d: the deterministic backward; p (mla only): the
portable kernels (the portable_sfa switch). Shapes as bench_dsa.py's (T 4096, Tk 8192, topk 2048,
gated, bf16; --size for others). The last columns: each build's median over the rounds against the
first build's. (--device cpu runs the CPU kernels, timed with a clock: for the tests.)
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "python", "kda_dsa_ops")
LAYOUTS = {"gqa": (4, 128, 128), "mla": (1, 576, 512)}  # kv heads, Dqk, dv
SETS = {"r": (None, None), "w": (4096, None), "s": (4096, 0.9)}  # drawn_sets' window, shared


def parse_case(case: str) -> dict:
    parts = case.split(":")
    flags = set()
    while len(parts) > 2 and parts[-1] in ("d", "p") and parts[-1] not in flags:
        flags.add(parts.pop())
    if len(parts) not in (2, 3) or parts[0] not in LAYOUTS or not parts[1].isdigit() or \
            (len(parts) == 3 and parts[2] not in (*SETS, "c", "m")) or ("p" in flags and parts[0] != "mla"):
        raise SystemExit(f"case {case!r}: LAYOUT:HEADS[:SETS][:d][:p] with LAYOUT gqa or mla, SETS r, w, s, "
                         "c or m, p with mla only")
    return {"layout": parts[0], "heads": int(parts[1]), "sets": parts[2] if len(parts) == 3 else "r",
            "deterministic": "d" in flags, "portable": "p" in flags}


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        from common import bench_ms

        return bench_ms(fn)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def worker(args) -> dict[str, float]:
    """This process's build: ms per case and pass."""
    import kda_dsa_ops
    from bench_dsa import case_inputs, sfa_calls
    from index_sets import causal_sets, drawn_sets, load

    T, Tk, topk = args.size
    recorded = None  # --index-sets' first layer, read once
    out = {}
    for case in args.cases:
        c = parse_case(case)
        kv_heads, Dqk, dv = LAYOUTS[c["layout"]]
        G = c["heads"]
        if c["sets"] == "m":
            if recorded is None:
                sets = load(args.index_sets)
                recorded = sets[min(sets)].to(args.device)
            n = recorded.shape[0]
            q, kv, gate = case_inputs(n, n, kv_heads, G, Dqk, dv, args.device)
            idx = recorded[:, None].expand(n, kv_heads, recorded.shape[-1]).contiguous()
        elif c["sets"] == "c":
            q, kv, gate = case_inputs(Tk, Tk, kv_heads, G, Dqk, dv, args.device)
            idx = torch.cat([causal_sets(Tk, topk, args.device) for _ in range(kv_heads)], 1)
        else:
            q, kv, gate = case_inputs(T, Tk, kv_heads, G, Dqk, dv, args.device)
            idx = torch.cat([drawn_sets(T, Tk, topk, *SETS[c["sets"]], max(64 // G, 1), device=args.device)
                             for _ in range(kv_heads)], 1)
        kda_dsa_ops.set_portable_sfa(c["portable"])
        calls = dict(zip(("fwd", "sfag"), sfa_calls(q, kv, idx, gate, c["deterministic"])))
        for p in args.passes:
            out[f"{case} {p}"] = time_ms(calls[p], args.device)
        del q, kv, gate, idx, calls
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def build_path(spec: str, scratch: str) -> tuple[str, str]:
    """NAME=PATH -> (name, the directory to put first on PYTHONPATH)."""
    name, _, path = spec.partition("=")
    if not name or not path or not os.path.exists(path):
        raise SystemExit(f"--build {spec!r}: NAME=PATH of an extension library or a package's directory")
    if os.path.isdir(path):
        return name, os.path.abspath(path)
    root = os.path.join(scratch, name)
    shutil.copytree(PACKAGE, os.path.join(root, "kda_dsa_ops"),
                    ignore=shutil.ignore_patterns("__pycache__", "_C*.so"))
    with (lzma.open if path.endswith(".xz") else open)(path, "rb") as src, \
            open(os.path.join(root, "kda_dsa_ops", "_C.abi3.so"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    return name, root


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", default=[], help="NAME=PATH (two or more, the first the base)")
    parser.add_argument("--cases", nargs="+", required=True, help="LAYOUT:HEADS[:SETS][:d][:p]")
    parser.add_argument("--passes", nargs="+", default=["fwd", "sfag"], choices=["fwd", "sfag"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--index-sets", help="bench/index_sets.py's file (cases with sets m)")
    parser.add_argument("--size", type=int, nargs=3, default=[4096, 8192, 2048], metavar=("T", "TK", "TOPK"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for case in args.cases:
        if parse_case(case)["sets"] == "m" and not args.index_sets:
            raise SystemExit(f"case {case!r} needs --index-sets")
    if args.worker:
        import kda_dsa_ops

        print(json.dumps({"library": kda_dsa_ops._C.__file__, "ms": worker(args)}))
        return
    if len(args.build) < 2:
        raise SystemExit("--build NAME=PATH at least twice: the builds to compare, the first the base")
    forwarded = ["--cases", *args.cases, "--passes", *args.passes, "--size", *map(str, args.size),
                 "--device", args.device] + (["--index-sets", args.index_sets] if args.index_sets else [])
    with tempfile.TemporaryDirectory() as scratch:
        builds = [build_path(spec, scratch) for spec in args.build]
        times: dict[str, list[dict[str, float]]] = {name: [] for name, _ in builds}
        for r in range(args.rounds):
            for name, root in builds:
                path = [root, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *forwarded],
                                     env=env, capture_output=True, text=True)
                if run.returncode != 0:
                    raise SystemExit(f"build {name}, round {r + 1}:\n{run.stderr[-4000:]}")
                got = json.loads(run.stdout.strip().splitlines()[-1])
                times[name].append(got["ms"])
                print(f"round {r + 1}, {name}: {got['library']}", flush=True)
    names = [name for name, _ in builds]
    print("| case | " + " | ".join(names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for key in times[names[0]][0]:
        rounds = {n: [t[key] for t in times[n]] for n in names}
        cells = [" / ".join(f"{ms:.3f}" for ms in rounds[n]) for n in names]
        base = statistics.median(rounds[names[0]])
        cells += [f"{statistics.median(rounds[n]) / base:.3f}" for n in names[1:]]
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
