#!/usr/bin/env bash
# The GPU half of `cargo xtask gpu-test`, runnable with prebuilt binaries on a GPU machine
# that has no Rust toolchain:
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64 scripts/gpu-test.sh KVROUTE CUDA_TEST_BINARY OUT_DIR
# KVROUTE is target/release/kvroute; CUDA_TEST_BINARY is the `cuda` test executable
# (cargo test --release -p kvroute-kernels --test cuda --no-run prints its path).
# Writes OUT_DIR/{gpu.txt, tests.txt, bench.json, bench.txt, sdpa.json, sdpa.txt}.
set -euo pipefail
kvroute=$1
tests=$2
out=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

echo "== device and kernel resources"
"$kvroute" kernel gpu-info | tee "$out/gpu.txt"

echo "== CUDA kernels against the reference and the CPU path"
KVROUTE_REQUIRE_GPU=1 KVROUTE_REQUIRE_NVRTC=1 "$tests" | tee "$out/tests.txt"

echo "== kvroute bench kernels --backend cuda"
"$kvroute" --json bench kernels --backend cuda > "$out/bench.json"
"$kvroute" bench kernels --backend cuda --quick | tee "$out/bench.txt"

echo "== the CUDA dense partial against PyTorch SDPA on the same bf16 inputs"
if python3 -c 'import torch, numpy' 2>/dev/null; then
    python3 "$here/sdpa_compare.py" --kvroute "$kvroute" --bench "$out/bench.json" --out "$out" \
        | tee "$out/sdpa.txt"
else
    echo "SKIPPED: python3 with torch and numpy is not available" | tee "$out/sdpa.txt"
fi
