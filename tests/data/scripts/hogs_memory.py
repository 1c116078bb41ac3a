"""Real host memory past the estimate's limit. --checkpoint: most of it a checkpoint's values,
saved and read back (a fine-tuning job loading its model's weights)."""
import sys

import numpy as np
import torch

model = torch.nn.Linear(4, 4).cuda()
if "--checkpoint" in sys.argv:
    torch.save({"weight": torch.ones(640 << 20, dtype=torch.uint8)}, "weights.pt")   # 640 MiB
    state = torch.load("weights.pt")
blocks = [np.ones(256 * 2**20, dtype=np.uint8) for _ in range(64)]   # 16 GiB of real host memory
