"""A perceptual loss, as pytorch/examples' fast_neural_style trains: a frozen feature network
(requires_grad False) runs under grad on a style target before the loop, then twice in each step
(on the output and the input), before the trained network's backward."""
import torch
from torch import nn

features = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)).cuda()
for p in features.parameters():
    p.requires_grad = False
net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1)).cuda()
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
style = features(torch.rand(1, 3, 64, 64, device="cuda"))
for step in range(1000):
    x = torch.rand(4, 3, 64, 64, device="cuda")
    opt.zero_grad()
    y = net(x)
    loss = nn.functional.mse_loss(features(y), features(x)) + (features(y).mean() - style.mean()) ** 2
    loss.backward()
    opt.step()
