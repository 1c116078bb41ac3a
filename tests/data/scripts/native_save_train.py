"""A checkpoint that saves a fast tokenizer (transformers' Trainer: tokenizer.save_pretrained ->
tokenizers' Rust Tokenizer.save) into a folder the script made, at every step."""
import os

import torch
from tokenizers import Tokenizer, models
from torch import nn

tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
model = nn.Linear(64, 64).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(1, 4):
    model(torch.randn(8, 64).cuda()).sum().backward()
    opt.step()
    opt.zero_grad()
    folder = os.path.join("out_native", f"checkpoint-{step}")
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
