"""A sample drawn under grad every other step (pytorch/examples' DCGAN draws netG(fixed_noise)
every 100 iterations without no_grad, and saves it), and the loss read for the log after each
backward: the steps run different numbers of forwards, and no value read decides how many."""
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).cuda()
opt = torch.optim.Adam(model.parameters())
fixed = torch.randn(16, 32, device="cuda")
for step in range(6):
    if step % 2 == 0:
        sample = model(fixed)
        sample.detach().cpu().numpy()   # (saved as an image)
    loss = model(torch.randn(16, 32, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
