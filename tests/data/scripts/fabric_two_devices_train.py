"""Multi-GPU started by the script itself: Lightning Fabric with devices=2 and DDP, run as
``python fabric_two_devices_train.py``; Fabric.launch() runs the script again for rank 1 (its
subprocess launcher), rank 0 here."""
import torch
from lightning_fabric import Fabric

fabric = Fabric(accelerator="cuda", devices=2, strategy="ddp", precision="bf16-mixed")
fabric.launch()
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = fabric.setup(model, opt)
for step in range(4):
    x = torch.randn(64, 1024, device=fabric.device)
    loss = model(x).float().pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
fabric.print("done")
