#!/usr/bin/env bash
# Installs what kda_dsa_ops needs and builds it in place (editable). Sourced by demo.sh and test.sh.
#   torch: installed (TORCH_SPEC, default torch==2.14.1) only when none is importable
#   CUDA kernels: built when nvcc is found (CUDA_HOME, default /usr/local/cuda); KDA_DSA_OPS_CUDA=0 skips them
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
echo "building kda_dsa_ops (CUDA_HOME=${CUDA_HOME:-none}, KDA_DSA_OPS_CUDA=${KDA_DSA_OPS_CUDA:-1})"
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
