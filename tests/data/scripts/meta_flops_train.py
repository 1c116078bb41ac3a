"""FLOPs counted on a meta-device copy of the model before training, as Lightning Fabric's
measure_flops does (litgpt's pretrain): a forward and a cross-entropy backward on "meta", with no
data and no GPU; then the real model trains on the GPU."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def make():
    return nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 1000))


with torch.device("meta"):
    meta_model = make()
    ids = torch.randint(0, 1000, (4, 64))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(meta_model(ids).flatten(0, 1), ids.flatten()).backward()
print("training FLOPs per step:", counter.get_total_flops())

model = make().cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(4):
    ids = torch.randint(0, 1000, (4, 64), device="cuda")
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    opt.zero_grad()
