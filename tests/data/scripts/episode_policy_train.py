"""REINFORCE over episodes (pytorch/examples' reinforce.py on the GPU): one forward per environment
step kept in the graph until the episode ends, and the sampled actions decide when it ends. An
environment of its own (no gym): the pole falls after enough pushes the same way."""
import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

p = argparse.ArgumentParser()
p.add_argument("--fixed", type=int, default=0, help="episodes of this many steps, whatever the actions")
args = p.parse_args()

random.seed(0)
policy = nn.Sequential(nn.Linear(4, 256), nn.ReLU(), nn.Linear(256, 2)).cuda()
opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
for episode in range(6):
    state, logps, lean = [0.0] * 4, [], 0
    for t in range(500):
        probs = F.softmax(policy(torch.tensor(state, device="cuda").unsqueeze(0)), dim=1)
        m = Categorical(probs)
        a = m.sample()
        logps.append(m.log_prob(a))
        lean += 1 if a.item() == 1 else -1
        state = [lean / 10, random.random(), random.random(), random.random()]
        if (args.fixed and t + 1 == args.fixed) or (not args.fixed and abs(lean) > 4 + episode):
            break
    loss = -torch.cat(logps).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
