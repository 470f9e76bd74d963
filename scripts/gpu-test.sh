#!/usr/bin/env bash
# The GPU half of `cargo xtask gpu-test`, runnable with prebuilt binaries on a GPU machine
# that has no Rust toolchain:
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64 scripts/gpu-test.sh KVROUTE CUDA_TEST_BINARY OUT_DIR [EXAMPLES_DIR [ROUTE_TEST_BINARY]]
# KVROUTE is target/release/kvroute; CUDA_TEST_BINARY is the `cuda` test executable
# (cargo test --release -p kvroute-kernels --test cuda --no-run prints its path); EXAMPLES_DIR,
# if given, holds kvroute-kernels' release example host_to_host (target/release/examples after
# cargo build --release -p kvroute-kernels --examples); ROUTE_TEST_BINARY, if given, is
# kvroute-remote's `route_mem` test executable (cargo test --release -p kvroute-remote --test
# route_mem --no-run), whose GPU holder tests run.
# Writes OUT_DIR/{gpu.txt, tests.txt, memcheck.txt, racecheck.txt, torch.json, batched.txt,
# bench.json, bench.txt, sdpa.json, sdpa.txt, ncu.txt}, with EXAMPLES_DIR host_to_host.txt, with
# ROUTE_TEST_BINARY gpu_holder.txt, and where libfabric loads {demo_cuda.txt, verify_cuda.txt,
# verify_cpu.txt}. Set GPU_TEST_NCU=0 to skip the Nsight Compute readings.
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
has_python_torch() { python3 -c 'import torch, numpy' 2>/dev/null; }

gpu_info() { "$kvroute" kernel gpu-info | tee "$out/gpu.txt"; }
cuda_tests() { KVROUTE_REQUIRE_GPU=1 KVROUTE_REQUIRE_NVRTC=1 "$tests" | tee "$out/tests.txt"; }
# The decode kernels (every variant, split and not) under the memory and race checkers.
sanitize() {
    local tool=$1
    KVROUTE_REQUIRE_GPU=1 compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$tests" gpu_sanitizer_every_decode_variant_small 2>&1 | tee "$out/$tool.txt"
}
memcheck() { sanitize memcheck; }
racecheck() { sanitize racecheck; }
batched() {
    local torch=()
    if has_python_torch; then
        python3 "$here/torch_baselines.py" --out "$out/torch.json" | tee "$out/torch.txt" &&
            torch=(--torch-baselines "$out/torch.json")
    fi
    "$kvroute" bench kernels --backend cuda --batched "${torch[@]}" | tee "$out/batched.txt"
}
bench() {
    "$kvroute" --json bench kernels --backend cuda --quick > "$out/bench.json" &&
        "$kvroute" bench kernels --backend cuda --quick | tee "$out/bench.txt"
}
# Nsight Compute's readings of one launch of the decode kernel at four shapes of the grid
# (memory-bound dense, compute-bound dense, sparse bf16, sparse FP8): what binds each.
ncu_readings() {
    local shape
    : > "$out/ncu.txt"
    for shape in "dense b=64 s_q=1 h_q=16 s_k=4096" "dense b=128 s_q=1 h_q=128 s_k=8192" \
        "sparse b=128 s_q=2 h_q=16 s_k=8192" "sparse-fp8 b=128 s_q=1 h_q=128 s_k=8192"; do
        echo "### $shape" >> "$out/ncu.txt"
        ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:mla_decode \
            --section SpeedOfLight --section ComputeWorkloadAnalysis \
            --section MemoryWorkloadAnalysis --section WarpStateStats \
            "$kvroute" bench kernels --backend cuda --batched --quick --only "$shape" \
            >> "$out/ncu.txt" 2>&1 || return 1
    done
    grep -E '^###|mla_decode|Duration|DRAM Throughput|Compute \(SM\) Throughput|Memory Throughput|Shared|Issue Slots Busy|Executed Ipc A|stall|Stall|Tensor|Pipe|Warp Cycles Per Issued' "$out/ncu.txt" | head -120
}
host_to_host() { "$examples/host_to_host" | tee "$out/host_to_host.txt"; }
gpu_holder() {
    KVROUTE_REQUIRE_GPU=1 "$route_tests" gpu_holder --nocapture 2>&1 | tee "$out/gpu_holder.txt"
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
step "kvroute bench kernels --backend cuda --batched (FlashMLA's shapes, torch beside)" batched
if command -v compute-sanitizer > /dev/null; then
    step "the decode kernels under compute-sanitizer memcheck" memcheck
    step "the decode kernels under compute-sanitizer racecheck" racecheck
else
    echo "SKIPPED: compute-sanitizer is not on PATH" | tee "$out/memcheck.txt" "$out/racecheck.txt"
fi
step "kvroute bench kernels --backend cuda" bench
if [ -n "$examples" ]; then
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
    step "holders with their chunks resident on the GPU (route_mem gpu_holder tests)" gpu_holder
fi
if has_python_torch; then
    step "the CUDA dense partial against PyTorch SDPA on the same bf16 inputs" sdpa
else
    echo "SKIPPED: python3 with torch and numpy is not available" | tee "$out/sdpa.txt"
fi
if [ "${GPU_TEST_NCU:-1}" != 0 ] && command -v ncu > /dev/null; then
    step "Nsight Compute: what binds each decode kernel" ncu_readings
fi
if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu-test: failed: %s\n' "${failed[@]}"
    exit 1
fi
