"""The GPT-2 of ColossalAI-Pytorch-lightning's benchmark, for the published ZeRO-3 and DDP rows of
scripts/bench_sharding.py.

hpcaitech/ColossalAI-Pytorch-lightning, benchmark/gpt at commit 6a82b80 (2022-08-18; its README
gives `torch.cuda.max_memory_allocated()` of rank 0 at the end of fit, in MiB): the model is
transformers' GPT2LMHeadModel built from a GPT2Config (random weights, vocab 50257, 1024
positions), with its gradient checkpointing on; its forward takes the token ids and an attention
mask of ones (the benchmark's random data loader makes both on the GPU) and returns the logits;
the LightningModule's loss shifts them by one token, copies them contiguous and applies
nn.CrossEntropyLoss, and returns only the loss (the logits are not kept through backward).

This factory builds that model and computes that loss in its forward, so that `--loss model` traces
the same step. GPT-2's attention in transformers of that time had only its eager implementation
(matmul, scale, causal mask, softmax, dropout, matmul), so it is asked for here.

    vest estimate --model benchmarks/models/colossalai_gpt.py:gpt2_xl --loss model --input seq1024 ...
"""

from types import SimpleNamespace

import torch
from torch import nn

# The benchmark's model sizes (model.py's gpt2_* functions): hidden size, layers, heads.
SIZES = {"gpt2_xl": (1600, 48, 25), "gpt2_12B": (4096, 60, 16), "gpt2_18B": (4096, 90, 16)}


class GPTLM(nn.Module):
    """GPT2LMHeadModel and the benchmark's next-token loss; forward returns an object with ``loss``."""

    _no_split_modules = ["GPT2Block"]   # the wrapping unit of a sharded estimate

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config   # the block count that the scaled trace cuts
        self.criterion = nn.CrossEntropyLoss()

    def set_grad_checkpointing(self, enable: bool = True):
        """--gradient-checkpointing on: transformers' own switch, as the benchmark turns it on."""
        if enable:
            (getattr(self.lm, "activation_checkpointing_enable", None) or self.lm.gradient_checkpointing_enable)()

    def forward(self, input_ids):
        mask = torch.ones_like(input_ids)
        logits = self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False)[0]
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = input_ids[..., 1:].contiguous()
        loss = self.criterion(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return SimpleNamespace(loss=loss)


def _build(name: str, **kwargs) -> GPTLM:
    import transformers

    hidden, layers, heads = SIZES[name]
    fields = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024, vocab_size=50257,
                  attn_implementation="eager")
    return GPTLM(transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**fields, **kwargs})))


def gpt2_xl(**kwargs):
    return _build("gpt2_xl", **kwargs)


def gpt2_12b(**kwargs):
    return _build("gpt2_12B", **kwargs)


def gpt2_18b(**kwargs):
    return _build("gpt2_18B", **kwargs)
