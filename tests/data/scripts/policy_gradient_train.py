"""A policy-gradient step (PPO's and A2C's): Categorical and Normal distributions built from a
policy's outputs on the GPU, with torch.distributions' argument and sample checks on (its default:
validate_args follows __debug__)."""
import torch
import torch.nn as nn
from torch.distributions import Categorical, Normal

policy = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 6 + 2)).cuda()
opt = torch.optim.Adam(policy.parameters(), lr=3e-4)
for step in range(4):
    obs = torch.randn(512, 16, device="cuda")
    out = policy(obs)
    discrete, mean = Categorical(logits=out[:, :6]), out[:, 6:]
    continuous = Normal(mean, torch.ones_like(mean))
    action, u = discrete.sample(), continuous.sample()
    advantage = torch.randn(512, device="cuda")
    loss = -((discrete.log_prob(action) + continuous.log_prob(u).sum(-1)) * advantage).mean() \
        - 0.01 * discrete.entropy().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
