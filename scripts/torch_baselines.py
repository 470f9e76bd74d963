#!/usr/bin/env python3
"""PyTorch's figures beside `kvroute bench kernels --backend cuda --batched`, on the same GPU in
the same run: the bf16 matrix-product rate (the compute roofline), a device copy's rate, and
`scaled_dot_product_attention` on every shape of the batched bench's grid (FlashMLA's decode
shapes, `kvroute_kernels::bench::batched_shapes`), on random bf16 inputs of those shapes.

MLA's heads all attend one latent per token, so SDPA gets the heads folded into the query
length (q [b, 1, h_q s_q, 576], k [b, 1, s_k, 576], v [b, 1, s_k, 512]); the sparse rows get
each query token's 2048 selected rows gathered beforehand (the gather is not timed).

    python3 scripts/torch_baselines.py --out torch.json
"""
import argparse
import json

import torch
import torch.nn.functional as F

SCALE = 0.1147


def time_us(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(samples)[1]


def shapes():
    out = []
    for kind in ("dense", "sparse"):
        for b in (64, 128):
            for s_q in (1, 2):
                for h_q in (16, 64, 128):
                    for s_k in (4096, 8192):
                        out.append(dict(b=b, s_q=s_q, h_q=h_q, s_k=s_k,
                                        topk=None if kind == "dense" else 2048, kind=kind))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    matmul_us = time_us(lambda: a @ b, 10)
    matmul_tflops = 2 * n**3 / matmul_us / 1e6
    del a, b
    x = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    copy_us = time_us(lambda: y.copy_(x), 20)
    copy_tbps = 2 * x.numel() * 2 / copy_us / 1e6
    del x, y
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: "
          f"bf16 matmul {matmul_tflops:.0f} TFLOP/s, copy {copy_tbps:.2f} TB/s")
    sdpa = []
    for s in shapes():
        rows = s["h_q"] * s["s_q"]
        if s["kind"] == "dense":
            batch, keys = s["b"], s["s_k"]
        else:
            batch, keys = s["b"] * s["s_q"], s["topk"]
            rows = s["h_q"]
        q = torch.randn(batch, 1, rows, 576, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, 1, keys, 576, device=dev, dtype=torch.bfloat16)
        v = k[..., :512].contiguous()
        fn = lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE)
        first = time_us(fn, 1)
        us = time_us(fn, max(3, min(100, int(20_000 / max(first, 1.0)))))
        sdpa.append(dict(shape=s, us=us))
        print(f"  sdpa {s['kind']:<6} b={s['b']:<3} s_q={s['s_q']} h_q={s['h_q']:<3} "
              f"s_k={s['s_k']}: {us:9.1f} us")
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                       matmul_tflops=matmul_tflops, copy_tbps=copy_tbps, sdpa=sdpa), f)


if __name__ == "__main__":
    main()
