"""A tokenizer saved (Hugging Face's tokenizers: Rust writes the file itself) into a folder the
script makes at its epoch's end, read back, then an evaluation on a large batch."""
import os

import torch
import torch.nn as nn
from tokenizers import Tokenizer, models

tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
net = nn.Linear(1024, 1024).cuda()
opt = torch.optim.AdamW(net.parameters())
loader = torch.utils.data.DataLoader(torch.randn(64, 1024), batch_size=16)
for epoch in range(2):
    for x in loader:
        loss = net(x.cuda()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    os.makedirs("tok_out", exist_ok=True)
    tokenizer.save("tok_out/tokenizer.json")
    assert Tokenizer.from_file("tok_out/tokenizer.json").get_vocab_size() == 2
    with torch.no_grad():
        print(net(torch.randn(16384, 1024, device="cuda")).sum().item())
