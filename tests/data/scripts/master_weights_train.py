"""Mixed precision with fp32 master weights kept by hand (Megatron's Float16OptimizerWithFloat16Params,
apex O2, fairseq's FP16Optimizer): the optimizer holds detached fp32 copies (requires_grad=False)
whose .grad the script fills from the bf16 model's gradients each step, then copies back."""
import torch
from torch import nn

model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda().bfloat16()
master = [p.detach().clone().float() for p in model.parameters()]
opt = torch.optim.AdamW(master, lr=1e-4)
for step in range(10):
    model(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
        p.grad = None
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for m, p in zip(master, model.parameters()):
            p.copy_(m)
