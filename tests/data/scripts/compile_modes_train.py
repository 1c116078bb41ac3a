"""torch.compile with the modes the tutorial shows: --mode reduce-overhead / max-autotune record
CUDA graphs (inductor's cudagraph trees), as --options-cudagraphs and --config-cudagraphs
(torch._inductor.config.triton.cudagraphs = True) do; default and max-autotune-no-cudagraphs
do not."""
import argparse

import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--mode", default=None)
ap.add_argument("--options-cudagraphs", action="store_true")
ap.add_argument("--config-cudagraphs", action="store_true")
args = ap.parse_args()
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
if args.config_cudagraphs:
    import torch._inductor.config

    torch._inductor.config.triton.cudagraphs = True
options = {"triton.cudagraphs": True} if args.options_cudagraphs else None
compiled = torch.compile(model, mode=args.mode, options=options) if options else torch.compile(model, mode=args.mode)
opt = torch.optim.AdamW(model.parameters())
for step in range(10):
    loss = compiled(torch.randn(64, 256, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
