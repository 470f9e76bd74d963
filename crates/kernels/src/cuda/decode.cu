// Batched paged MLA decode on the tensor cores: one launch for a batch of requests, each with
// its own query rows, block table, context length and (sparse) top-k selection, over a pool of
// bf16 rows (576 = 512 + 64) or FP8 rows (656 B, DeepSeek-V3.2's layout) in blocks of
// `block_tokens` tokens. Compiled after common.cu.
//
// The arithmetic is FlashAttention's (Dao 2023, "FlashAttention-2", algorithm 1) in FlashMLA's
// shape (one 576-wide latent per token, V = its first 512 dims): S = Q K^T and O += P V on
// bf16 `mma.sync.m16n8k16` with f32 accumulation, an online softmax in f32 between them. P is
// rounded to bf16 for the second product (a relative error of at most 2^-9 per weight in o);
// l sums the f32 values, as FlashAttention and FlashMLA do, so m + ln l, which weighs this
// partial in every merge, is as exact as the CUDA-core kernel's.
//
// Block = 8 warps, one work item (up to BM = 16 MT query rows of one request that share their
// keys) and one split of its keys (grid = (work items, splits)). Per tile of DEC_BN = 32 keys:
//   load    cp.async of the tile's rows (gathered through the block table, or the selection)
//           STAGES tiles ahead into shared memory, their indices loaded one tile earlier
//           still; FP8 rows are dequantized to bf16 there;
//   S       warp w computes an (m16 row tile) x (NW n8 key tiles) x (1 / KG of the 576 dims)
//           block of S: every query and key element is read from shared memory once or
//           twice a tile, not once per key tile; the KG partial sums meet in the softmax;
//   softmax 256 / BM threads per row: scale, mask, running max, p = exp(s - m) as bf16;
//   PV      warp w owns output dims 64 w .. 64 w + 63 of every row: 8 n8 tiles x MT m16 tiles
//           of f32 accumulators, rescaled by exp(m_old - m_new) before each tile.
// With one split the block writes the finished partial: f32 (mode 1) or its 1032-byte wire
// rows (mode 2). With several, each writes its unnormalised state (acc, m, l) at [split *
// total_rows + row], and the last of a work item's blocks to finish (a counter per work item,
// reset by that block) combines them as mla_combine would and writes the finished rows: one
// launch, whatever the split.
//
// Every fragment layout below is the PTX ISA's ("Matrix Fragments for mma.m16n8k16" and
// "ldmatrix"); tests/emu runs this file on the CPU with those layouts emulated.

#define DEC_WARPS 8
#define DEC_THREADS (DEC_WARPS * WARP)
// Keys per tile.
#define DEC_BN 32
// Shared-memory row strides in bf16: 16 B of padding puts the 8 rows one ldmatrix reads in 8
// different groups of 4 banks (a 1152-byte stride would put all 8 in the same one).
#define DEC_KROW (D_QK + 8)
#define DEC_PROW (DEC_BN + 8)
// f32 stride of the S buffer.
#define DEC_SROW (DEC_BN + 8)
// An FP8 row: 512 e4m3, 4 f32 scales (one per 128 dims), 64 bf16 RoPE values (layout.rs).
#define FP8_ROW_BYTES 656
#define FP8_SCALES_AT 512
#define FP8_ROPE_AT 528
#define LOG2E 1.4426950408889634f

#ifndef KVROUTE_EMU
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

// d += a b: a 16x16 bf16 (row), b 16x8 bf16 (col), d 16x8 f32.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes 16 zero bytes instead.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// Two e4m3 (byte 0 the low one) as f32, exactly: through f16x2, which holds every e4m3.
__device__ __forceinline__ float2 e4m3x2_to_f32x2(unsigned short v) {
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    float lo, hi;
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
    return make_float2(lo, hi);
}

// Two f32 as bf16x2 (lo in the low half), round to nearest even in one instruction; equal to
// f32_to_bf16 on every value but NaN (a NaN stays a NaN, with other payload bits).
__device__ __forceinline__ unsigned pack_bf16x2_rn(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#define DEC_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// The wire's bf16 rounding, bit for bit bf16.rs's (NaN payloads included).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}

// Shared-memory layout of one block, in bytes: the query rows, the pipeline's stages, for FP8
// the dequantized tile, S, P, per-row (alpha, m, l), and each stage's valid-key flags.
// cuda/decode.rs repeats `stages` and `bytes` (tests/cuda_emulated.rs checks they agree).
template <int MT, bool FP8>
struct DecCfg {
    static constexpr int BM = 16 * MT;
    static constexpr int STAGES = FP8 ? (MT == 4 ? 4 : 6) : (MT == 1 ? 5 : MT == 2 ? 4 : 3);
    // The S phase's split of the work over the 8 warps: NW n8 key tiles each, the 576 dims
    // in KG groups (MT x (4 / NW) x KG = 8 warps), each group's partial S in its own buffer.
    static constexpr int NW = MT == 1 ? 2 : 4;
    static constexpr int KG = MT == 4 ? 2 : 4;
    static constexpr int SBUFS = KG;
    static constexpr int ROW_BYTES = FP8 ? FP8_ROW_BYTES : D_QK * 2;
    static constexpr int STAGE_ROW = FP8 ? FP8_ROW_BYTES : DEC_KROW * 2;
    static constexpr int STAGE_BYTES = DEC_BN * STAGE_ROW;
    static constexpr int Q_AT = 0;
    static constexpr int K_AT = Q_AT + BM * DEC_KROW * 2;
    static constexpr int T_AT = K_AT + STAGES * STAGE_BYTES;
    static constexpr int S_AT = T_AT + (FP8 ? DEC_BN * DEC_KROW * 2 : 0);
    static constexpr int P_AT = S_AT + SBUFS * BM * DEC_SROW * 4;
    static constexpr int STATS_AT = P_AT + BM * DEC_PROW * 2;
    static constexpr int VALID_AT = STATS_AT + 3 * BM * 4;
    static constexpr int FLAG_AT = VALID_AT + STAGES * DEC_BN * 4;
    static constexpr int BYTES = FLAG_AT + 16;
};

// reqs[r] = (first entry of its block table in `tables`, context tokens, keys (tokens dense,
// k sparse), tiles of keys per split); work[i] = (request, first query row (of all rows),
// rows, first index of its selection in `sel`, or -1 dense). The host checked every table
// entry against the pool and every selected index against its request's context.
template <int MT, bool FP8>
__device__ __forceinline__ void decode_body(
    const bf16_t* __restrict__ q, const unsigned char* __restrict__ kv, int block_tokens,
    const unsigned* __restrict__ tables, const int4* __restrict__ reqs,
    const int4* __restrict__ work, const int* __restrict__ sel, int total_rows, float scale,
    int mode, float* __restrict__ ws_o, float* __restrict__ ws_m, float* __restrict__ ws_l,
    int* __restrict__ counters, float* __restrict__ out_o, float* __restrict__ out_m,
    float* __restrict__ out_l, unsigned char* __restrict__ wire)
{
    typedef DecCfg<MT, FP8> C;
    DEC_DYNAMIC_SMEM(smem);
    bf16_t* const qs = reinterpret_cast<bf16_t*>(smem + C::Q_AT);
    float* const ss = reinterpret_cast<float*>(smem + C::S_AT);
    bf16_t* const ps = reinterpret_cast<bf16_t*>(smem + C::P_AT);
    float* const alpha_s = reinterpret_cast<float*>(smem + C::STATS_AT);
    float* const m_s = alpha_s + C::BM;
    float* const l_s = m_s + C::BM;
    int* const valid_s = reinterpret_cast<int*>(smem + C::VALID_AT);
    int* const flag_s = reinterpret_cast<int*>(smem + C::FLAG_AT);

    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int g = lane >> 2, t4 = lane & 3;  // a fragment's row group and column pair
    const int4 wk = work[blockIdx.x];
    const int4 rq = reqs[wk.x];
    const int split = blockIdx.y, splits = gridDim.y;
    const int row0 = wk.y, nrows = wk.z;
    const bool sparse = wk.w >= 0;
    const int tiles = (rq.z + DEC_BN - 1) / DEC_BN;
    const int tile0 = min(tiles, split * rq.w);
    const int ntiles = min(tiles, tile0 + rq.w) - tile0;

    for (int c = tid; c < C::BM * (D_QK / 8); c += DEC_THREADS) {
        const int r = c / (D_QK / 8), part = c % (D_QK / 8);
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < nrows) v = *reinterpret_cast<const uint4*>(q + (long long)(row0 + r) * D_QK + part * 8);
        *reinterpret_cast<uint4*>(qs + r * DEC_KROW + part * 8) = v;
    }

    // Tile loads: thread tid copies key tid / 8 of a tile, its 16-byte pieces tid % 8,
    // tid % 8 + 8, ...; a padding or out-of-range key is zero-filled (so P = 0 meets V = 0,
    // never garbage) and flagged invalid. A key's token (sparse: a load from the selection)
    // and its block (a load from the table) are fetched two and one tiles before the tile's
    // copies are issued, so no copy waits on the loads that address it.
    const int lj = tid / 8, lsub = tid % 8;
    auto token_of = [&](int tile) -> int {
        const int key = (tile0 + tile) * DEC_BN + lj;
        if (tile >= ntiles || key >= rq.z) return -1;
        return sparse ? sel[wk.w + key] : key;
    };
    auto block_of = [&](int tok) -> unsigned {
        return tok >= 0 ? tables[rq.x + tok / block_tokens] : 0u;
    };
    auto issue = [&](int stage, int tok, unsigned block) {
        const unsigned char* src = kv;
        if (tok >= 0) src = kv + ((long long)block * block_tokens + tok % block_tokens) * C::ROW_BYTES;
        unsigned char* dst = smem + C::K_AT + stage * C::STAGE_BYTES + lj * C::STAGE_ROW;
        const int bytes = tok >= 0 ? 16 : 0;
        for (int p = lsub; p < C::ROW_BYTES / 16; p += 8) cp_async_16(dst + p * 16, src + p * 16, bytes);
        if (lsub == 0) valid_s[stage * DEC_BN + lj] = tok >= 0;
    };

    // The softmax's rows: TPR consecutive threads (one warp's lanes) per row, CPT keys each.
    constexpr int TPR = DEC_THREADS / C::BM;
    constexpr int CPT = DEC_BN / TPR;
    const int srow = tid / TPR, scol = (tid % TPR) * CPT;
    float row_m = neg_inf(), row_l = 0.0f;

    float acc[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][n][i] = 0.0f;

#pragma unroll
    for (int st = 0; st < C::STAGES - 1; ++st) {
        const int tok = token_of(st);
        if (st < ntiles) issue(st, tok, block_of(tok));
        cp_async_commit();
    }
    // The next tile to issue (STAGES - 1): its token and block; the one after: its token.
    int tok_a = token_of(C::STAGES - 1);
    unsigned block_a = block_of(tok_a);
    int tok_b = token_of(C::STAGES);

    for (int it = 0; it < ntiles; ++it) {
        cp_async_wait<C::STAGES - 2>();  // this thread's copies of tile `it` have landed
        __syncthreads();                 // everyone's; and every warp is done with tile it - 1
        {
            const int next = it + C::STAGES - 1;
            if (next < ntiles) issue(next % C::STAGES, tok_a, block_a);
            cp_async_commit();
            // Loads whose values are first used an iteration from now.
            tok_a = tok_b;
            block_a = block_of(tok_a);
            tok_b = token_of(next + 2);
        }
        const int stage = it % C::STAGES;
        const bf16_t* kt = reinterpret_cast<const bf16_t*>(smem + C::K_AT + stage * C::STAGE_BYTES);
        if (FP8) {
            // Dequantize: thread (lj, lsub) converts 8-byte pieces c = lsub + 8 i of key lj's
            // latent (dims 8 c .. 8 c + 7, under scale c / 16) and copies 8 of its RoPE
            // values. Each 8 lanes of one key read and write consecutive bytes (no bank
            // conflicts).
            const unsigned char* raw = smem + C::K_AT + stage * C::STAGE_BYTES + lj * FP8_ROW_BYTES;
            bf16_t* tile = reinterpret_cast<bf16_t*>(smem + C::T_AT);
            bf16_t* dst = tile + lj * DEC_KROW;
            const float* scales = reinterpret_cast<const float*>(raw + FP8_SCALES_AT);
#pragma unroll
            for (int i = 0; i < D_LATENT / 64; ++i) {
                const int c = lsub + 8 * i;
                const float sc = scales[i / 2];
                const uint2 b = *reinterpret_cast<const uint2*>(raw + 8 * c);
                const float2 v0 = e4m3x2_to_f32x2((unsigned short)(b.x & 0xffffu));
                const float2 v1 = e4m3x2_to_f32x2((unsigned short)(b.x >> 16));
                const float2 v2 = e4m3x2_to_f32x2((unsigned short)(b.y & 0xffffu));
                const float2 v3 = e4m3x2_to_f32x2((unsigned short)(b.y >> 16));
                *reinterpret_cast<uint4*>(dst + 8 * c) = make_uint4(
                    pack_bf16x2_rn(v0.x * sc, v0.y * sc), pack_bf16x2_rn(v1.x * sc, v1.y * sc),
                    pack_bf16x2_rn(v2.x * sc, v2.y * sc), pack_bf16x2_rn(v3.x * sc, v3.y * sc));
            }
            *reinterpret_cast<uint4*>(dst + D_LATENT + lsub * 8) =
                *reinterpret_cast<const uint4*>(raw + FP8_ROPE_AT + lsub * 16);
            __syncthreads();
            kt = tile;
        }

        // S = Q K^T. Warp w = (mt * (4 / NW) + ng) * KG + kg: row tile mt, key tiles
        // ng NW .. ng NW + NW - 1, dims 576 kg / KG .. over KSTEPS k-steps. Two accumulators
        // per key tile (even and odd k-steps) keep more MMAs in flight.
        {
            constexpr int NW = C::NW, KG = C::KG, NG = 4 / NW, KSTEPS = D_QK / 16 / KG;
            const int kg = warp % KG, ng = (warp / KG) % NG, mt = warp / (KG * NG);
            float s[NW][2][4];
#pragma unroll
            for (int n = 0; n < NW; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[n][0][j] = s[n][1][j] = 0.0f;
            // A (query rows): lanes 0-15 address rows 0-15 at dims +0, lanes 16-31 at +8.
            const bf16_t* qa = qs + (mt * 16 + (lane & 15)) * DEC_KROW + (lane >> 4) * 8;
            // B (keys as columns), two key tiles per ldmatrix: lanes 0-7 address keys 0-7 at
            // dims +0, 8-15 the same keys at +8, 16-23 keys 8-15 at +0, 24-31 at +8.
            const bf16_t* kb = kt + (ng * NW * 8 + (lane & 7) + (lane >> 4) * 8) * DEC_KROW + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int i = 0; i < KSTEPS; ++i) {
                const int ks = kg * KSTEPS + i;
                unsigned a[4];
                ldsm_x4(a, qa + ks * 16);
#pragma unroll
                for (int pr = 0; pr < NW / 2; ++pr) {
                    unsigned b[4];
                    ldsm_x4(b, kb + pr * 16 * DEC_KROW + ks * 16);
                    mma_16816(s[2 * pr][i & 1], a, b[0], b[1]);
                    mma_16816(s[2 * pr + 1][i & 1], a, b[2], b[3]);
                }
            }
            float* sb = ss + kg * C::BM * DEC_SROW;
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                const int r = mt * 16 + g, c = (ng * NW + n) * 8 + t4 * 2;
                sb[r * DEC_SROW + c] = s[n][0][0] + s[n][1][0];
                sb[r * DEC_SROW + c + 1] = s[n][0][1] + s[n][1][1];
                sb[(r + 8) * DEC_SROW + c] = s[n][0][2] + s[n][1][2];
                sb[(r + 8) * DEC_SROW + c + 1] = s[n][0][3] + s[n][1][3];
            }
        }
        __syncthreads();

        // The online softmax of row srow over keys scol .. scol + CPT - 1.
        {
            const int* vs = valid_s + stage * DEC_BN;
            float p[CPT];
            float tmax = neg_inf();
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float x = 0.0f;
#pragma unroll
                for (int kg = 0; kg < C::KG; ++kg) x += ss[(kg * C::BM + srow) * DEC_SROW + scol + j];
                x = vs[scol + j] ? x * scale : neg_inf();
                p[j] = x;
                tmax = fmaxf(tmax, x);
            }
#pragma unroll
            for (int off = TPR / 2; off > 0; off >>= 1)
                tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float m_new = fmaxf(row_m, tmax);
            float alpha = 1.0f, sum = 0.0f;
            if (m_new != neg_inf()) {  // else no valid key yet: nothing to rescale, p = 0
                // exp(x) as 2^(x log2 e): ex2.approx, within 2 ulp, where expf's accurate
                // range reduction costs several times the instructions.
                alpha = exp2f((row_m - m_new) * LOG2E);
#pragma unroll
                for (int j = 0; j < CPT; ++j) {
                    p[j] = exp2f((p[j] - m_new) * LOG2E);
                    sum += p[j];
                }
            } else {
#pragma unroll
                for (int j = 0; j < CPT; ++j) p[j] = 0.0f;
            }
#pragma unroll
            for (int off = TPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            row_l = row_l * alpha + sum;
            row_m = m_new;
            unsigned* prow = reinterpret_cast<unsigned*>(ps + srow * DEC_PROW + scol);
#pragma unroll
            for (int j = 0; j < CPT; j += 2) prow[j / 2] = pack_bf16x2_rn(p[j], p[j + 1]);
            if (tid % TPR == 0) alpha_s[srow] = alpha;
        }
        __syncthreads();

        // O += P V over this warp's 64 dims.
        {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float lo = alpha_s[mt * 16 + g], hi = alpha_s[mt * 16 + g + 8];
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    acc[mt][n][0] *= lo;
                    acc[mt][n][1] *= lo;
                    acc[mt][n][2] *= hi;
                    acc[mt][n][3] *= hi;
                }
            }
            // A (P rows): as Q's. B (V, key-major): with .trans, lanes 0-7 address keys 0-7 and
            // lanes 8-15 keys 8-15 at dims +0, lanes 16-31 the same keys at dims +8: b0, b1 of
            // two n8 tiles.
            const bf16_t* pa = ps + (lane & 15) * DEC_PROW + (lane >> 4) * 8;
            const bf16_t* vb = kt + ((lane & 7) + ((lane >> 3) & 1) * 8) * DEC_KROW + warp * 64 + (lane >> 4) * 8;
#pragma unroll
            for (int kk = 0; kk < DEC_BN / 16; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], pa + mt * 16 * DEC_PROW + kk * 16);
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    unsigned b[4];
                    ldsm_x4_trans(b, vb + kk * 16 * DEC_KROW + np * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                        mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy may land after the block has gone

    if (tid % TPR == 0) {
        m_s[srow] = row_m;
        l_s[srow] = row_l;
    }
    __syncthreads();
    // One split: the finished rows. Several: this split's state, for the last block.
    const bool split_state = splits > 1;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = mt * 16 + g + half * 8;
            if (r >= nrows) continue;
            const long long row = row0 + r;
            const float m = m_s[r], l = l_s[r];
            const long long at = split_state ? (long long)split * total_rows + row : row;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const int dim = warp * 64 + n * 8 + t4 * 2;
                float x = acc[mt][n][2 * half], y = acc[mt][n][2 * half + 1];
                if (split_state) {
                    *reinterpret_cast<float2*>(ws_o + at * D_LATENT + dim) = make_float2(x, y);
                    continue;
                }
                x = l > 0.0f ? x / l : 0.0f;
                y = l > 0.0f ? y / l : 0.0f;
                if (mode == 2) {
                    *reinterpret_cast<unsigned*>(wire + row * WIRE_ROW_BYTES + dim * 2) = pack_bf16x2(x, y);
                } else {
                    *reinterpret_cast<float2*>(out_o + at * D_LATENT + dim) = make_float2(x, y);
                }
            }
            if (warp == 0 && t4 == 0) {
                if (split_state) {
                    ws_m[at] = m;
                    ws_l[at] = l;
                } else if (mode == 2) {
                    float* ml = reinterpret_cast<float*>(wire + row * WIRE_ROW_BYTES + D_LATENT * 2);
                    ml[0] = m;
                    ml[1] = l;
                } else {
                    out_m[at] = m;
                    out_l[at] = l;
                }
            }
        }
    }
    if (!split_state) return;

    // The last block of this work item to get here combines every split's state (the
    // threadFenceReduction pattern: each block's states are visible before its count).
    __threadfence();
    __syncthreads();
    if (tid == 0) flag_s[0] = atomicAdd(&counters[blockIdx.x], 1) == splits - 1;
    __syncthreads();
    if (!flag_s[0]) return;
    __threadfence();
    // As mla_combine: parts with l = 0 are skipped, a part whose m or l is not finite
    // poisons the row (NaN), weights exp(m_s - max m) in f64, one division at the end.
    // The rows go in groups of RG, as many as the freed pipeline stages hold every
    // (row, split)'s statistics for: (1) every thread loads some of the group's (m, l) pairs,
    // all in flight together; (2) a warp per row reduces its max and its poison flag; (3) every
    // thread computes some of the weights; (4) thread tid sums dims 4 (tid % 128) .. + 3 of
    // every other row (rows tid / 128, + 2, ...), eight splits' loads in flight at a time.
    // No step waits on a chain of loads one row or one split long.
    constexpr int CAP = (C::S_AT - C::K_AT) / 16;
    double* const cw = reinterpret_cast<double*>(smem + C::K_AT);
    float* const cm = reinterpret_cast<float*>(cw + CAP);
    float* const cl = cm + CAP;
    float* const rbig = alpha_s;  // per row of the group: its max m
    float* const rbad = m_s;      // 1: poisoned, 0: not
    const int group = max(1, min(nrows, CAP / splits));
    for (int r0 = 0; r0 < nrows; r0 += group) {
        const int rg = min(group, nrows - r0), pairs = rg * splits;
        for (int p = tid; p < pairs; p += DEC_THREADS) {
            const int r = p / splits, sp = p % splits;
            const long long at = (long long)sp * total_rows + row0 + r0 + r;
            cm[p] = __ldcg(ws_m + at);
            cl[p] = __ldcg(ws_l + at);
        }
        __syncthreads();
        for (int r = warp; r < rg; r += DEC_WARPS) {
            float big = neg_inf(), bad = 0.0f;
            for (int sp = lane; sp < splits; sp += WARP) {
                const float mp = cm[r * splits + sp], lp = cl[r * splits + sp];
                if (isnan(mp) || mp == -neg_inf() || !isfinite(lp)) bad = 1.0f;
                if (lp > 0.0f) big = fmaxf(big, mp);
            }
#pragma unroll
            for (int off = WARP / 2; off > 0; off /= 2) {
                big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, off));
                bad = fmaxf(bad, __shfl_xor_sync(0xffffffffu, bad, off));
            }
            if (lane == 0) {
                rbig[r] = big;
                rbad[r] = bad;
            }
        }
        __syncthreads();
        for (int p = tid; p < pairs; p += DEC_THREADS) {
            const int r = p / splits;
            const bool empty = rbad[r] != 0.0f || rbig[r] == neg_inf();
            cw[p] = !empty && cl[p] > 0.0f ? exp((double)cm[p] - (double)rbig[r]) : 0.0;
        }
        __syncthreads();
        const int d4 = (tid % (DEC_THREADS / 2)) * 4;
        for (int r = tid / (DEC_THREADS / 2); r < rg; r += 2) {
            const long long row = row0 + r0 + r;
            const bool poisoned = rbad[r] != 0.0f;
            const float big = rbig[r];
            double x0 = 0.0, x1 = 0.0, x2 = 0.0, x3 = 0.0, lsum = 0.0;
            if (!poisoned && big != neg_inf()) {
                // A skipped split's o is zero (an empty state), and weighs 0.
#pragma unroll 8
                for (int sp = 0; sp < splits; ++sp) {
                    const long long at = (long long)sp * total_rows + row;
                    const float4 o = __ldcg(reinterpret_cast<const float4*>(ws_o + at * D_LATENT + d4));
                    const double w = cw[r * splits + sp];
                    lsum += w * (double)cl[r * splits + sp];
                    x0 += w * (double)o.x;
                    x1 += w * (double)o.y;
                    x2 += w * (double)o.z;
                    x3 += w * (double)o.w;
                }
            }
            float f[4], fm, fl;
            if (poisoned) {
                f[0] = f[1] = f[2] = f[3] = fm = fl = __int_as_float(0x7fc00000);
            } else if (big == neg_inf()) {
                f[0] = f[1] = f[2] = f[3] = 0.0f;
                fm = neg_inf();
                fl = 0.0f;
            } else {
                f[0] = (float)(x0 / lsum);
                f[1] = (float)(x1 / lsum);
                f[2] = (float)(x2 / lsum);
                f[3] = (float)(x3 / lsum);
                fm = big;
                fl = (float)lsum;
            }
            const bool first = d4 == 0;
            if (mode == 2) {
                unsigned char* wr = wire + row * WIRE_ROW_BYTES;
                *reinterpret_cast<unsigned*>(wr + d4 * 2) = pack_bf16x2(f[0], f[1]);
                *reinterpret_cast<unsigned*>(wr + d4 * 2 + 4) = pack_bf16x2(f[2], f[3]);
                if (first) {
                    float* ml = reinterpret_cast<float*>(wr + D_LATENT * 2);
                    ml[0] = fm;
                    ml[1] = fl;
                }
            } else {
                *reinterpret_cast<float4*>(out_o + row * D_LATENT + d4) = make_float4(f[0], f[1], f[2], f[3]);
                if (first) {
                    out_m[row] = fm;
                    out_l[row] = fl;
                }
            }
        }
        __syncthreads();  // the group's statistics are read before the next group's are written
    }
    if (tid == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}

#define DEC_PARAMS                                                                          \
    const bf16_t *__restrict__ q, const unsigned char *__restrict__ kv, int block_tokens,    \
        const unsigned *__restrict__ tables, const int4 *__restrict__ reqs,                  \
        const int4 *__restrict__ work, const int *__restrict__ sel, int total_rows,          \
        float scale, int mode, float *__restrict__ ws_o, float *__restrict__ ws_m,           \
        float *__restrict__ ws_l, int *__restrict__ counters, float *__restrict__ out_o,     \
        float *__restrict__ out_m, float *__restrict__ out_l, unsigned char *__restrict__ wire
#define DEC_ARGS q, kv, block_tokens, tables, reqs, work, sel, total_rows, scale, mode, ws_o, ws_m, ws_l, counters, out_o, out_m, out_l, wire

extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) mla_decode_m1(DEC_PARAMS) { decode_body<1, false>(DEC_ARGS); }
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) mla_decode_m2(DEC_PARAMS) { decode_body<2, false>(DEC_ARGS); }
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) mla_decode_m4(DEC_PARAMS) { decode_body<4, false>(DEC_ARGS); }
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) mla_decode_fp8_m1(DEC_PARAMS) { decode_body<1, true>(DEC_ARGS); }
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) mla_decode_fp8_m2(DEC_PARAMS) { decode_body<2, true>(DEC_ARGS); }
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1) mla_decode_fp8_m4(DEC_PARAMS) { decode_body<4, true>(DEC_ARGS); }
