#!/usr/bin/env bash
# The main job: install, build, run the MoE demo on the `tiny` configuration (CUDA when present).
set -euo pipefail
source "$(dirname "$0")/install.sh"
"$PY" -m kda_dsa_ops.demo --config tiny "$@"
