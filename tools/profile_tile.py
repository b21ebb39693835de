"""Profiling target for ncu: the local pre-family ops (fused norm) at chosen sizes, 3 calls each.

On the GPU machine (--clock-control none: never lock the GPU's clocks):
  ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      python3 tools/profile_tile.py --T 8,64 --ops pre,post_pre,head
"""

import argparse

import spkernels  # noqa: F401
import torch

p = argparse.ArgumentParser()
p.add_argument("--T", default="8,8192")
p.add_argument("--D", type=int, default=4096)
p.add_argument("--device", default="cuda")
p.add_argument("--ops", default="pre", help="comma list of pre, post_pre, head")
args = p.parse_args()

ops = torch.ops.spkernels
D = args.D
for T in (int(t) for t in args.T.split(",")):
    stream = torch.randn(T, 4, D, device=args.device).to(torch.bfloat16)
    y = torch.randn(T, D, device=args.device).to(torch.bfloat16)
    post, res = torch.rand(T, 4, device=args.device), torch.rand(T, 4, 4, device=args.device)
    fn = torch.randn(24, 4 * D, device=args.device) / 128
    scale, base = torch.ones(3, device=args.device), torch.zeros(24, device=args.device)
    norm_weight = torch.ones(D, device=args.device, dtype=torch.bfloat16)
    for op in args.ops.split(","):
        for _ in range(3):
            if op == "pre":
                ops.mhc_pre(stream, fn, scale, base, norm_weight, None)
            elif op == "post_pre":
                ops.mhc_post_pre(y, stream, post, res, fn, scale, base, norm_weight, None)
            elif op == "head":
                ops.mhc_head(stream, fn[:4].contiguous(), scale[:1].contiguous(), base[:4].contiguous())
            else:
                raise SystemExit(f"--ops: unknown op {op!r}")
if args.device == "cuda":
    torch.cuda.synchronize()
print("profile_tile done")
