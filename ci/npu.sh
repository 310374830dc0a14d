#!/usr/bin/env bash
# Run the test suite on the npu backend (on a machine that has it): pins from backends/npu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "tox>=4"
python3 -m tox -e npu -- "$@"
