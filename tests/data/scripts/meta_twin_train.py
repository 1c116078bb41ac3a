"""Meta twins of the model's GPU parameters (shapes, no memory), as DeepSpeed ZeRO-1/2's optimizer
makes them (torch.zeros_like(param.data, device="meta")), then training."""
import torch

model = torch.nn.Linear(512, 512).cuda()
twins = [torch.zeros_like(p.data, device="meta") for p in model.parameters()]
assert all(t.device.type == "meta" and t.shape == p.shape for t, p in zip(twins, model.parameters()))
opt = torch.optim.AdamW(model.parameters())
for step in range(5):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
