"""A DQN's loop: actions chosen by the Q-network under grad (no torch.no_grad) while the replay
buffer fills, the Adam over it made before; training from step 40 on (CleanRL's learning_starts)."""
import torch
import torch.nn as nn

net = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4)).cuda()
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
replay = []
for step in range(60):
    obs = torch.randn(1, 128)
    action = net(obs.cuda()).argmax(dim=1)
    replay.append(obs)
    if step >= 40:
        batch = torch.cat(replay[-32:]).cuda()
        loss = net(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
