"""The optimizer step fused into backward: an optimizer per parameter, stepped from its
post-accumulate-grad hook as soon as its gradient is ready, so no whole set of gradients lives."""
import torch

model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).cuda()
optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}


def step_now(p):
    optimizers[p].step()
    optimizers[p].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(step_now)
for _ in range(3):
    model(torch.randn(32, 256, device="cuda")).square().mean().backward()
