#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the CUDA tests, run compute-sanitizer on
# every kernel, run the benchmarks; logs and results go to $OUT (default ./gpu_out), packed at the
# end into $OUT/gpu_check-HHMMSS.tgz beside $OUT/summary.txt (the device tool brings back few files);
# a short table is printed last.
#
#   tools/gpu_check.sh [build] [test] [sanitize] [demo] [train] [ep] [groups] [memory] [ab] [bench|bench-quick] ...
#   (default: build test sanitize demo train bench; ep needs two or more GPUs; groups: the real
#   models' layer groups beside transformers + peft; LAYER_GROUPS, GROUP_TOKENS and GROUP_BACKENDS
#   choose (bash keeps GROUPS for itself); memory: recompute and offload on the GLM-5.3-Flash group at
#   lengths where its activations do not fit, MEMORY_RUNS chooses; ab: builds of the extension timed
#   against each other on DSA cases in alternating rounds, bench/ab_dsa.py with AB_BUILDS ("NAME=PATH
#   ...", the first the base), AB_CASES and AB_ARGS)
#
# Environment: KDA_DSA_OPS_COMMIT (the commit id the results record; pass it: a copied tree's
# .git can name an older commit than the files that run), TEST_PATHS (test files or node ids,
# default tests), TEST_ARGS (extra pytest arguments, split at spaces: a -k expression must be one
# word), SANITIZE (scripts for compute-sanitizer, default tools/sanitize_*.py), BENCH_ONLY
# (families for bench/run_all.py --only), FLA_CASES (the KDA cases timed beside fla: its first
# calls autotune for ~4 minutes per shape),
# MAX_JOBS (default 16). Wheels in .whl/ (flash-linear-attention, the KDA baseline;
# cut-cross-entropy and liger-kernel, the linear cross-entropy's; transformers and peft, the
# training anchor's) are installed into .pydeps/ first; Triton's cache lives in .triton_cache/ so that a warm machine
# keeps fla's autotuning between calls. KEEP_TRITON_CACHE=1 also packs that folder into $OUT/triton_cache.tgz.part-*
# (15 MB pieces: the files that come back are limited in size). Those pieces copied into .triton_pack/ here and
# carried (the unpacked cache is over the 64 MiB a call carries), a fresh machine unpacks them into .triton_cache/
# first: fla's kernels compiled, its minutes of first calls spared.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH=$PWD/python:$PWD/.pydeps${PYTHONPATH:+:$PYTHONPATH} TRITON_CACHE_DIR=$PWD/.triton_cache
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d .pydeps ]; then
  pip install -q --no-index --no-deps --target .pydeps .whl/*.whl
fi
if ls .triton_pack/triton_cache.tgz.part-* >/dev/null 2>&1 && [ ! -d .triton_cache ]; then
  cat .triton_pack/triton_cache.tgz.part-* | tar xzf -
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test sanitize demo train bench)
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader)"
note "== python $(python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"

run_step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-10s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - start))")"
  return $rc
}

for step in "${steps[@]}"; do
  case $step in
    build)
      KDA_DSA_OPS_PTXAS_VERBOSE=1 run_step build 400 python3 setup.py build_ext --inplace || {
        tail -40 "$OUT/build.log"; exit 1; }
      python3 -c 'import kda_dsa_ops; print(kda_dsa_ops.build_info())' | tee -a "$summary"
      # registers / spills of the kernels, for the record
      grep -A2 "Compiling entry function" "$OUT/build.log" | grep -E "Used|spill" | sort | uniq -c | sort -rn \
        | head -20 >>"$summary"
      ;;
    test)
      HYPOTHESIS_PROFILE=gpu run_step tests 480 python3 -m pytest ${TEST_PATHS:-tests} -q -p no:cacheprovider \
        ${TEST_ARGS:-}
      tail -15 "$OUT/tests.log" | tee -a "$summary"
      ;;
    sanitize)
      run_step sanitize 400 bash -c 'for script in ${SANITIZE:-tools/sanitize_*.py}; do for tool in memcheck racecheck; do
          echo "== $tool $script"; compute-sanitizer --tool $tool --error-exitcode 9 python3 $script || exit $?
        done; done'
      grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|sanitize_" "$OUT/sanitize.log" | tee -a "$summary"
      ;;
    demo)  # output goes to the summary (the files that come back from $OUT are limited)
      for config in tiny small; do
        timeout 300 python3 -m kda_dsa_ops.demo --config "$config" 2>&1 | tee -a "$summary"
      done
      ;;
    train)  # the tiny model trained on the GPU (one process), progress lines into the summary
      run_step train 300 python3 -m kda_dsa_ops.train --config tiny --steps 300 --log-every 50 --out runs/gpu_check
      grep -E "^step" "$OUT/train.log" | tee -a "$summary"
      ;;
    ep)  # expert parallelism over NCCL on every GPU of the machine (needs two or more)
      gpus=$(nvidia-smi -L | wc -l)
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 run_step ep 500 \
        python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" bench/bench_ep.py --out "$OUT/results"
      grep -E "^equivalence|^all-to-all|^\{'ep'|^wrote" "$OUT/ep.log" | tee -a "$summary"
      ;;
    groups)  # the real models' layer groups, ours beside transformers + peft (LAYER_GROUPS: the groups to run)
      for group in ${LAYER_GROUPS:-glm-5.3-flash kimi-linear-48b deepseek-v3.2}; do
        run_step "group-$group" 400 python3 bench/bench_train.py --config "$group" --tokens "${GROUP_TOKENS:-16384}" \
          --sequences 2 --backends ${GROUP_BACKENDS:-native transformers} --profile --out "$OUT/results"
        grep -E "tok/s|MFU|out of memory|native /|planned|GPU time|  part |  op " "$OUT/group-$group.log" | tee -a "$summary"
      done
      ;;
    memory)  # the GLM-5.3-Flash group where activations do not fit: recompute and offload beside each other,
      # then the longest single sequence (MEMORY_RUNS: "tokens sequences recompute [offload]" each)
      runs=${MEMORY_RUNS:-"65536 2 none;65536 2 none offload;65536 2 attention;65536 2 block;65536 2 block offload;131072 1 block offload;262144 1 block offload"}
      IFS=';' read -ra specs <<<"$runs"
      for spec in "${specs[@]}"; do
        read -r tokens seqs recompute offload <<<"$spec"
        run_step "memory-$tokens-$recompute${offload:+-offload}" 300 python3 bench/bench_train.py --config glm-5.3-flash \
          --tokens "$tokens" --sequences "$seqs" --recompute "$recompute" ${offload:+--offload} --backends native \
          --steps 3 --warmup 1 --out "$OUT/results"
        grep -E "tok/s|out of memory|MFU|planned" "$OUT/memory-$tokens-$recompute${offload:+-offload}.log" | tee -a "$summary"
      done
      ;;
    ab)  # AB_BUILDS: NAME=PATH of each build's library (or package directory), this tree's own first if built
      builds=()
      for build in ${AB_BUILDS:?AB_BUILDS: NAME=PATH of the builds to compare}; do builds+=(--build "$build"); done
      run_step ab 580 python3 bench/ab_dsa.py "${builds[@]}" --cases ${AB_CASES:?AB_CASES: the cases (bench/ab_dsa.py)} \
        ${AB_ARGS:-}
      grep -E "^\|" "$OUT/ab.log" | tee -a "$summary"
      ;;
    bench | bench-quick)
      quick=()
      [ "$step" = bench-quick ] && quick=(--quick)
      bench_args=()
      [ -n "${BENCH_ONLY:-}" ] && bench_args=(--only $BENCH_ONLY)
      [ -n "${FLA_CASES:-}" ] && bench_args+=(--fla-cases "$FLA_CASES")
      run_step bench 540 python3 bench/run_all.py "${quick[@]}" "${bench_args[@]}" --out "$OUT/results"
      ;;
    *)
      echo "unknown step: $step" >&2
      exit 2
      ;;
  esac
done

if [ "${KEEP_TRITON_CACHE:-0}" = 1 ] && [ -d .triton_cache ]; then
  tar czf - .triton_cache | split -b 15M - "$OUT/triton_cache.tgz.part-"
  note "triton cache: $(cat "$OUT"/triton_cache.tgz.part-* | wc -c) bytes packed into triton_cache.tgz.part-*"
fi
for md in "$OUT"/results/*.md; do
  [ -f "$md" ] && cat "$md"
done
echo
cat "$summary"
packed=$(cd "$OUT" && ls -A | grep -v -x -e summary.txt -e 'gpu_check-.*\.tgz' -e 'triton_cache\.tgz\.part-.*')
if [ -n "$packed" ]; then
  (cd "$OUT" && tar czf "gpu_check-$(date -u +%H%M%S).tgz" $packed && rm -rf $packed)
fi
