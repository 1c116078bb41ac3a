"""Lightning Fabric as `fabric run --devices N --precision P fabric_train.py` launches it: Fabric()
with no arguments takes the launcher's settings (its LT_* variables), sets up DDP over the devices
and runs the loop with fabric.backward."""
import lightning as L
import torch
from torch import nn

fabric = L.Fabric()   # (no fabric.launch(): the launcher has started the processes)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = fabric.setup(model, opt)
data = torch.utils.data.TensorDataset(torch.randn(512, 128), torch.randint(0, 10, (512,)))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=32))
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    fabric.backward(loss)
    opt.step()
    fabric.print(f"loss {loss:.4f}")
