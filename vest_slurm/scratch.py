"""Scratch memory that CUDA kernels take inside one op, through the caching allocator.

A fake tensor shows an op's outputs, not what its CUDA implementation allocates for itself while
it runs (``at::empty`` inside the kernel wrapper, freed when the op returns). Where that scratch
grows with the batch it adds to the peak, so the tracer inserts it after the op's outputs: an
allocation and a free, category ``workspace``. Each size below follows the PyTorch source that
allocates it (torch 2.6 - 2.14, unchanged between them); anything not listed has no scratch
here (cuBLAS's workspace and cuDNN's are separate: tracing.py, estimator.py).

Both backward wrappers (attention_backward.cu) hand the kernels the tensors in the
[batch, seqlen, heads, head_dim] frame (``.transpose(1, 2)`` of the [batch, heads, seqlen, dim]
arguments) and first make a contiguous copy of what is not contiguous in that frame: flash
attention of ``grad_out`` and ``out`` (``_flash_attention_backward``), memory-efficient attention
of ``grad_out``. They are not contiguous there when the query, key and value were made contiguous
in [batch, heads, seqlen, dim] (``.transpose(1, 2).contiguous()``, as Whisper's attention does):
the kernel's output takes the query's layout. The copies live until the wrapper returns.

Flash attention backward (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp,
``mha_bwd``; q is [batch, seqlen_q, heads, head_dim] there):
    softmax_d  = empty({batch, heads, seqlen_q_rounded}, float)
    dq_accum   = empty({batch, seqlen_q_rounded, heads, head_size_rounded}, float)
               (always: ``bool loop = true``; the deterministic variant is not modelled)
    seqlen_q_rounded = round_up(seqlen_q, 128); head_size_rounded = round_up(head_dim, 32) for
    head_dim <= 192, else 256.
    With fewer key/value heads than query heads (GQA/MQA), the gradients of every query head
    before they are summed per key/value head:
    dk_expanded, dv_expanded = empty({batch, seqlen_k, heads, head_dim}) each, of q's dtype

Memory-efficient attention backward (attention_backward.cu ``_efficient_attention_backward``
and cuda/mem_eff_attention/kernel_backward.h):
    delta      = empty({batch, heads, seqlen_q}, float)
    workspace  = batch * heads * workspace_strideBH() floats, where on sm70+ (kEnableSplitKeys)
                 the gradQ accumulator holds ceil(M / kBlockSizeI) * ceil(D / kN) tiles of
                 kBlockSizeI x kN floats plus a 16-byte lock header: about an fp32 copy of dQ
                 with M and D rounded up to the tile (64 here: the sm80 f16/f32 backward
                 kernels' kBlockSizeI and MatmulGradQ's kN are 64 for head_dim <= 128). The
                 dK/dV accumulators are only needed when dK/dV are not kept in registers (fp32,
                 or head_dim above the block); then they add num_splits_key x kBlockSizeJ x D
                 floats per head: a few KiB, left out.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_FLOAT = 4


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _copy_for_kernel(t) -> int:
    """Bytes of the contiguous copy a wrapper makes of ``t.transpose(1, 2)`` (0 when none is needed)."""
    if t is None or t.transpose(1, 2).is_contiguous():
        return 0
    return t.numel() * t.element_size()


def _flash_bwd_scratch(args) -> list[int]:
    # _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, ...)
    grad_out, query, key, out = args[0], args[1], args[2], args[4]
    batch, heads, seq_q, head_dim = query.shape
    seq_r = _round_up(seq_q, 128)
    head_r = _round_up(head_dim, 32) if head_dim <= 192 else 256
    sizes = [_copy_for_kernel(grad_out), _copy_for_kernel(out),
             batch * heads * seq_r * _FLOAT, batch * seq_r * heads * head_r * _FLOAT]
    if key.shape[1] != heads:   # GQA / MQA
        sizes += [batch * key.shape[2] * heads * head_dim * query.element_size()] * 2
    return sizes


def _efficient_bwd_scratch(args) -> list[int]:
    # _scaled_dot_product_efficient_attention_backward(grad_out, query, key, value, attn_bias, out, ...)
    grad_out, query = args[0], args[1]
    batch, heads, seq_q, head_dim = query.shape
    tiles = -(-seq_q // 64) * -(-head_dim // 64)
    workspace = batch * heads * _round_up(tiles * (64 * 64 * _FLOAT + 16) // _FLOAT, 4) * _FLOAT
    return [_copy_for_kernel(grad_out), batch * heads * seq_q * _FLOAT, workspace]


_SCRATCH = {
    aten._scaled_dot_product_flash_attention_backward.default: ("flash_attention", _flash_bwd_scratch),
    aten._scaled_dot_product_efficient_attention_backward.default: ("efficient_attention", _efficient_bwd_scratch),
}


def kernel_scratch(func, args) -> tuple[str, list[int]] | None:
    """(name, buffer sizes in allocation order) of the scratch this op's CUDA kernel allocates
    after its outputs and frees before it returns; None for ops without any."""
    entry = _SCRATCH.get(func)
    if entry is None:
        return None
    name, sizes = entry
    return name, [n for n in sizes(args) if n > 0]
