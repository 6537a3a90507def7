#!/usr/bin/env bash
# Installs what kda_dsa_ops needs and builds it in place (editable). Sourced by demo.sh and test.sh.
#   torch: installed (TORCH_SPEC, default torch==2.14.1) only when none is importable
#   CUDA kernels: built when a CUDA toolkit is found (CUDA_HOME, else /usr/local/cuda: setup.py says
#     which); KDA_DSA_OPS_CUDA=0 skips them
#   a build newer than every source (and of the wanted kind) is kept: demo.sh then test.sh build once
#   INSTALL_EXTRA: more packages to install (a variable: a sourced script sees its caller's arguments)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.14.1}"
fi
"$PY" -m pip install -q ninja numpy ${INSTALL_EXTRA:-}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
want_cuda=$([ -n "${CUDA_HOME:-}" ] && [ "${KDA_DSA_OPS_CUDA:-1}" != 0 ] && echo True || echo False)
built=$(ls python/kda_dsa_ops/_C*.so 2>/dev/null | head -1 || true)
if [ -n "$built" ] && [ -z "$(find csrc setup.py -newer "$built" -print -quit)" ] &&
   [ "$("$PY" -c "import kda_dsa_ops; print('cuda' in kda_dsa_ops.build_info()['backends'])" 2>/dev/null)" = "$want_cuda" ]; then
  echo "kda_dsa_ops: the build in $built is newer than its sources: kept"
else
  echo "building kda_dsa_ops (CUDA_HOME=${CUDA_HOME:-none}, KDA_DSA_OPS_CUDA=${KDA_DSA_OPS_CUDA:-1}): a line per file"
  log=$(mktemp)
  start=$SECONDS
  # pip -v shows ninja's "[i/n] ... -c <file>" lines: print the step and the file, keep the rest for errors
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee "$log" |
       awk '/^ *\[[0-9]+\/[0-9]+\] / && match($0, / -c [^ ]*csrc\/[^ ]+/) {
              f = substr($0, RSTART + 4, RLENGTH - 4); sub(/.*csrc\//, "csrc/", f); print "  " $1 " " f; fflush(); next }
            /^ *kda_dsa_ops: / { sub(/^ +/, ""); if (!seen[$0]++) print; fflush() }'; then
    tail -40 "$log" >&2
    echo "kda_dsa_ops: the build failed (the last lines of its log above)" >&2
    exit 1
  fi
  echo "kda_dsa_ops: built in $((SECONDS - start)) s"
  rm -f "$log"
fi
