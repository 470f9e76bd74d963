// kvroute's CUDA-core kernels: the combine that finishes split partials and merges peers'
// partials, and the splice; compiled at run time by NVRTC (see cuda/nvrtc.rs) after common.cu.
//
// Compiled with --fmad=false so that nothing is contracted behind our back: the FMAs below are
// the explicit fmaf() calls, and the splice's double arithmetic rounds exactly as the CPU's.

// The combine: threads per block, dims per block, and so groups of parts summed side by side.
#define COMBINE_THREADS 512
#define COMBINE_DIMS 128
#define COMBINE_GROUPS (COMBINE_THREADS / COMBINE_DIMS)

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
