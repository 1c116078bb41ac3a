"""Files an earlier job saved with torch.save, read back as training scripts do: a preprocessed data
set kept whole on the GPU (``map_location="cuda"``, then normalised and sliced there), a metadata
file read on the host, and pretrained weights loaded onto the device, two of them views of one
storage (tied). The script checks the values it reads (the labels' real range, the host file's
numbers) as a real run would; the test checks what the GPU held."""
import torch
import torchvision.transforms as T
from torch import nn

meta = torch.load("meta.pt")                                   # host: real values
assert meta["classes"] == 7 and meta["mean"].tolist() == [0.25, 0.5, 0.75]
data = torch.load("data.pt", map_location=torch.device("cuda"))
images, labels = data["images"], data["labels"]
assert images.is_cuda and images.dtype == torch.uint8 and images.shape == (500, 16, 16, 3)
assert int(labels.max()) + 1 == meta["classes"]                # copied from the file: the real labels
images = (images.half() / 255).permute(0, 3, 1, 2).to(memory_format=torch.channels_last)
images = T.Normalize(meta["mean"].tolist(), (0.2, 0.2, 0.2))(images)   # (std == 0).any(): a known value

model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 256), nn.ReLU(), nn.Linear(256, meta["classes"])).cuda()
weights = torch.load("pretrained.pt", map_location=lambda storage, loc: storage.cuda())
assert weights["embed"].is_cuda and weights["head"].data_ptr() == weights["embed"].data_ptr()
model[1].weight.data.copy_(weights["embed"].t())
del weights
model = model.half()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(6):
    i = step * 50
    loss = nn.functional.cross_entropy(model(images[i:i + 50]), labels[i:i + 50])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
