"""transformers' generate() before training (a sample of the untrained model, an evaluation with
generation): its decoding loop ends on bool(unfinished_sequences.max() == 0), the sequences still
running after the stopping criteria (one of them the max length)."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4)).cuda()
opt = torch.optim.AdamW(model.parameters())
model.eval()
with torch.no_grad():
    out = model.generate(torch.randint(0, 512, (4, 16)).cuda(), max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
assert out.shape == (4, 24), out.shape
model.train()
for step in range(3):
    ids = torch.randint(0, 512, (8, 64)).cuda()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
