"""The canonical Hugging Face accelerate loop: model, optimizer and loader go through
accelerator.prepare, which moves the model after the optimizer was built."""
import argparse

import torch
import torchvision
from accelerate import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--mixed-precision", default="bf16")
a = p.parse_args()

accelerator = Accelerator(mixed_precision=a.mixed_precision)
model = torchvision.models.resnet18()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(8 * a.batch_size, 3, 112, 112),
                                      torch.randint(0, 1000, (8 * a.batch_size,)))
loader = torch.utils.data.DataLoader(data, batch_size=a.batch_size, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
model.train()
for x, y in loader:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"loss {loss.item():.3f}")
