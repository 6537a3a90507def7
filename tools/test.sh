#!/usr/bin/env bash
# Install, build and run the test suite (CUDA tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
INSTALL_EXTRA="pytest hypothesis matplotlib transformers==5.23.0 peft" source "$(dirname "$0")/install.sh"
if [ -n "${CUDA_HOME:-}" ] && [ "${KDA_DSA_OPS_CUDA:-1}" != 0 ]; then
  export KDA_DSA_OPS_EXPECT_CUDA_BUILD=1  # tests/test_build.py then checks the CUDA kernels were built
fi
status=0
"$PY" -m pytest -q tests "$@" || status=$?
if [ "$status" -eq 5 ]; then  # pytest found no tests to run (e.g. a -k filter matched nothing)
  echo "pytest collected no tests" >&2
  status=0
fi
exit "$status"
