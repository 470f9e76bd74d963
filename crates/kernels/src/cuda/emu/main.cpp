// Runs one launch of decode.cu's kernel under the CPU emulation (emu.h).
//   emu IN OUT   reads a launch written by cuda/decode.rs's tests, writes its outputs;
//   emu --layout prints each variant's (MT, FP8, stages, shared-memory bytes).
// IN: ten i32 (MT, FP8, block tokens, total rows, mode, work items, splits, scale's f32 bits,
// 0, 0), then six blobs, each a u64 byte count and the bytes: q, kv, tables, reqs, work, sel.
// OUT: five blobs: o, m, l (mode 1), wire (mode 2), and the work items' counters after the
// launch (every output poisoned with NaN / 0xff before the launch; the split states too).
#include "emu.h"
#include "../common.cu"
// cvt.rn.bf16x2.f32: round to nearest even, as f32_to_bf16 (NaN payloads aside).
inline unsigned pack_bf16x2_rn(float lo, float hi) {
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
}
#include "../decode.cu"

#include <fstream>
#include <iterator>
#include <string>

struct Args {
    const bf16_t* q;
    const unsigned char* kv;
    int block_tokens;
    const unsigned* tables;
    const int4* reqs;
    const int4* work;
    const int* sel;
    int total_rows;
    float scale;
    int mode;
    float *ws_o, *ws_m, *ws_l;
    int* counters;
    float *o, *m, *l;
    unsigned char* wire;
};
static Args A;

template <int MT, bool FP8>
void body() {
    decode_body<MT, FP8>(A.q, A.kv, A.block_tokens, A.tables, A.reqs, A.work, A.sel, A.total_rows,
                         A.scale, A.mode, A.ws_o, A.ws_m, A.ws_l, A.counters, A.o, A.m, A.l, A.wire);
}

template <int MT, bool FP8>
void layout() {
    typedef DecCfg<MT, FP8> C;
    std::printf("%d %d %d %d\n", MT, FP8 ? 1 : 0, C::STAGES, C::BYTES);
}

static std::vector<unsigned char> blob(const std::vector<unsigned char>& in, size_t& at) {
    uint64_t n;
    if (at + 8 > in.size()) { std::fprintf(stderr, "emu: truncated input\n"); std::exit(2); }
    std::memcpy(&n, in.data() + at, 8);
    at += 8;
    if (at + n > in.size()) { std::fprintf(stderr, "emu: truncated blob\n"); std::exit(2); }
    std::vector<unsigned char> out(in.begin() + at, in.begin() + at + n);
    at += n;
    // Never empty: the kernel may form (and not read) a pointer into any input.
    if (out.empty()) out.resize(16);
    return out;
}

static void put(std::ofstream& f, const void* p, size_t bytes) {
    const uint64_t n = bytes;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(static_cast<const char*>(p), bytes);
}

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "--layout") {
        layout<1, false>(); layout<2, false>(); layout<4, false>();
        layout<1, true>(); layout<2, true>(); layout<4, true>();
        return 0;
    }
    if (argc != 3) { std::fprintf(stderr, "usage: emu IN OUT | emu --layout\n"); return 2; }
    std::ifstream f(argv[1], std::ios::binary);
    std::vector<unsigned char> in((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (in.size() < 40) { std::fprintf(stderr, "emu: short input\n"); return 2; }
    int h[10];
    std::memcpy(h, in.data(), 40);
    size_t at = 40;
    const int mt = h[0], fp8 = h[1], rows = h[3], mode = h[4], works = h[5], splits = h[6];
    float scale;
    std::memcpy(&scale, &h[7], 4);
    auto q = blob(in, at), kv = blob(in, at), tables = blob(in, at), reqs = blob(in, at),
         work = blob(in, at), sel = blob(in, at);
    const size_t states = (size_t)splits * rows;
    std::vector<float> ws_o(states * D_LATENT + 1, NAN), ws_m(states + 1, NAN), ws_l(states + 1, NAN);
    std::vector<int> counters(works + 1, 0);
    std::vector<float> o((size_t)rows * D_LATENT + 1, NAN), m(rows + 1, NAN), l(rows + 1, NAN);
    std::vector<unsigned char> wire((size_t)rows * WIRE_ROW_BYTES + 1, 0xff);
    A = {reinterpret_cast<const bf16_t*>(q.data()), kv.data(), h[2],
         reinterpret_cast<const unsigned*>(tables.data()), reinterpret_cast<const int4*>(reqs.data()),
         reinterpret_cast<const int4*>(work.data()), reinterpret_cast<const int*>(sel.data()), rows,
         scale, mode, ws_o.data(), ws_m.data(), ws_l.data(), counters.data(), o.data(), m.data(),
         l.data(), wire.data()};
    void (*b)() = nullptr;
    size_t bytes = 0;
#define PICK(M, F) if (mt == M && fp8 == F) { b = body<M, F>; bytes = DecCfg<M, F>::BYTES; }
    PICK(1, 0) PICK(2, 0) PICK(4, 0) PICK(1, 1) PICK(2, 1) PICK(4, 1)
#undef PICK
    if (!b) { std::fprintf(stderr, "emu: no variant MT=%d FP8=%d\n", mt, fp8); return 2; }
    emu::launch({(unsigned)works, (unsigned)splits, 1}, bytes, b);
    std::ofstream out(argv[2], std::ios::binary);
    put(out, o.data(), (size_t)rows * D_LATENT * 4);
    put(out, m.data(), (size_t)rows * 4);
    put(out, l.data(), (size_t)rows * 4);
    put(out, wire.data(), (size_t)rows * WIRE_ROW_BYTES);
    put(out, counters.data(), (size_t)works * 4);
    return out.good() ? 0 : 1;
}
