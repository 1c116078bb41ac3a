"""transformers' Llama with torchtitan's output: fp32 logits, returned to the training loop.

torchtitan's Transformer of March 2024 (torchtrain/models/llama/model.py at commit 6722657, the
code of its PR #165 runs) ends ``output = self.output(h).float(); return output``, and its
train.py keeps ``pred = model(input_ids)`` through ``loss.backward()``, computing
``F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))`` in the loop. So at the loss and the
start of backward the run holds the fp32 logits (batch x seq x vocab x 4 bytes: 2,000 MiB at
8 x 2048 x 32000) besides log_softmax's saved fp32 output. transformers' LlamaForCausalLM instead
keeps its bf16 logits in its output and upcasts inside its loss function (a temporary). This
factory gives the former with transformers' blocks: the bf16 logits are cast and dropped (a cast's
backward saves nothing), the fp32 ones are the model's output, the loop's loss on them is
vest-slurm's next-token cross-entropy (tracing._loss), as torchtitan's.

    vest estimate --model benchmarks/models/torchtitan_logits.py:llama2_7b --input seq2048 ...
"""

from torch import nn


class FloatLogits(nn.Module):
    """A causal LM whose forward returns its logits cast to fp32 (torchtitan's ``.float()``)."""

    _no_split_modules = ["LlamaDecoderLayer"]   # FSDP's wrapping unit, as for the HF model itself

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config   # the block count the scaled trace cuts (sharded_trace._cut_stack)

    def set_grad_checkpointing(self, enable: bool = True):
        """--gradient-checkpointing on: transformers' own, each decoder layer (torchtitan's full AC
        wraps each block in checkpoint_wrapper the same way)."""
        if enable:
            (getattr(self.lm, "activation_checkpointing_enable", None) or self.lm.gradient_checkpointing_enable)()

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids).logits.float()


def llama2_7b(**kwargs):
    """Llama 2 7B as torchtitan's llama_7b.toml trains it: dim 4096, 32 layers and heads, FFN 11008,
    vocab 32000 (the Llama 2 tokenizer)."""
    import transformers

    fields = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    config = transformers.LlamaConfig(**{**fields, **kwargs})   # --model-arg overrides (a small one in tests)
    return FloatLogits(transformers.LlamaForCausalLM(config))
