"""Benchmark harness (see docs/benchmarks.md): median device time, ceilings measured in the same run,
floors from counted FLOPs and bytes, JSON + markdown + PNG results under bench/results/."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bench_ms(fn, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of fn() in milliseconds, measured with CUDA events (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the absolute norm when b is all zeros), in fp32."""
    diff, ref = (a.float() - b.float()).norm().item(), b.float().norm().item()
    return diff / ref if ref else diff


@dataclass
class Ceilings:
    copy_gbps: float     # device-to-device copy, bytes read + written
    matmul_tflops: float  # 8192^3 bf16 matmul


def measure_ceilings() -> Ceilings:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = bench_ms(lambda: a @ b)
    return Ceilings(copy_gbps=2 * (1 << 30) * 2 / copy_ms / 1e6, matmul_tflops=2 * 8192 ** 3 / mm_ms / 1e9)


@dataclass
class Result:
    family: str
    name: str
    shape: dict
    ms: float
    flops: float = 0.0
    bytes: float = 0.0
    baseline: str = ""
    baseline_ms: float = 0.0
    extra: dict = field(default_factory=dict)

    def tflops(self) -> float:
        return self.flops / self.ms / 1e9 if self.flops else 0.0

    def gbps(self) -> float:
        return self.bytes / self.ms / 1e6 if self.bytes else 0.0

    def floor_ms(self, c: Ceilings) -> float:
        return max(self.flops / (c.matmul_tflops * 1e9), self.bytes / (c.copy_gbps * 1e6))

    def speedup(self) -> float:
        return self.baseline_ms / self.ms if self.baseline_ms else 0.0


def commit_id() -> str:
    env = os.environ.get("KDA_DSA_OPS_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_tag() -> str:
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "h800", "h20", "a100"):
        if tag in name:
            return tag
    return name.replace(" ", "-")


def table(results: list[Result], c: Ceilings) -> str:
    """Markdown table: time, achieved rates, the floor and which ceiling sets it, the gap, and the
    speed-up over the baseline measured in the same run."""
    lines = ["| family | case | ms | TFLOP/s | GB/s | floor ms | bound | gap | baseline | speed-up |",
             "|---|---|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in results:
        floor = r.floor_ms(c)
        bound = "compute" if r.flops / (c.matmul_tflops * 1e9) >= r.bytes / (c.copy_gbps * 1e6) else "memory"
        rates = (f"{r.tflops():.0f} | {r.gbps():.0f} | {floor:.3f} | {bound} | {r.ms / floor:.2f}x" if floor
                 else "- | - | - | - | -")  # a time alone (no FLOP or byte count)
        lines.append(f"| {r.family} | {r.name} | {r.ms:.3f} | {rates} | {r.baseline or '-'} | "
                     f"{f'{r.speedup():.2f}x' if r.baseline_ms else '-'} |")
    return "\n".join(lines)


def write_results(family: str, results: list[Result], c: Ceilings, out_dir: str | None = None,
                  plot: bool = True) -> str:
    """Writes <gpu>-<date>-<family>.json/.md/.png into out_dir (default bench/results). Returns
    the markdown table."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{gpu_tag()}-{datetime.date.today().isoformat()}-{family}")
    meta = {
        "commit": commit_id(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "ceilings": asdict(c),
    }
    rows = []
    for r in results:
        d = asdict(r)
        d.update(tflops=r.tflops(), gbps=r.gbps(), floor_ms=r.floor_ms(c), speedup=r.speedup())
        rows.append(d)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    md = table(results, c)
    with open(stem + ".md", "w") as f:
        f.write(f"# {family} on {meta['gpu']}, {meta['date']}, commit {meta['commit'][:12]}, torch {meta['torch']}\n\n")
        f.write(f"Ceilings measured in this run: copy {c.copy_gbps:.0f} GB/s, bf16 matmul {c.matmul_tflops:.0f} "
                "TFLOP/s.\n\n" + md + "\n")
    if plot:
        plot_rows(rows, stem + ".png", f"{family}: {meta['gpu']}, commit {meta['commit'][:12]}")
    return md


def plot_rows(rows: list[dict], path: str, title: str) -> None:
    """Bar chart of achieved TFLOP/s (compute-heavy cases) and GB/s (memory-bound cases), each
    beside its baseline measured in the same run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [("TFLOP/s", [r for r in rows if r["flops"]], "flops", 1e9),
              ("GB/s", [r for r in rows if not r["flops"] and r["bytes"]], "bytes", 1e6)]
    panels = [p for p in panels if p[1]]
    if not panels:  # times alone
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.5 * len(panels)), squeeze=False)
    for ax, (unit, sel, key, scale) in zip(axes[:, 0], panels):
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r[key] / r["ms"] / scale for r in sel], 0.4, label="kda_dsa_ops")
        ax.bar([x + 0.2 for x in xs], [r[key] / r["baseline_ms"] / scale if r["baseline_ms"] else 0 for r in sel],
               0.4, label="baseline (see label)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['name']}\nvs {r['baseline'] or '-'}" for r in sel], rotation=70, ha="right",
                           fontsize=6)
        ax.set_ylabel(unit)
        ax.legend()
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    for json_path in sys.argv[1:]:  # re-plot recorded results: python bench/common.py results/*.json
        with open(json_path) as f:
            data = json.load(f)
        family = os.path.basename(json_path)[:-5].split("-")[-1]
        plot_rows(data["results"], json_path[:-5] + ".png",
                  f"{family}: {data['meta']['gpu']}, commit {data['meta']['commit'][:12]}")
