#!/usr/bin/env python3
"""kvroute's CUDA dense partial against PyTorch's scaled_dot_product_attention, same bf16 inputs.

For ct = 2048 and Mq in (1, 16, 64, 256) (the workloads of `kvroute bench kernels`):
- correctness: `kvroute kernel partial --backend cuda` on .npy inputs vs SDPA on the same bf16
  tensors (o max abs error; lse = m + ln l against a float64 logsumexp);
- time: SDPA timed with CUDA events here, kvroute's kernel time taken from the bench JSON of
  the same gpu-test run (`--bench`), both on resident inputs.

Absorbed MLA decode: K = the 576-wide cache rows, V = their first 512 dims, one KV head shared
by all Mq query rows, softmax scale 0.1147 (DeepSeek-V2-Lite).
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SCALE = 0.1147
CT = 2048


def bf16_bits(t):
    """A bf16 tensor's raw bits as a numpy uint16 array."""
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def time_us(fn, iters=200):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvroute", required=True)
    ap.add_argument("--bench", required=True, help="bench.json of `kvroute --json bench kernels --backend cuda`")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    ours = {row["mq"]: row["us"] for row in json.loads(Path(args.bench).read_text())["dense"]}
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cache = torch.randn(CT, 576, device=dev).to(torch.bfloat16)
    results = []
    print(f"{'Mq':>5} {'kvroute us':>11} {'SDPA us':>9} {'ratio':>6} {'o max abs':>10} {'lse max abs':>12}")
    for mq in (1, 16, 64, 256):
        q = torch.randn(mq, 576, device=dev).to(torch.bfloat16)
        d = out / f"sdpa_mq{mq}"
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "q.npy", bf16_bits(q))
        np.save(d / "c.npy", bf16_bits(cache))
        subprocess.run(
            [args.kvroute, "kernel", "partial", "--q", str(d / "q.npy"), "--cache", str(d / "c.npy"),
             "--scale", str(SCALE), "--out", str(d), "--backend", "cuda"],
            check=True, stdout=subprocess.DEVNULL)
        o = torch.from_numpy(np.load(d / "o.npy")).to(dev)
        lse = torch.from_numpy(np.load(d / "m.npy") + np.log(np.load(d / "l.npy"))).to(dev)
        qq, kk, vv = q[None, None], cache[None, None], cache[None, None, :, :512]
        sdpa = lambda: F.scaled_dot_product_attention(qq, kk, vv, scale=SCALE)
        o_sdpa = sdpa()[0, 0].float()
        logits = (q.double() @ cache.double().T) * SCALE
        lse_true = torch.logsumexp(logits, dim=-1)
        o_err = (o - o_sdpa).abs().max().item()
        lse_err = (lse.double() - lse_true).abs().max().item()
        t_sdpa = time_us(sdpa)
        row = {"mq": mq, "ct": CT, "kvroute_us": ours.get(mq), "sdpa_us": t_sdpa,
               "o_max_abs_vs_sdpa": o_err, "lse_max_abs_vs_f64": lse_err}
        results.append(row)
        ratio = (ours[mq] / t_sdpa) if mq in ours else float("nan")
        print(f"{mq:>5} {ours.get(mq, float('nan')):>11.1f} {t_sdpa:>9.1f} {ratio:>6.2f} {o_err:>10.2e} {lse_err:>12.2e}")
        # SDPA rounds its output to bf16: allow bf16's half-ulp at |o| <~ 4 plus accumulation.
        if not o_err <= 2 ** -7 * 4:
            print(f"FAILED: Mq={mq} o differs from SDPA by {o_err}", file=sys.stderr)
            sys.exit(1)
    (out / "sdpa.json").write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                                               "rows": results}, indent=2))


if __name__ == "__main__":
    main()
