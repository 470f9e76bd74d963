// Definitions every kvroute kernel shares, compiled first (cuda/nvrtc.rs concatenates
// common.cu, kernels.cu and decode.cu into one NVRTC program; tests/emu compiles common.cu
// and decode.cu as C++ for the CPU emulation of the tensor-core kernel).
//
// No CUDA headers: bf16 travels as its raw bits (unsigned short), widened by a shift. The
// layouts are those of src/layout.rs: cache and query rows of 576 = 512 latent + 64 RoPE dims,
// partials (o, m, l) with natural-log semantics.

typedef unsigned short bf16_t;

#define D_LATENT 512
#define D_ROPE 64
#define D_QK 576
#define PAIRS 32
#define PAGE_TOKENS 64
#define WARP 32
// A partial row on the wire: 512 bf16 of o, then m and l as f32 (partial.rs).
#define WIRE_ROW_BYTES (D_LATENT * 2 + 8)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float bf16_to_f32(bf16_t b) {
    return __uint_as_float(((unsigned)b) << 16);
}

// f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN (bf16.rs from_f32).
__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    unsigned bits = __float_as_uint(x);
    if (x != x) return (bf16_t)((bits >> 16) | 0x0040u);
    unsigned lsb = (bits >> 16) & 1u;
    return (bf16_t)((bits + 0x7fffu + lsb) >> 16);
}
