"""A pix2pix-style iteration: the discriminator's step, then the generator's, two Adams; the
generator's output and the losses are kept until the next iteration replaces them."""
import torch
import torch.nn as nn

G = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda()
D = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 1)).cuda()
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
for step in range(5):
    x = torch.randn(512, 512, device="cuda")
    fake = G(x)
    for p in D.parameters():
        p.requires_grad_(True)
    opt_d.zero_grad()
    loss_d = D(fake.detach()).mean() - D(x).mean()
    loss_d.backward()
    opt_d.step()
    for p in D.parameters():
        p.requires_grad_(False)
    opt_g.zero_grad()
    loss_g = -D(fake).mean()
    loss_g.backward()
    opt_g.step()
