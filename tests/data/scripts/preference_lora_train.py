"""A preference-tuning step as TRL's DPO trainer runs it with peft: sequences of many lengths drawn by
a sampler whose generator the loop seeds itself (accelerate's SeedableRandomSampler), each batch
padded to its longest, the policy called with keywords, its blocks checkpointed (non-reentrant, so
each recomputation in backward stops early), and a reference pass under no_grad with the adapters
switched off by requires_grad_ (peft's disable_adapter); two micro-batches per AdamW step."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LENGTHS = [16 + 7 * i for i in range(32)]   # the dataset: one sequence length per row


def batches(seed=42, batch=4):
    g = torch.Generator()
    g.manual_seed(seed)
    order = torch.randperm(len(LENGTHS), generator=g).tolist()
    for i in range(0, len(order), batch):
        longest = max(LENGTHS[j] for j in order[i:i + batch])
        yield torch.randint(0, 500, (batch, longest))


class LoraLinear(nn.Module):
    """A frozen linear layer with a low-rank adapter beside it (peft's LoRA)."""

    def __init__(self, dim_in, dim_out, rank=8):
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.lora_a = nn.Linear(dim_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim_out, bias=False)
        self.adapter_on = True

    def forward(self, x):
        y = self.base(x)
        return y + self.lora_b(self.lora_a(x)) if self.adapter_on else y


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(LoraLinear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class PolicyLM(nn.Module):
    def __init__(self, vocab=500, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.training and torch.is_grad_enabled() else b(x)
        return self.head(x).log_softmax(-1).gather(-1, input_ids.unsqueeze(-1)).sum()


def set_adapter(model, on):
    for m in model.modules():
        if isinstance(m, LoraLinear):
            m.adapter_on = on
            for p in (*m.lora_a.parameters(), *m.lora_b.parameters()):
                p.requires_grad_(on)


model = PolicyLM().cuda()
for name, p in model.named_parameters():
    p.requires_grad_(".lora_" in name)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
for i, ids in enumerate(batches()):
    ids = ids.cuda()
    policy = model(input_ids=ids)
    with torch.no_grad():
        set_adapter(model, False)
        reference = model(input_ids=ids)
        set_adapter(model, True)
    loss = -F.logsigmoid(policy - reference) / 2
    loss.backward()
    if i % 2 == 1:
        opt.step()
        opt.zero_grad()
