"""A CTC loss (speech recognition, OCR): frame log-probabilities of 8 utterances of 200 frames,
targets padded to 40 labels with their lengths on the host (--lists: as Python lists)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

head = nn.Linear(80, 32).cuda()
opt = torch.optim.Adam(head.parameters())
target_lengths = torch.tensor([40, 33, 21, 38, 25, 30, 39, 22])
input_lengths = torch.full((8,), 200, dtype=torch.long)
for step in range(4):
    frames = torch.randn(200, 8, 80, device="cuda")
    targets = torch.randint(1, 32, (8, 40)).cuda()
    log_probs = head(frames).log_softmax(-1)
    if "--lists" in sys.argv:
        loss = F.ctc_loss(log_probs, targets, input_lengths.tolist(), target_lengths.tolist())
    else:
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths)
    opt.zero_grad()
    loss.backward()
    opt.step()
