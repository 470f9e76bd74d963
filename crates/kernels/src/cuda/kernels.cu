// kvroute MLA decode kernels, compiled at run time by NVRTC (see cuda/nvrtc.rs).
//
// No CUDA headers: bf16 travels as its raw bits (unsigned short), widened by a shift. The
// layouts are those of src/layout.rs: cache and query rows of 576 = 512 latent + 64 RoPE dims,
// 64-token pages addressed by a block table, partials (o, m, l) with natural-log semantics.
// Compiled with --fmad=false so that nothing is contracted behind our back: the FMAs below are
// the explicit fmaf() calls, and the splice's double arithmetic rounds exactly as the CPU's.

typedef unsigned short bf16_t;

#define D_LATENT 512
#define D_ROPE 64
#define D_QK 576
#define PAIRS 32
#define PAGE_TOKENS 64
#define WARP 32
// Query rows per block of the partial kernel: one warp each.
#define ROWS 8
// Cache tokens per shared-memory tile of the partial kernel.
#define TILE 16
#define PARTIAL_THREADS (ROWS * WARP)
// Output dims of o per lane: lane, lane + 32, ..., lane + 480.
#define DIMS_PER_LANE (D_LATENT / WARP)
// The combine: threads per block, dims per block, and so groups of parts summed side by side.
#define COMBINE_THREADS 512
#define COMBINE_DIMS 128
#define COMBINE_GROUPS (COMBINE_THREADS / COMBINE_DIMS)
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

// f64 -> bf16 bits with a single rounding (bf16.rs from_f64): round to f32, and when that
// landed exactly on a bf16 tie that x itself is not on, nudge one f32 ulp towards x.
__device__ __forceinline__ bf16_t f64_to_bf16(double x) {
    float f = __double2float_rn(x);
    unsigned bits = __float_as_uint(f);
    if (!isfinite(f) || (bits & 0xffffu) != 0x8000u) return f32_to_bf16(f);
    // Sign-magnitude: bits + 1 grows the magnitude, bits - 1 shrinks it, whatever the sign.
    double back = fabs((double)f), want = fabs(x);
    if (back < want) f = __uint_as_float(bits + 1u);
    else if (back > want) f = __uint_as_float(bits - 1u);
    return f32_to_bf16(f);
}

// Element offset of cache token t: row t of a contiguous cache when table is null, else slot
// t % 64 of page table[t / 64] of the pool.
__device__ __forceinline__ long long cache_row(const unsigned* __restrict__ table, long long t) {
    if (table == 0) return t * D_QK;
    return ((long long)table[t / PAGE_TOKENS] * PAGE_TOKENS + t % PAGE_TOKENS) * D_QK;
}

// Split-K flash-decoding partial attention (dense and sparse).
//
// grid.x = splits of the key list, grid.y = row groups; ROWS rows per block sharing each
// TILE-token tile of cache rows in shared memory, one warp per row. A group of fewer rows
// (a short query, or a short tail) still has ROWS warps: each row gets ROWS / rows_cap of
// them (slices), each slice takes every slices-th key of a tile, and the block merges its
// slices' states at the end. One warp alone works through a tile's keys one after
// another, so without slices a one-row group left seven warps idle and took about eight
// times as long per tile.
//   dense  (sel == null): group g is query rows 8g.., the key list is cache tokens 0..keys.
//   sparse (sel != null): a group is up to 8 of one query token's rows_per_token rows, the key
//          list is sel[token * keys ..][..keys], -1 = padding (skipped), a repeated index
//          counts once per occurrence.
// Each (split, row) writes its unnormalised state (acc = sum p v, m, l) to the workspace at
// [split * mq + row]; mla_combine finishes. q is pre-scaled in f32, as on the CPU.
extern "C" __global__ void __launch_bounds__(PARTIAL_THREADS) mla_partial(
    const bf16_t* __restrict__ q, int mq,
    const bf16_t* __restrict__ cache, const unsigned* __restrict__ table,
    const int* __restrict__ sel, int keys, int rows_per_token, int groups_per_token,
    int keys_per_split, float scale,
    float* __restrict__ ws_o, float* __restrict__ ws_m, float* __restrict__ ws_l)
{
    __shared__ __align__(16) float qs[ROWS][D_QK];
    __shared__ __align__(16) unsigned ks[TILE][D_QK / 2];
    __shared__ int valid[TILE];
    __shared__ float slice_m[ROWS], slice_l[ROWS];

    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;

    int row0, nrows, token = 0;
    if (sel != 0) {
        token = blockIdx.y / groups_per_token;
        const int sub = blockIdx.y % groups_per_token;
        row0 = token * rows_per_token + sub * ROWS;
        nrows = min(ROWS, (token + 1) * rows_per_token - row0);
    } else {
        row0 = blockIdx.y * ROWS;
        nrows = min(ROWS, mq - row0);
    }
    const int k0 = blockIdx.x * keys_per_split;
    const int k1 = min(keys, k0 + keys_per_split);

    for (int i = threadIdx.x; i < ROWS * D_QK; i += PARTIAL_THREADS) {
        const int r = i / D_QK, d = i % D_QK;
        qs[r][d] = r < nrows ? bf16_to_f32(q[(long long)(row0 + r) * D_QK + d]) * scale : 0.0f;
    }

    // rows_cap: nrows rounded up to a power of two; warp = slice * rows_cap + row.
    const int rows_cap = nrows > 4 ? 8 : nrows > 2 ? 4 : nrows > 1 ? 2 : 1;
    const int slices = ROWS / rows_cap;
    const int r = warp % rows_cap, slice = warp / rows_cap;
    const bool live = r < nrows;
    float m = neg_inf(), l = 0.0f;
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.0f;

    const float2* qrow = reinterpret_cast<const float2*>(qs[r]);
    for (int t0 = k0; t0 < k1; t0 += TILE) {
        const int n = min(TILE, k1 - t0);
        __syncthreads();  // the previous tile (and, the first time, qs) is complete
        for (int j = warp; j < TILE; j += ROWS) {
            long long tok = -1;
            if (j < n) tok = sel != 0 ? (long long)sel[(long long)token * keys + t0 + j] : (long long)(t0 + j);
            if (lane == 0) valid[j] = tok >= 0;
            if (tok >= 0) {
                const unsigned* src = reinterpret_cast<const unsigned*>(cache + cache_row(table, tok));
                for (int w = lane; w < D_QK / 2; w += WARP) ks[j][w] = src[w];
            }
        }
        __syncthreads();
        if (!live) continue;

        float s[TILE];
        float tile_max = neg_inf();
        unsigned ok = 0;
#pragma unroll
        for (int jj = 0; jj < TILE; ++jj) {
            s[jj] = neg_inf();
            const int j = jj * slices + slice;  // this slice's jj-th key of the tile
            if (j < n && valid[j]) {  // uniform across the warp
                float dot = 0.0f;
#pragma unroll
                for (int w = lane; w < D_QK / 2; w += WARP) {
                    const unsigned kk = ks[j][w];
                    const float2 qq = qrow[w];
                    dot = fmaf(qq.x, __uint_as_float(kk << 16), dot);
                    dot = fmaf(qq.y, __uint_as_float(kk & 0xffff0000u), dot);
                }
#pragma unroll
                for (int off = WARP / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
                s[jj] = dot;
                ok |= 1u << jj;
                tile_max = fmaxf(tile_max, dot);
            }
        }
        if (ok == 0) continue;
        const float m_new = fmaxf(m, tile_max);
        const float alpha = expf(m - m_new);  // 0 on the first live tile (m = -inf)
        l *= alpha;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] *= alpha;
#pragma unroll
        for (int jj = 0; jj < TILE; ++jj) {
            if (ok & (1u << jj)) {
                const int j = jj * slices + slice;
                const float p = expf(s[jj] - m_new);
                l += p;
                // Dim d = lane + 32 i lives in word d / 2, in its high half when d is odd.
#pragma unroll
                for (int i = 0; i < DIMS_PER_LANE; ++i) {
                    const unsigned kk = ks[j][(lane >> 1) + i * (WARP / 2)];
                    const float v = (lane & 1) ? __uint_as_float(kk & 0xffff0000u) : __uint_as_float(kk << 16);
                    acc[i] = fmaf(p, v, acc[i]);
                }
            }
        }
        m = m_new;
    }

    if (slices > 1) {
        // Merge the slices' states into slice 0's warp of each row, through shared memory
        // (ks is free once every warp is past the last tile: 8 states of 512 floats fit).
        __syncthreads();
        float* states = reinterpret_cast<float*>(&ks[0][0]);
        if (live && slice > 0) {
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) states[warp * D_LATENT + lane + i * WARP] = acc[i];
            if (lane == 0) {
                slice_m[warp] = m;
                slice_l[warp] = l;
            }
        }
        __syncthreads();
        if (live && slice == 0) {
            float big = m;
            for (int k = 1; k < slices; ++k) big = fmaxf(big, slice_m[r + k * rows_cap]);
            if (big != neg_inf()) {  // else no slice saw a key: the empty state stands
                const float a0 = expf(m - big);
                l *= a0;
#pragma unroll
                for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] *= a0;
                for (int k = 1; k < slices; ++k) {
                    const int w = r + k * rows_cap;
                    const float a = expf(slice_m[w] - big);  // 0 for a slice with no key
                    l = fmaf(a, slice_l[w], l);
#pragma unroll
                    for (int i = 0; i < DIMS_PER_LANE; ++i)
                        acc[i] = fmaf(a, states[w * D_LATENT + lane + i * WARP], acc[i]);
                }
                m = big;
            }
        }
    }

    if (live && slice == 0) {
        const long long at = (long long)blockIdx.x * mq + row0 + r;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) ws_o[at * D_LATENT + lane + i * WARP] = acc[i];
        if (lane == 0) {
            ws_m[at] = m;
            ws_l[at] = l;
        }
    }
}

// Combines `parts` partial states per row into one normalised partial, as merge.rs
// combine_row does: parts with l = 0 are skipped (never -inf - -inf, and their o is never
// read), weights exp(m_p - max m) and sums in f64, one division at the end. `normalized`
// says whether o is already divided by l (a peer's partial: weight w l) or not (a split's
// state: weight w). With `wire` set, each row goes there in its 1032-byte wire form instead
// of to out_o / out_m / out_l: o as bf16 (rounded as bf16.rs from_f32 rounds), then m and l
// as f32, so that a holder's reply comes down at half the bytes, already encoded.
//
// grid = (rows, D_LATENT / COMBINE_DIMS): a block finishes COMBINE_DIMS dims of one row. Its
// threads are COMBINE_GROUPS groups of COMBINE_DIMS, one dim per thread; group g sums parts
// g, g + COMBINE_GROUPS, ... eight loads at a time, and the groups' sums are added in group
// order at the end. A split-K finish has one part per split, up to 256 of them: taken one
// after another, each load waited for, they took about 50 of the 62 us of a one-row call at
// ct = 2048 on an H200, so the loads of many parts must be in flight together. The sums are f64, so their order moves the
// result by about 1e-16 relative, far below the f32 it is rounded to.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) mla_combine(
    const float* __restrict__ o, const float* __restrict__ m, const float* __restrict__ l,
    int parts, int mq, int normalized,
    float* __restrict__ out_o, float* __restrict__ out_m, float* __restrict__ out_l,
    unsigned char* __restrict__ wire)
{
    // A chunk's weights for o; -1 marks a skipped part (a live part's weight is >= 0).
    __shared__ double w_value[COMBINE_THREADS];
    __shared__ double group_sum[COMBINE_GROUPS][COMBINE_DIMS];
    __shared__ double warp_l[COMBINE_THREADS / WARP];
    __shared__ float warp_big[COMBINE_THREADS / WARP];
    const int row = blockIdx.x;
    const int dim = threadIdx.x % COMBINE_DIMS, group = threadIdx.x / COMBINE_DIMS;
    const long long out_at = (long long)row * D_LATENT + blockIdx.y * COMBINE_DIMS + dim;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const bool writes_ml = blockIdx.y == 0 && threadIdx.x == 0;
    unsigned char* const wire_row = wire ? wire + (long long)row * WIRE_ROW_BYTES : 0;
    // Row `row`'s o value at this thread's dim, and its (m, l), to whichever output is set.
    auto put_o = [&](float v) {
        if (wire_row) reinterpret_cast<bf16_t*>(wire_row)[blockIdx.y * COMBINE_DIMS + dim] = f32_to_bf16(v);
        else out_o[out_at] = v;
    };
    auto put_ml = [&](float mv, float lv) {
        if (wire_row) {
            float* ml = reinterpret_cast<float*>(wire_row + D_LATENT * 2);
            ml[0] = mv;
            ml[1] = lv;
        } else {
            out_m[row] = mv;
            out_l[row] = lv;
        }
    };

    // Pass 1: the largest m over live parts, and whether any state is non-finite. A NaN or
    // infinite state (non-finite inputs or scores) poisons the row: skipping it as empty
    // would give a finite, wrong result.
    float big = neg_inf();
    int poisoned = 0;
    for (int p = threadIdx.x; p < parts; p += COMBINE_THREADS) {
        const long long at = (long long)p * mq + row;
        const float mp = m[at], lp = l[at];
        if (isnan(mp) || mp == -neg_inf() || !isfinite(lp)) poisoned = 1;
        if (lp > 0.0f) big = fmaxf(big, mp);
    }
    poisoned = __syncthreads_or(poisoned);
    for (int off = WARP / 2; off > 0; off >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, off));
    if (lane == 0) warp_big[warp] = big;
    __syncthreads();
    big = warp_big[0];
    for (int i = 1; i < COMBINE_THREADS / WARP; ++i) big = fmaxf(big, warp_big[i]);

    if (poisoned) {
        if (group == 0) put_o(__int_as_float(0x7fc00000));
        if (writes_ml) put_ml(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
        return;
    }
    if (big == neg_inf()) {
        if (group == 0) put_o(0.0f);
        if (writes_ml) put_ml(neg_inf(), 0.0f);
        return;
    }

    // Pass 2, COMBINE_THREADS parts at a time: each thread weighs one part, then each group
    // sums its share of the chunk's parts for its dim.
    double my_l = 0.0;  // the weighted l of the parts this thread weighed
    double acc = 0.0;
    const float* col = o + (long long)row * D_LATENT + blockIdx.y * COMBINE_DIMS + dim;
    const long long part_stride = (long long)mq * D_LATENT;
    for (int p0 = 0; p0 < parts; p0 += COMBINE_THREADS) {
        const int n = min(COMBINE_THREADS, parts - p0);
        if (threadIdx.x < n) {
            const long long at = (long long)(p0 + threadIdx.x) * mq + row;
            const float lp = l[at];
            double wv = -1.0;
            if (lp > 0.0f) {
                const double w = exp((double)m[at] - (double)big);
                my_l += w * (double)lp;
                wv = normalized ? w * (double)lp : w;
            }
            w_value[threadIdx.x] = wv;
        }
        __syncthreads();
        const float* base = col + (long long)p0 * part_stride;
        int j = group;
        for (; j + 7 * COMBINE_GROUPS < n; j += 8 * COMBINE_GROUPS) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = base[(long long)(j + u * COMBINE_GROUPS) * part_stride];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const double w = w_value[j + u * COMBINE_GROUPS];
                if (w >= 0.0) acc += w * (double)v[u];
            }
        }
        for (; j < n; j += COMBINE_GROUPS) {
            const double w = w_value[j];
            if (w >= 0.0) acc += w * (double)base[(long long)j * part_stride];
        }
        __syncthreads();  // the chunk's weights are read before the next chunk's are written
    }

    // The denominator: every thread's weighted l, summed over the block in a fixed order.
    for (int off = WARP / 2; off > 0; off >>= 1) my_l += __shfl_xor_sync(0xffffffffu, my_l, off);
    if (lane == 0) warp_l[warp] = my_l;
    group_sum[group][dim] = acc;
    __syncthreads();
    double sum_l = 0.0;
    for (int i = 0; i < COMBINE_THREADS / WARP; ++i) sum_l += warp_l[i];
    if (group == 0) {
        double total = 0.0;
#pragma unroll
        for (int g = 0; g < COMBINE_GROUPS; ++g) total += group_sum[g][dim];
        put_o((float)(total / sum_l));
    }
    if (writes_ml) put_ml(big, (float)sum_l);
}

// The delta-rotation splice of every layer of a chunk in one launch: one warp per
// (layer, token) row of src [layers, n, 576], or with src null of the pool itself (in place:
// the latent dims are not touched). The 512 latent dims are copied bit-exactly;
// pair i of the RoPE band (interleaved (2i, 2i+1) or half (i, i + 32)) is rotated by the
// angles the CPU computed in f64 (cs[t][i] = (cos, sin)), in f64 with one rounding to bf16,
// so the result is bit-identical to the CPU path. The row lands in slot t % 64 of page
// table[layer * pages_per_layer + t / 64] of the pool (SpliceJob checked the table).
extern "C" __global__ void mla_splice(
    const bf16_t* __restrict__ src, int layers, int n, const double* __restrict__ cs,
    int half_layout, bf16_t* __restrict__ pool, const unsigned* __restrict__ table)
{
    const long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= (long long)layers * n) return;
    const int layer = (int)(row / n), t = (int)(row % n);
    const int pages_per_layer = (n + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const long long dst_at =
        ((long long)table[(long long)layer * pages_per_layer + t / PAGE_TOKENS] * PAGE_TOKENS + t % PAGE_TOKENS) * D_QK;
    bf16_t* d = pool + dst_at;
    // In place (src == nullptr): the row is already in the pool; only its RoPE band changes.
    const bf16_t* s = src ? src + row * D_QK : d;

    if (src) {
        // 512 latent dims = 64 x 16 B; rows are 1152 B apart, so 16 B aligned.
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        d4[lane] = s4[lane];
        d4[lane + WARP] = s4[lane + WARP];
    }

    const int i = lane;  // one RoPE pair per lane
    const int a = half_layout ? i : 2 * i;
    const int b = half_layout ? i + PAIRS : 2 * i + 1;
    const double x = (double)bf16_to_f32(s[D_LATENT + a]);
    const double y = (double)bf16_to_f32(s[D_LATENT + b]);
    const double c = cs[((long long)t * PAIRS + i) * 2];
    const double sn = cs[((long long)t * PAIRS + i) * 2 + 1];
    d[D_LATENT + a] = f64_to_bf16(__dsub_rn(__dmul_rn(x, c), __dmul_rn(y, sn)));
    d[D_LATENT + b] = f64_to_bf16(__dadd_rn(__dmul_rn(x, sn), __dmul_rn(y, c)));
}
