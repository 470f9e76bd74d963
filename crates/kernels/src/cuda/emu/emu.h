// A CPU emulation of the CUDA the tensor-core decode kernel (decode.cu) uses, so that its
// fragment layouts, pipeline and softmax run, and are checked, on a machine without a GPU.
//
// Each of a block's threads is a fiber (ucontext) on one OS thread, scheduled round robin;
// __syncthreads and the warp-wide instructions are barriers between fibers. The warp-wide
// instructions follow the PTX ISA's definitions:
//   ldmatrix .m8n8 .x4 .b16: lanes 8j..8j+7 give the row addresses of matrix j; lane l
//     receives, in register j, row l/4, columns 2(l%4) and 2(l%4)+1 of matrix j (with .trans,
//     of its transpose: rows 2(l%4) and 2(l%4)+1, column l/4);
//   mma.m16n8k16 .row.col bf16 -> f32 ("Matrix Fragments for mma.m16n8k16 with floating
//     point type"): with g = l/4 and t = l%4, A's registers hold (g, 2t..2t+1),
//     (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); B's (k = 2t..2t+1, n = g), (k = 2t+8.., n = g);
//     C's and D's (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); products exact, sums in f64
//     rounded once to f32 (the hardware's order of summation is not modelled);
//   cp.async: each copy is deferred to the cp.async.wait_group that must complete it, the
//     latest moment the PTX ISA allows, so a read of a stage before its wait sees stale data.
#pragma once
#define KVROUTE_EMU 1

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint4 { unsigned x, y, z, w; };
struct Dim3Grid { unsigned x, y, z; };
struct int4 { int x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
using std::max;
using std::min;

namespace emu {

struct Dim3 { unsigned x = 0, y = 0, z = 0; };

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Copy { unsigned char* dst; const unsigned char* src; int bytes; };

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    Dim3 thread_idx;
    bool done = false;
    std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
    std::vector<Copy> open;                 // copies not yet committed
};

struct State {
    Fiber fibers[kThreads];
    ucontext_t scheduler;
    int current = 0;
    Dim3 block_idx, grid_dim;
    unsigned block_gen = 0, block_count = 0;
    unsigned warp_gen[kWarps] = {}, warp_count[kWarps] = {};
    // Per-warp exchange slots for the warp-wide instructions, double-buffered by barrier
    // parity (a lane can only reach slot p again after every lane has left it).
    struct Slot { const void* addr; unsigned a[4], b[2]; float c[4]; float v; };
    Slot slots[kWarps][2][32];
    unsigned phase[kThreads] = {};
    std::vector<unsigned char> smem;
    void (*body)() = nullptr;
};

inline State& st() {
    static State s;
    return s;
}

inline Fiber& me() { return st().fibers[st().current]; }
inline void yield() { swapcontext(&me().ctx, &st().scheduler); }

inline void block_barrier() {
    State& s = st();
    const unsigned gen = s.block_gen;
    if (++s.block_count == kThreads) {
        s.block_count = 0;
        ++s.block_gen;
        return;
    }
    while (s.block_gen == gen) yield();
}

inline void warp_barrier() {
    State& s = st();
    const int w = s.current / 32;
    const unsigned gen = s.warp_gen[w];
    if (++s.warp_count[w] == 32) {
        s.warp_count[w] = 0;
        ++s.warp_gen[w];
        return;
    }
    while (s.warp_gen[w] == gen) yield();
}

// This lane's exchange slot for the next warp-wide instruction, and the warp's slots.
inline State::Slot& my_slot() {
    State& s = st();
    return s.slots[s.current / 32][s.phase[s.current] & 1][s.current % 32];
}
inline State::Slot* warp_slots() {
    State& s = st();
    return s.slots[s.current / 32][s.phase[s.current] & 1];
}
inline void exchange() {
    warp_barrier();
}
inline void next_phase() { ++st().phase[st().current]; }

inline int lane() { return st().current % 32; }

inline unsigned word_at(const void* row, int byte) {
    unsigned v;
    std::memcpy(&v, static_cast<const unsigned char*>(row) + byte, 4);
    return v;
}
inline unsigned short half_at(const void* row, int byte) {
    unsigned short v;
    std::memcpy(&v, static_cast<const unsigned char*>(row) + byte, 2);
    return v;
}

inline void ldsm(unsigned (&r)[4], const void* p, bool trans) {
    my_slot().addr = p;
    exchange();
    const State::Slot* w = warp_slots();
    const int l = lane();
    for (int j = 0; j < 4; ++j) {
        if (!trans) {
            r[j] = word_at(w[8 * j + l / 4].addr, (l % 4) * 4);
        } else {
            const unsigned lo = half_at(w[8 * j + (l % 4) * 2].addr, (l / 4) * 2);
            const unsigned hi = half_at(w[8 * j + (l % 4) * 2 + 1].addr, (l / 4) * 2);
            r[j] = lo | (hi << 16);
        }
    }
    next_phase();
}

inline float bf(unsigned bits16) { return __uint_as_float((bits16 & 0xffffu) << 16); }

// A[r][c] of the m16n8k16 A fragment spread over the warp's slots.
inline float frag_a(const State::Slot* w, int r, int c) {
    const int l = (r % 8) * 4 + (c % 8) / 2;
    const int reg = (r >= 8 ? 1 : 0) + (c >= 8 ? 2 : 0);
    const unsigned v = w[l].a[reg];
    return bf(c % 2 ? v >> 16 : v);
}
inline float frag_b(const State::Slot* w, int k, int n) {
    const int l = n * 4 + (k % 8) / 2;
    const unsigned v = w[l].b[k >= 8 ? 1 : 0];
    return bf(k % 2 ? v >> 16 : v);
}

inline void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    State::Slot& s = my_slot();
    std::memcpy(s.a, a, sizeof s.a);
    s.b[0] = b0;
    s.b[1] = b1;
    std::memcpy(s.c, d, sizeof s.c);
    exchange();
    const State::Slot* w = warp_slots();
    const int l = lane(), g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i % 2);
        double sum = w[l].c[i];
        for (int k = 0; k < 16; ++k) sum += (double)frag_a(w, r, k) * (double)frag_b(w, k, n);
        d[i] = (float)sum;
    }
    next_phase();
}

inline float shfl_xor(float v, int off) {
    my_slot().v = v;
    exchange();
    const float out = warp_slots()[lane() ^ off].v;
    next_phase();
    return out;
}

inline void run_copies(std::vector<Copy>& copies) {
    for (const Copy& c : copies) {
        if (c.bytes == 16) std::memcpy(c.dst, c.src, 16);
        else std::memset(c.dst, 0, 16);
    }
    copies.clear();
}

inline void fiber_main() {
    State& s = st();
    s.body();
    Fiber& f = me();
    // A block may not leave copies in flight; the kernel waits for all of them.
    if (!f.open.empty() || !f.groups.empty()) {
        std::fprintf(stderr, "emu: thread %u left cp.async copies in flight\n", f.thread_idx.x);
        std::abort();
    }
    f.done = true;
    swapcontext(&f.ctx, &s.scheduler);
}

// Runs `body` as every thread of every block of `grid` (x fastest), blocks one after another,
// with `smem_bytes` of dynamic shared memory (filled with a poison pattern for each block).
inline void launch(Dim3 grid, size_t smem_bytes, void (*body)()) {
    State& s = st();
    s.body = body;
    s.smem.assign(smem_bytes, 0);
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            s.block_idx = {bx, by, 0};
            s.grid_dim = {grid.x, grid.y, grid.z};
            std::fill(s.smem.begin(), s.smem.end(), (unsigned char)0xa5);
            s.block_gen = s.block_count = 0;
            for (int w = 0; w < kWarps; ++w) s.warp_gen[w] = s.warp_count[w] = 0;
            for (int t = 0; t < kThreads; ++t) {
                Fiber& f = s.fibers[t];
                f.stack.resize(256 * 1024);
                f.thread_idx = {(unsigned)t, 0, 0};
                f.done = false;
                f.groups.clear();
                f.open.clear();
                s.phase[t] = 0;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = f.stack.data();
                f.ctx.uc_stack.ss_size = f.stack.size();
                f.ctx.uc_link = nullptr;
                makecontext(&f.ctx, fiber_main, 0);
            }
            for (int alive = kThreads; alive > 0;) {
                alive = 0;
                for (int t = 0; t < kThreads; ++t) {
                    if (s.fibers[t].done) continue;
                    s.current = t;
                    swapcontext(&s.scheduler, &s.fibers[t].ctx);
                    alive += !s.fibers[t].done;
                }
            }
        }
    }
}

}  // namespace emu

#define threadIdx (emu::me().thread_idx)
#define blockIdx (emu::st().block_idx)
#define gridDim (emu::st().grid_dim)
#define __syncthreads() emu::block_barrier()
#define DEC_DYNAMIC_SMEM(name) unsigned char* name = emu::st().smem.data()

inline float __shfl_xor_sync(unsigned, float v, int off) { return emu::shfl_xor(v, off); }
// Blocks run one after another, so a fence has nothing to order and an atomic nothing to race.
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
using std::isfinite;
using std::isnan;

// e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; S.1111.111 NaN) as f32, exactly
// (the PTX conversion to f16x2 is exact, and so is f16 to f32).
inline float emu_e4m3(unsigned v) {
    const unsigned sign = (v & 0x80u) << 24, e = (v >> 3) & 0xfu, m = v & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
    const float mag = e == 0u ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return __uint_as_float(__float_as_uint(mag) | sign);
}
inline float2 e4m3x2_to_f32x2(unsigned short v) { return {emu_e4m3(v & 0xffu), emu_e4m3(v >> 8)}; }
inline void ldsm_x4(unsigned (&r)[4], const void* p) { emu::ldsm(r, p, false); }
inline void ldsm_x4_trans(unsigned (&r)[4], const void* p) { emu::ldsm(r, p, true); }
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { emu::mma(d, a, b0, b1); }
inline void cp_async_16(void* dst, const void* src, int src_bytes) {
    emu::me().open.push_back({static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), src_bytes});
}
inline void cp_async_commit() {
    emu::Fiber& f = emu::me();
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}
template <int N>
inline void cp_async_wait() {
    emu::Fiber& f = emu::me();
    while ((int)f.groups.size() > N) {
        emu::run_copies(f.groups.front());
        f.groups.erase(f.groups.begin());
    }
}
