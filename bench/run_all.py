"""Runs every benchmark family and writes their results (see docs/benchmarks.md).

    python bench/run_all.py [--quick] [--only FAMILY ...] [--fla-cases N] [--out DIR]
"""

import argparse
import os
import subprocess
import sys

FAMILIES = {"kda": "bench_kda.py", "dsa": "bench_dsa.py", "moe": "bench_moe.py", "ce": "bench_ce.py",
            "train": "bench_train.py"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shape sets")
    parser.add_argument("--out", default=None, help="directory for the results (default bench/results)")
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES),
                        help="families to run")
    parser.add_argument("--fla-cases", type=int, default=None,
                        help="kda: compare with flash-linear-attention on the first N cases only")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    failed = []
    for script in (FAMILIES[f] for f in args.only):
        cmd = [sys.executable, os.path.join(here, script)] + (["--quick"] if args.quick else [])
        cmd += ["--out", args.out] if args.out else []
        if script == FAMILIES["kda"] and args.fla_cases is not None:
            cmd += ["--fla-cases", str(args.fla_cases)]
        print(f"== {script}", flush=True)
        if subprocess.call(cmd) != 0:
            failed.append(script)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
