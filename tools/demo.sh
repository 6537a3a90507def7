#!/usr/bin/env bash
# The main job: install and build, then on the `tiny` configuration
#   1. the op demo: an MoE layer and a KDA step on the native kernels vs the float64 reference;
#   2. training on the associative-recall task: phase 1 trains every parameter, phase 2 LoRA-
#      fine-tunes that checkpoint on a variant of the task (other key/value vocabulary).
# CPU: 2 gloo processes, FSDP2 + EP 2. One GPU: one process on the CUDA kernels. Two or more
# GPUs: 2 processes on NCCL, EP 2. Outputs (checkpoints, log.json, loss.png) in runs/demo/.
# Extra arguments go to both training phases.
set -euo pipefail
INSTALL_EXTRA="matplotlib" source "$(dirname "$0")/install.sh"  # matplotlib: the loss curves
"$PY" -m kda_dsa_ops.demo --config tiny

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -eq 1 ]; then
  launch=("$PY" -m kda_dsa_ops.train --ep 1)
else
  launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m kda_dsa_ops.train --ep 2)
fi
echo "== phase 1: train tiny on the recall task (${launch[*]:0:5} ...)"
"${launch[@]}" --config tiny --out runs/demo/base "$@"
echo "== phase 2: LoRA (rank 16) from that checkpoint on the shifted task"
"${launch[@]}" --config tiny --lora-rank 16 --task shifted --steps 300 --init-from runs/demo/base/final \
  --out runs/demo/lora "$@"
echo "loss curves: runs/demo/base/loss.png, runs/demo/lora/loss.png"
