#!/usr/bin/env bash
# Run the whole test suite: unit tests, real-torch estimator tests, and the end-to-end tests
# against a real Slurm (started by the test fixture on loopback; needs root and scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
