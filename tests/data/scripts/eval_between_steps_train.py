"""A detector-style loop whose epoch is one optimizer step long (YOLOv8 accumulates 64 images a
step, so a small data set's epoch is one step), validated at each epoch's end: the validation
keeps the candidates over a threshold (a shape the data decides, too many for vest's bound)."""
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 5)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for micro in range(4):
        model(torch.randn(32, 16, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        pred = model(torch.randn(1 << 17, 16, device="cuda"))
        kept = pred[pred[:, 4].sigmoid() > 0.25]
    model.train()
