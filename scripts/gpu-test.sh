#!/usr/bin/env bash
# The GPU half of `cargo xtask gpu-test`, runnable with prebuilt binaries on a GPU machine
# that has no Rust toolchain:
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64 scripts/gpu-test.sh KVROUTE CUDA_TEST_BINARY OUT_DIR [EXAMPLES_DIR [ROUTE_TEST_BINARY]]
# KVROUTE is target/release/kvroute; CUDA_TEST_BINARY is the `cuda` test executable
# (cargo test --release -p kvroute-kernels --test cuda --no-run prints its path); EXAMPLES_DIR,
# if given, holds kvroute-kernels' release examples split_sweep and host_to_host
# (target/release/examples after cargo build --release -p kvroute-kernels --examples);
# ROUTE_TEST_BINARY, if given, is kvroute-remote's `route_mem` test executable (cargo test
# --release -p kvroute-remote --test route_mem --no-run), whose GPU holder test runs.
# Writes OUT_DIR/{gpu.txt, tests.txt, bench.json, bench.txt, sdpa.json, sdpa.txt}, with
# EXAMPLES_DIR {split_sweep.txt, host_to_host.txt}, with ROUTE_TEST_BINARY gpu_holder.txt,
# and where libfabric loads {demo_cuda.txt, verify_cuda.txt, verify_cpu.txt}.
# Every step runs even if one before it failed (a GPU machine is a rare thing to have); the
# script fails at the end if any did.
set -uo pipefail
kvroute=$1
tests=$2
out=$3
examples=${4:-}
route_tests=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
failed=()

gpu_info() { "$kvroute" kernel gpu-info | tee "$out/gpu.txt"; }
cuda_tests() { KVROUTE_REQUIRE_GPU=1 KVROUTE_REQUIRE_NVRTC=1 "$tests" | tee "$out/tests.txt"; }
bench() {
    "$kvroute" --json bench kernels --backend cuda > "$out/bench.json" &&
        "$kvroute" bench kernels --backend cuda --quick | tee "$out/bench.txt"
}
split_sweep() { "$examples/split_sweep" | tee "$out/split_sweep.txt"; }
host_to_host() { "$examples/host_to_host" | tee "$out/host_to_host.txt"; }
gpu_holder() {
    KVROUTE_REQUIRE_GPU=1 "$route_tests" --exact a_gpu_holder_serves_what_a_cpu_holder_serves \
        --nocapture 2>&1 | tee "$out/gpu_holder.txt"
}
sdpa() {
    python3 "$here/sdpa_compare.py" --kvroute "$kvroute" --bench "$out/bench.json" --out "$out" |
        tee "$out/sdpa.txt"
}

step() {
    echo "== $1"
    if ! "$2"; then
        echo "FAILED: $1"
        failed+=("$1")
    fi
}

step "device and kernel resources" gpu_info
step "CUDA kernels against the reference and the CPU path" cuda_tests
step "kvroute bench kernels --backend cuda" bench
if [ -n "$examples" ]; then
    step "the split planner against every split (examples/split_sweep.rs)" split_sweep
    step "host-to-host calls, CUDA against the CPU (examples/host_to_host.rs)" host_to_host
fi
# libfabric on the library path (the GPU machines lent so far had none: carrying
# libfabric.so.1 and the libraries `ldd` names for it into a folder on LD_LIBRARY_PATH works).
has_libfabric() {
    local d
    for d in ${LD_LIBRARY_PATH//:/ }; do
        [ -e "$d/libfabric.so.1" ] && return 0
    done
    ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1 '
}
gpu_holders_demo() {
    "$kvroute" demo --provider shm --holder-backend cuda | tee "$out/demo_cuda.txt"
}
gpu_holders_verify() {
    "$kvroute" verify-predicate --provider shm --holder-backend cuda | tee "$out/verify_cuda.txt" &&
        "$kvroute" verify-predicate --provider shm --holder-backend cpu | tee "$out/verify_cpu.txt"
}

if has_libfabric; then
    step "the demo with holder processes serving from the GPU, over shm" gpu_holders_demo
    step "verify-predicate with CUDA holders, then CPU holders, over shm" gpu_holders_verify
else
    echo "SKIPPED: libfabric.so.1 is not on the library path (no GPU holders between processes)" |
        tee "$out/demo_cuda.txt"
fi
if [ -n "$route_tests" ]; then
    step "a holder with its chunks resident on the GPU against a CPU holder (route_mem)" gpu_holder
fi
if python3 -c 'import torch, numpy' 2>/dev/null; then
    step "the CUDA dense partial against PyTorch SDPA on the same bf16 inputs" sdpa
else
    echo "SKIPPED: python3 with torch and numpy is not available" | tee "$out/sdpa.txt"
fi
if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu-test: failed: %s\n' "${failed[@]}"
    exit 1
fi
