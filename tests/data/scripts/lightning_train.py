"""A PyTorch Lightning Trainer loop (bf16-mixed), logging its loss (torchmetrics deep-copies a default state)."""
import argparse
import torch
import torchvision
import pytorch_lightning as pl

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = torchvision.models.resnet18()
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
a = p.parse_args()
data = torch.utils.data.TensorDataset(torch.randn(8 * a.batch_size, 3, 112, 112), torch.randint(0, 1000, (8 * a.batch_size,)))
loader = torch.utils.data.DataLoader(data, batch_size=a.batch_size, num_workers=2)
trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False, enable_checkpointing=False)
trainer.fit(Net(), loader)
