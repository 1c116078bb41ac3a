import torch

model = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.no_grad():
    x = model(torch.ones(1 << 17, 8, device="cuda"))   # no values here, too many rows to bound
keep = x[x.sum(dim=1) > 0]          # how many rows survive depends on the values
loss = model(keep).sum()
loss.backward()
opt.step()
