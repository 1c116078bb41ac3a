"""torchtitan's own Llama 3 and its train.py's loss, for the sharded benchmark's 8B x 8192 row.

The published figure (pytorch/pytorch PR #132445's "Before": Llama3-8B, FSDP2 over 8 H100, bf16
params / fp32 reduce, no AC, local batch 1, seq 8192) was measured on torchtitan's Transformer, not
transformers' LlamaForCausalLM: its RMSNorm, its rotary embedding (complex multiplication on fp32
copies of q and k) and its output (``self.output(h).float()``) save other tensors for backward.
The model is torchtitan's code at the run's commit (1ec2ece51, the llama3_8b.toml of the run),
imported from a checkout of that commit (``$VEST_TORCHTITAN``: a folder holding
``torchtitan/models``, which scripts/bench_sharding.py extracts from the fetched mirror; the code is
never committed here). Its train.py at that commit computes the loss and drops the logits before
backward::

    pred = model(input_ids)
    loss = loss_fn(pred, labels)   # F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
    del pred                       # "need to free to before bwd to avoid peaking memory"
    loss.backward()

so this factory's forward returns only the loss (``--loss model``): the fp32 logits live until
log_softmax has saved its output, as in the run. FSDP2 wraps each TransformerBlock (torchtitan's
parallelize_llama: ``fully_shard`` per block, then the root), said by ``_no_split_modules``.

    VEST_TORCHTITAN=DIR vest estimate --model benchmarks/models/torchtitan_llama3.py:llama3_8b \\
        --input seq8192 --loss model ...
"""

import os
import sys
from types import SimpleNamespace

from torch import nn
from torch.nn import functional as F


def _torchtitan():
    where = os.environ.get("VEST_TORCHTITAN")
    if not where or not os.path.isdir(os.path.join(where, "torchtitan", "models")):
        raise ImportError("set VEST_TORCHTITAN to a folder holding torchtitan/models at commit 1ec2ece51 "
                          "(scripts/bench_sharding.py --mirror DIR extracts it)")
    if where not in sys.path:
        sys.path.insert(0, where)
    import torchtitan.models.llama as llama

    return llama


class TrainStep(nn.Module):
    """torchtitan's Transformer with train.py's loss: forward(tokens) -> an object with ``.loss``."""

    _no_split_modules = ["TransformerBlock"]

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        pred = self.model(input_ids)
        labels = input_ids   # token ids below the vocabulary, as the loader's shifted labels are
        loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
        del pred
        return SimpleNamespace(loss=loss)


def llama3_8b(vocab_size: int = 128256, max_seq_len: int = 8192, n_layers: int = 32, **kwargs):
    """Llama 3 8B as torchtitan's llama3_8b.toml (commit 1ec2ece51) trains it: its "8B" flavor,
    norm_type rmsnorm, the tiktoken vocabulary of 128,256, seq_len 8192."""
    llama = _torchtitan()
    args = llama.llama3_configs["8B"]
    args.vocab_size, args.max_seq_len, args.n_layers, args.norm_type = vocab_size, max_seq_len, n_layers, "rmsnorm"
    for k, v in kwargs.items():
        setattr(args, k, v)
    return TrainStep(llama.Transformer(args))
