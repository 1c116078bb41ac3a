"""QLoRA's layers moved to the GPU twice: .cuda() quantizes the bitsandbytes 4-bit weights, then a
trainer's set-up moves the model again (accelerate's prepare, Lightning Fabric's setup_module:
``model.to(device)``), where Params4bit.to() makes a new Params4bit around the packed weight.
The optimizer is built between the moves, as ``prepare(model, optimizer)`` sees it."""
import bitsandbytes as bnb
import torch
import torch.nn as nn


class QLoraLinear(nn.Module):
    def __init__(self, d_in, d_out, rank=16):
        super().__init__()
        self.base = bnb.nn.Linear4bit(d_in, d_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


model = nn.Sequential(QLoraLinear(1024, 4096), nn.GELU(), QLoraLinear(4096, 1024)).cuda()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
model = model.to("cuda")
for step in range(4):
    x = torch.randn(64, 1024, device="cuda")
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
