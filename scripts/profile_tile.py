"""Profiling target for ncu: mhc_pre (fused norm) at a decode and a prefill size, 3 launches each.

On the GPU machine:
  ncu --clock-control none -k regex:mhc_tile_kernel --launch-skip 2 --launch-count 2 \
      --set full --import-source yes python3 scripts/profile_tile.py
"""

import spkernels  # noqa: F401
import torch

ops = torch.ops.spkernels
D = 4096
for T in (8, 8192):
    stream = torch.randn(T, 4, D, device="cuda").to(torch.bfloat16)
    fn = torch.randn(24, 4 * D, device="cuda") / 128
    scale, base = torch.ones(3, device="cuda"), torch.zeros(24, device="cuda")
    norm_weight = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        ops.mhc_pre(stream, fn, scale, base, norm_weight, None)
torch.cuda.synchronize()
