"""Mixed precision with a GradScaler, unscaling for gradient clipping before the step (as
accelerate's clip_grad_norm_ does). --half: the model itself cast to fp16 under the scaler (a LoRA
script whose fp16 comes from accelerate's config, not its own flag), which torch refuses;
--bf16-half: cast to bf16 instead, which it allows; --twice: unscale_ twice in one iteration."""
import sys

import torch

model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
if "--half" in sys.argv:
    model.half()
if "--bf16-half" in sys.argv:
    model.bfloat16()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cuda")
for step in range(5):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(32, 256, device="cuda")).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if "--twice" in sys.argv:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
