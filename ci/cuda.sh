#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, in under 8 minutes on an H200 (not yet run on a GPU):
#   1. tests: swap and parity on the cuda backend in float32 with exact gradients, the stress test
#      (random batch shapes, optimizer steps, parameters compared bitwise with a no-swap copy), the
#      backend tests, and the sim swap suite (tests/test_swap_device.py, test_backends.py,
#      test_swap.py): with python3 directly when it has torch, transformers and pytest (offline),
#      else through tox -e cuda (pins from backends/cuda.txt; needs the network);
#   2. the stress test again under TORCH_CUDA_SANITIZER=1 (CSAN: unsynchronized cross-stream
#      accesses fail it);
#   3. the swap benchmark (benchmarks/swap_overlap.py --steps 3 --warmup 1 unless
#      HYPERAC_BENCH_ARGS says otherwise).
#
#   bash ci/cuda.sh [--skip-bench | --bench-only] [pytest args...]
#
#   (no flag)      all three steps
#   --skip-bench   steps 1 and 2
#   --bench-only   step 3: install hyperac (editable, no dependencies fetched) into python3 when it
#                  imports torch, else into a venv .tox/bench-cuda made from backends/cuda.txt.
#
# Environment:
#   HYPERAC_CI_TOX=1         run step 1 through tox -e cuda even when python3 has torch
#   HYPERAC_BENCH_ARGS       benchmark arguments, e.g. "--layers 16" or "--steps 10"
#   HYPERAC_TEST_TIMEOUT     seconds for step 1 (default 180; tox: HYPERAC_TOX_TIMEOUT, default 3600)
#   HYPERAC_CSAN_TIMEOUT     seconds for step 2 (default 120)
#   HYPERAC_BENCH_TIMEOUT    seconds for the benchmark (default 210)
#   HYPERAC_INSTALL_TIMEOUT  seconds for each pip step (default 900)
#   OUT                      if set: the log is copied to $OUT/ci_cuda.log and the benchmark writes
#                            $OUT/swap_overlap.json (else build/swap_overlap.json)
#
# Exit status: the tests' when they failed, else the sanitizer run's, else the benchmark's.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=all
pytest_args=()
for arg in "$@"; do
    case "$arg" in
        --bench-only) mode=bench ;;
        --skip-bench | --no-bench) mode=tests ;;
        *) pytest_args+=("$arg") ;;
    esac
done
TOX_TIMEOUT=${HYPERAC_TOX_TIMEOUT:-3600}
TEST_TIMEOUT=${HYPERAC_TEST_TIMEOUT:-180}
CSAN_TIMEOUT=${HYPERAC_CSAN_TIMEOUT:-120}
BENCH_TIMEOUT=${HYPERAC_BENCH_TIMEOUT:-210}
GPU_TESTS=(tests/test_swap_device.py tests/test_backends.py tests/test_swap.py)
# Deterministic cuBLAS (the tests compare float32 gradients bitwise) and the cuda backend.
export CUBLAS_WORKSPACE_CONFIG=:4096:8 HYPERAC_TEST_BACKEND=cuda PYTHONHASHSEED=0
INSTALL_TIMEOUT=${HYPERAC_INSTALL_TIMEOUT:-900}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-30} PIP_RETRIES=${PIP_RETRIES:-1}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/ci_cuda.log") 2>&1
fi

echo "== environment ($(date -u +%Y-%m-%dT%H:%M:%SZ), mode $mode)"
echo "python3: $(command -v python3) ($(python3 --version 2>&1))"
python3 - <<'EOF' || true
try:
    import torch
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
except Exception as error:
    print(f"torch: not importable ({error})")
try:
    import transformers
    print(f"transformers {transformers.__version__}")
except Exception as error:
    print(f"transformers: not importable ({error})")
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm \
        --format=csv,noheader || echo "nvidia-smi: query failed"
else
    echo "nvidia-smi: not found"
fi

direct_python() {
    [ "${HYPERAC_CI_TOX:-0}" != 1 ] && python3 -c "import torch, transformers, pytest" >/dev/null 2>&1
}

run_tests() {
    if direct_python; then
        local args=("$@")
        [ ${#args[@]} -eq 0 ] && args=("${GPU_TESTS[@]}")
        PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout -k 30 "$TEST_TIMEOUT" \
            python3 -m pytest -q -p no:cacheprovider "${args[@]}"
        return
    fi
    if ! python3 -m tox --version >/dev/null 2>&1; then
        timeout -k 30 "$INSTALL_TIMEOUT" python3 -m pip install -q "tox>=4" \
            || { echo "could not install tox (offline?)"; return 3; }
    fi
    timeout -k 30 "$TOX_TIMEOUT" python3 -m tox -e cuda -- "$@"
}

# Sets PY to a python that has torch, transformers and hyperac (or hyperac through PYTHONPATH).
bench_python() {
    if [ "$mode" = all ] && [ -x .tox/cuda/bin/python ] \
        && .tox/cuda/bin/python -c "import torch, transformers, hyperac" >/dev/null 2>&1; then
        PY=.tox/cuda/bin/python
        return 0
    fi
    if python3 -c "import torch" >/dev/null 2>&1; then
        PY=python3
    else
        echo "python3 has no torch: installing backends/cuda.txt into the venv .tox/bench-cuda"
        if [ ! -x .tox/bench-cuda/bin/python ]; then
            python3 -m venv .tox/bench-cuda || return 3
        fi
        PY=.tox/bench-cuda/bin/python
        timeout -k 30 "$INSTALL_TIMEOUT" "$PY" -m pip install -q -r backends/cuda.txt \
            || { echo "could not install backends/cuda.txt (offline?)"; return 3; }
    fi
    # No build isolation and no dependencies: nothing is fetched when torch is already there.
    timeout -k 30 "$INSTALL_TIMEOUT" "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
        || echo "warning: pip install -e . failed; the benchmark imports hyperac from the checkout"
    if ! "$PY" -c "import transformers" >/dev/null 2>&1; then
        timeout -k 30 "$INSTALL_TIMEOUT" "$PY" -m pip install -q "transformers>=5,<6" \
            || { echo "could not install transformers (offline?)"; return 3; }
    fi
}

run_bench() {
    bench_python || return $?
    local json="${OUT:+$OUT/swap_overlap.json}"
    json="${json:-build/swap_overlap.json}"
    echo "== benchmark: $PY benchmarks/swap_overlap.py ${HYPERAC_BENCH_ARGS:-} (timeout ${BENCH_TIMEOUT}s)"
    # shellcheck disable=SC2086  # HYPERAC_BENCH_ARGS is split into words on purpose
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout -k 30 "$BENCH_TIMEOUT" \
        "$PY" benchmarks/swap_overlap.py --json "$json" ${HYPERAC_BENCH_ARGS:---steps 3 --warmup 1}
}

run_sanitized() {
    local py=python3
    if ! direct_python; then
        py=.tox/cuda/bin/python
    fi
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_CUDA_SANITIZER=1 timeout -k 30 "$CSAN_TIMEOUT" \
        "$py" -m pytest -q -p no:cacheprovider tests/test_swap_device.py -k random_shapes
}

tests_rc=0
csan_rc=0
bench_rc=0
if [ "$mode" != bench ]; then
    echo "== tests: $(direct_python && echo "python3 -m pytest (timeout ${TEST_TIMEOUT}s)" \
        || echo "tox -e cuda (timeout ${TOX_TIMEOUT}s)")"
    run_tests ${pytest_args[@]+"${pytest_args[@]}"} || tests_rc=$?
    echo "== tests: exit status $tests_rc"
    echo "== stress test under TORCH_CUDA_SANITIZER=1 (timeout ${CSAN_TIMEOUT}s)"
    run_sanitized || csan_rc=$?
    echo "== sanitizer: exit status $csan_rc"
fi
if [ "$mode" != tests ]; then
    run_bench || bench_rc=$?
    echo "== benchmark: exit status $bench_rc$([ "$bench_rc" = 124 ] && echo ' (timed out)')"
fi
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
if [ "$csan_rc" -ne 0 ]; then
    exit "$csan_rc"
fi
exit "$bench_rc"
