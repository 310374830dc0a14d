#!/usr/bin/env bash
# Run the test suite on the cuda backend (on a machine that has it): pins from backends/cuda.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "tox>=4"
python3 -m tox -e cuda -- "$@"
