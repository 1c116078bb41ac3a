"""Preprocessing in the style of transformers' examples: a datasets.Dataset tokenized and
grouped with map(num_proc=2) and filtered with filter(num_proc=2) (--preprocessing_num_workers),
then a small LM trained on the result; the script checks the preprocessed values."""
import torch
from datasets import Dataset, DatasetDict

text = Dataset.from_dict({"text": [" ".join(str(i + j) for j in range(20)) for i in range(64)]})
raw = DatasetDict({"train": text, "validation": text.select(range(8))})


def tokenize(batch):
    return {"input_ids": [[int(w) % 100 for w in t.split()] for t in batch["text"]]}


tokenized = raw.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
train = tokenized["train"].filter(lambda ex: len(ex["input_ids"]) == 20, num_proc=2)
assert len(train) == 64 and train[3]["input_ids"][:3] == [3, 4, 5]
train.set_format("torch")
model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100)).cuda()
opt = torch.optim.AdamW(model.parameters())
loader = torch.utils.data.DataLoader(train, batch_size=8, num_workers=2)
for step, batch in zip(range(3), loader):
    ids = batch["input_ids"].cuda()
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 100), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
