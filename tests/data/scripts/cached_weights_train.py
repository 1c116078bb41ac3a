"""Pretrained weights the user already has in torch.hub's cache (TORCH_HOME): the job loads them
offline; the URL is never fetched when the file is cached (torch.hub.load_state_dict_from_url)."""
import torch

model = torch.nn.Linear(32, 8)
state = torch.hub.load_state_dict_from_url("https://example.invalid/weights/linear-32-8.pth", map_location="cpu")
model.load_state_dict(state)
model = model.cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(10):
    model(torch.randn(16, 32, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
