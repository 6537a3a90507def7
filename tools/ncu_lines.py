r"""Where a kernel's warps stall, by source line: ncu's per-instruction stall samples summed onto
the lines of the kernel's own files.

On the GPU machine, one profiled step and its source page as CSV:
    ncu --profile-from-start off -k regex:NAME --section SourceCounters --section WarpStateStats \
        -o prof python3 tools/profile_kda.py --ncu
    ncu -i prof.ncu-rep --page source --csv --print-source sass | gzip > src.csv.gz
Here, a cubin of the same source with line info (nvcc ... -lineinfo -cubin FILE.cu; the build's
flags), then
    python tools/ncu_lines.py src.csv.gz FILE.cubin KERNEL FUNCTION [--files a.cu,b.cuh] [--top N]
(KERNEL a regex on the report's demangled name, FUNCTION one on the cubin's mangled name, e.g.
'intra_bf16_kernel<\(int\)128, __nv_bfloat16' and 'intra_bf16_kernelILi128E13__nv_bfloat16').
Each instruction counts for the innermost line of the listed files it was inlined into; a line
prints its share of the samples, its executed instructions and its three main stall reasons.
nvdisasm (the CUDA toolkit's, or Triton's copy) reads the cubin; the report's instructions must
match the cubin's (a mismatch count is printed)."""

import argparse
import collections
import csv
import gzip
import os
import re
import shutil
import subprocess


def kernels(path):
    """(name, header, rows) of each kernel section of ncu's source-page CSV."""
    rows = list(csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)))
    out, i = [], 0
    while i < len(rows):
        if rows[i] and rows[i][0] == "Kernel Name":
            j = i + 2
            while j < len(rows) and not (rows[j] and rows[j][0] == "Kernel Name"):
                j += 1
            out.append((rows[i][1], rows[i + 1], rows[i + 2:j]))
            i = j
        else:
            i += 1
    return out


def nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    import triton  # its NVIDIA backend carries the binary
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def lines_of(cubin, function_regex, files, innermost=False):
    """offset -> (opcode, (file, line)) for the first function matching, attributed to `files` (or
    to the innermost line, whatever its file). nvdisasm names an inlined instruction's innermost
    and outermost lines only, so code inlined through a helper counts for the outermost line."""
    text = subprocess.run([nvdisasm(), "-g" if innermost else "-gi", "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    name, where, out = None, None, {}
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            if out:
                break
            name = m.group(1) if re.search(function_regex, m.group(1)) else None
            continue
        if name is None:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?', line)
        if m:
            inner, outer = os.path.basename(m.group(1)), os.path.basename(m.group(3) or "")
            if inner in files or innermost:
                where = (inner, int(m.group(2)))
            elif outer in files:
                where = (outer, int(m.group(4)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out[int(m.group(1), 16)] = (m.group(2).split()[0].lstrip("@!P0123456789T "), where)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("cubin")
    ap.add_argument("kernel", help="regex on the report's (demangled) kernel name; the first match is read")
    ap.add_argument("function", help="regex on the cubin's (mangled) function name")
    ap.add_argument("--files", default=None, help="comma-separated file names to attribute to "
                    "(default: the cubin's source file)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--inside", default=None, metavar="FILE:LINE",
                    help="break that line's samples down by the innermost line of each instruction")
    args = ap.parse_args()
    files = set((args.files or os.path.basename(args.cubin).replace(".cubin", ".cu")).split(","))
    name, header, rows = next(k for k in kernels(args.csv) if re.search(args.kernel, k[0]))
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    sass = lines_of(args.cubin, args.function, files)
    if args.inside:
        file, line = args.inside.rsplit(":", 1)
        inner = lines_of(args.cubin, args.function, files, innermost=True)
        sass = {o: (op, inner[o][1]) for o, (op, where) in sass.items() if where == (file, int(line))}
    base = int(rows[0][0], 16)
    by_line = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    total = mismatched = 0
    for r in rows:
        offset = int(r[0], 16) - base
        samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        total += samples
        if offset not in sass:
            continue
        op, where = sass[offset]
        mismatched += op not in r[1]
        entry = by_line[where]
        entry[0] += samples
        entry[1] += int(r[col["Instructions Executed"]] or 0)
        for s in stalls:
            entry[2][s[6:]] += int(r[col[s]] or 0)
    print(f"{name[:100]}: {len(rows)} instructions ({mismatched} not matching the cubin), {total} samples")
    for where, (samples, executed, why) in sorted(by_line.items(), key=lambda x: -x[1][0])[:args.top]:
        reasons = ", ".join(f"{k} {v * 100 // max(samples, 1)}%" for k, v in why.most_common(3))
        print(f"{samples * 100 / max(total, 1):5.1f}%  {executed:>11}  {where}  {reasons}")


if __name__ == "__main__":
    main()
