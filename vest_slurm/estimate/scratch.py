"""Scratch memory that CUDA kernels take inside one op, through the caching allocator.

A fake tensor shows an op's outputs, not what its CUDA implementation allocates for itself while
it runs (``at::empty`` inside the kernel wrapper, freed when the op returns). Where that scratch
grows with the batch it adds to the peak, so the tracer inserts it after the op's outputs: an
allocation and a free, category ``workspace``. Each size below follows the PyTorch source that
allocates it (torch 2.6 - 2.14, unchanged between them); anything not listed has no scratch
here (cuBLAS's workspace and cuDNN's are separate: tracing.py, estimator.py).

Row-wise kernels (normalisation, softmax) need contiguous operands and make them so first;
``.contiguous()`` copies what is not (a transposed or permuted view: Whisper's encoder keeps its
residual stream in the convolution's channels-first layout, so every LayerNorm there gets a
non-contiguous input):
    LayerNorm (layer_norm_kernel.cu): forward ``input.expect_contiguous()`` (and weight, bias);
        backward ``input.expect_contiguous()``, weight's, and ``dY.contiguous()``.
    softmax / log_softmax (SoftMax.cu host_softmax): ``input.contiguous()``.
    softmax backward (softmax_backward_cuda_out): ``tmp = grad * output`` always, a tensor of the
        gradient's size (since softmax moved to ATen in 2018); host_softmax_backward then takes
        ``tmp.contiguous()`` and ``output.contiguous()``. log_softmax's backward: the two copies.

cuDNN convolutions (Convolution.cpp, cudnn/ConvShared.cpp) take operands dense in one memory
format, channels-last when the input or the weight suggests it (cudnn_conv_suggest_memory_format),
and copy what is not: forward ``input.contiguous(format)`` and the weight's; backward the input
again when the weight gradient is wanted, ``grad_output.to(input.suggest_memory_format())``, and
each helper's ``grad_output.contiguous(...)`` (backward-input, backward-weight). A channel slice
of a channels-last activation (FocalNet's context) is channels-last-like but not dense: copied.
1-d convolutions make the input contiguous first (forward and backward); ATen's own depthwise
kernel, which NCHW depthwise convolutions take, wants everything NCHW. A convolution off cuDNN
that is not depthwise (bfloat16 before sm80) runs im2col + GEMM (ConvolutionMM2d.cu), one sample
at a time through an im2col buffer of ``C_in/groups x kH x kW x H_out x W_out``; with groups,
Convolution.cpp runs it per group on copied slices and joins the groups' results with ``cat``.

Embedding backward (Embedding.cu embedding_dense_backward_cuda, EmbeddingBackwardKernel.cu): with
more than 3,072 indices (or scale_grad_by_freq) it sorts them and sums partial segments. Alive
together with the result: sorted and original index order and segment offsets (n int64 each, and
the counts with scale_grad_by_freq), two buffers of min(n, vocab) int64, the partial-segment
offsets, and the partial sums, ``(n / 10 + min(n, vocab)) x dim`` in fp32 for half/bf16 gradients
(the gradient's dtype otherwise). The sort's own transients come earlier and are smaller; the
fused kernel of releases after 2.10, taken only for tiny vocabularies, is not modelled.

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

from ._fakecuda import (conv_geometry, conv_groups, conv_on_cudnn, elementwise_output_strides, is_depthwise,
                        suggests_channels_last)

aten = torch.ops.aten

_FLOAT = 4


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _copy_for_kernel(t) -> int:
    """Bytes of the contiguous copy a wrapper makes of ``t.transpose(1, 2)`` (0 when none is needed)."""
    return 0 if t is None else _contiguous_copy(t.transpose(1, 2))


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


def _contiguous_copy(t) -> int:
    """Bytes of ``t.contiguous()`` / ``t.expect_contiguous()`` (0 when ``t`` already is)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return 0
    return t.numel() * t.element_size()


def _dense(shape, strides, channels_last: bool = False) -> bool:
    """Whether a tensor of this shape and these strides is contiguous in the memory format (as
    ``is_contiguous(memory_format)``): NCHW order, or channels-last's (C, W, H, N)."""
    order = (1, 3, 2, 0) if channels_last else range(len(shape) - 1, -1, -1)
    expected = 1
    for d in order:
        if shape[d] != 1 and strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def _copy_into(t, shape, strides, channels_last: bool) -> int:
    """Bytes of ``.contiguous(memory_format)`` of a tensor of t's size and dtype with this layout."""
    return 0 if _dense(shape, strides, channels_last) else t.numel() * t.element_size()


def _softmax_scratch(args) -> list[int]:
    # _softmax / _log_softmax(input, dim, half_to_float): host_softmax's input.contiguous()
    return [_contiguous_copy(args[0])]


def _softmax_bwd_scratch(args) -> list[int]:
    # _softmax_backward_data(grad_output, output, dim, input_dtype): ``tmp = grad * output``, then
    # host_softmax_backward's tmp.contiguous() and output.contiguous()
    grad, output = args[0], args[1]
    dtype = torch.promote_types(grad.dtype, output.dtype)
    tmp = grad.numel() * dtype.itemsize
    strides = elementwise_output_strides(grad, output)
    tmp_copy = 0 if _dense(grad.shape, strides) else tmp
    return [tmp, tmp_copy, _contiguous_copy(output)]


def _log_softmax_bwd_scratch(args) -> list[int]:
    # _log_softmax_backward_data(grad_output, output, dim, input_dtype): the contiguous copies only
    return [_contiguous_copy(args[0]), _contiguous_copy(args[1])]


def _embedding_bwd_scratch(args) -> list[int]:
    # embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    grad, indices, num_weights = args[0], args[1], args[2]
    scale_grad_by_freq = len(args) > 4 and bool(args[4])
    n, dim, index = indices.numel(), grad.shape[-1], indices.element_size()
    sizes = [_contiguous_copy(grad)]
    if n <= 3072 and not scale_grad_by_freq:   # the direct kernel: only the result, grad_weight
        return sizes
    segments = min(n, num_weights)
    partial_segments = n // 10 + segments     # NROWS_PER_THREAD = 10
    acc = 4 if grad.dtype in (torch.float16, torch.bfloat16) else grad.element_size()
    sizes += [n * index] * (4 if scale_grad_by_freq else 3)   # sorted, orig (, count), segment_offsets
    sizes += [segments * index] * 2 + [partial_segments * index, partial_segments * dim * acc]
    return sizes


def _view4d(t):
    """(shape, strides) of a tensor as the cuDNN path sees it: a 3-d one viewed as 2-d of height 1
    (Convolution.cpp view4d, ``unsqueeze(2)``)."""
    if t.dim() != 3:
        return tuple(t.shape), t.stride()
    n, c, length = t.shape
    return (n, c, 1, length), (t.stride(0), t.stride(1), t.stride(2) * length, t.stride(2))


def _conv_layouts(x, w):
    """(input, weight) shapes and strides as the cuDNN path sees them: a 1-d convolution's input
    made contiguous first, then both viewed as 2-d of height 1."""
    if x.dim() == 3:
        n, c, length = x.shape
        return ((n, c, 1, length), (c * length, length, length, 1)), _view4d(w)
    return _view4d(x), _view4d(w)


def _route(x, w, stride, padding, dilation):
    """(conv_geometry's 2-d geometry of the convolution, whether cuDNN runs it), worked out once per op."""
    geo = conv_geometry(x, w, stride, padding, dilation)
    xs, ws, stride, _, dilation = geo
    return geo, conv_on_cudnn(x, w, xs, ws, stride, dilation)[0]


def _columns(x, geo) -> tuple[int, int, int, int]:
    """(groups, bytes of one group's im2col buffer, bytes of one group's input slice, bytes of the
    output) of the convolution as ATen's im2col + GEMM kernel runs it (ConvolutionMM2d.cu
    slow_conv2d: ``columns = empty({C_in/groups * kH * kW, H_out * W_out})``, one sample at a
    time; the dilated kernel's is the same size). A group's slice is a copy (Convolution.cpp
    ``subtensor``: ``narrow(...).contiguous()``) unless the batch is 1."""
    xs, ws, stride, padding, dilation = geo
    h_out, w_out = (max((xs[d] + 2 * padding[i] - dilation[i] * (ws[d] - 1) - 1) // stride[i] + 1, 0)
                    for i, d in ((0, 2), (1, 3)))
    groups = conv_groups(xs, ws)
    elem = x.element_size()
    slice_ = xs[0] * ws[1] * xs[2] * xs[3] * elem if groups > 1 and xs[0] > 1 else 0
    return groups, ws[1] * ws[2] * ws[3] * h_out * w_out * elem, slice_, xs[0] * ws[0] * h_out * w_out * elem


def _slow_conv_scratch(x, w, geo, one_d) -> list[int]:
    """Forward of a convolution off cuDNN that is not depthwise (Convolution.cpp Slow2d /
    SlowDilated2d, which bfloat16 takes before sm80): ``input.contiguous()``; per group the input
    slice, its weight (``expect_contiguous``) and the im2col buffer; with groups, every group's
    output is kept until ``at::cat`` makes the op's output from them."""
    groups, columns, slice_, out = _columns(x, geo)
    sizes = one_d or [_contiguous_copy(x)]
    if groups > 1:
        return sizes + [out, slice_, columns]
    return sizes + [_contiguous_copy(w), columns]


def _slow_conv_bwd_scratch(g, x, w, geo, mask, one_d) -> list[int]:
    """Backward of the same (Convolution.cpp convolution_backward, ConvolutionMM2d.cu
    slow_conv2d_backward): input and weight made contiguous, ``grad_output.expect_contiguous()``,
    one im2col buffer for the input gradient and the weight gradient; with groups, each group's
    gradient-output and input slices, and every group's input and weight gradients until
    ``at::cat``."""
    groups, columns, slice_, _ = _columns(x, geo)
    sizes = (one_d or [_contiguous_copy(x)]) + [_contiguous_copy(w)]
    if groups == 1:
        return sizes + [_contiguous_copy(g), columns]
    g_slice = g.numel() * g.element_size() // groups if g.shape[0] > 1 else 0
    grads = ((x.numel() * x.element_size() if mask[0] else 0)
             + (w.numel() * w.element_size() if mask[1] else 0))
    return sizes + [grads, g_slice, slice_, columns]


def _conv_scratch(args) -> list[int]:
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    x, w, stride, padding, dilation, transposed = args[0], args[1], args[3], args[4], args[5], args[6]
    if transposed or x.dim() not in (3, 4):
        return []
    one_d = [_contiguous_copy(x)] if x.dim() == 3 else []       # input.contiguous() before view4d
    geo, on_cudnn = _route(x, w, stride, padding, dilation)
    if not on_cudnn:
        if not is_depthwise(*geo[:2]):                            # im2col + GEMM
            return _slow_conv_scratch(x, w, geo, one_d)
        # ATen's depthwise kernel: NCHW
        return one_d + ([] if one_d else [_contiguous_copy(x)]) + [_contiguous_copy(w)]
    (xs, xst), (ws, wst) = _conv_layouts(x, w)
    cl = suggests_channels_last(xs, xst) or suggests_channels_last(ws, wst)   # the backend memory format
    return one_d + [_copy_into(x, xs, xst, cl) if not one_d else 0, _copy_into(w, ws, wst, cl)]


def _conv_bwd_scratch(args) -> list[int]:
    # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
    #                      transposed, output_padding, groups, output_mask)
    g, x, w, stride, padding, dilation, transposed = args[0], args[1], args[2], args[4], args[5], args[6], args[7]
    mask = args[10] if len(args) > 10 else (True, True, True)
    if transposed or x.dim() not in (3, 4):
        return []
    sizes = [_contiguous_copy(x)] if x.dim() == 3 else []       # input.contiguous() before view4d
    (xs, xst), (ws, wst) = _conv_layouts(x, w)
    gs = _view4d(g)
    geo, on_cudnn = _route(x, w, stride, padding, dilation)
    if not on_cudnn and not is_depthwise(xs, ws):                 # im2col + GEMM
        return _slow_conv_bwd_scratch(g, x, w, geo, mask, sizes)
    if not on_cudnn:                                              # ATen's depthwise kernel: NCHW
        return sizes + [_copy_into(g, *gs, False), _copy_into(x, xs, xst, False) if mask[1] and not sizes else 0,
                        _copy_into(w, ws, wst, False) if mask[0] else 0]
    x_cl = suggests_channels_last(xs, xst)
    cl = x_cl or suggests_channels_last(ws, wst)
    if mask[1] and not sizes:
        sizes.append(_copy_into(x, xs, xst, cl))                   # Convolution.cpp: input.contiguous(BF)
    if suggests_channels_last(*gs) != x_cl:                       # grad_output.to(input.suggest_memory_format())
        sizes.append(g.numel() * g.element_size())
        gs = (gs[0], _dense_strides(gs[0], x_cl))
    if mask[0]:                                                   # cudnn_convolution_backward_input
        fmt = suggests_channels_last(*gs) or suggests_channels_last(ws, wst)
        sizes += [_copy_into(g, *gs, fmt), _copy_into(w, ws, wst, fmt)]
    if mask[1]:                                                   # cudnn_convolution_backward_weight
        fmt = x_cl or suggests_channels_last(*gs)
        sizes.append(_copy_into(g, *gs, fmt))
        if fmt != cl:
            sizes.append(x.numel() * x.element_size())
    return sizes


def _dense_strides(shape, channels_last: bool):
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)


def _layer_norm_scratch(args) -> list[int]:
    # native_layer_norm(input, normalized_shape, weight, bias, eps)
    return [_contiguous_copy(t) for t in (args[0], *args[2:4])]


def _layer_norm_bwd_scratch(args) -> list[int]:
    # native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)
    return [_contiguous_copy(args[1]), _contiguous_copy(args[5]), _contiguous_copy(args[0])]


def _efficient_bwd_scratch(args) -> list[int]:
    # _scaled_dot_product_efficient_attention_backward(grad_out, query, key, value, attn_bias, out, ...)
    grad_out, query = args[0], args[1]
    batch, heads, seq_q, head_dim = query.shape
    tiles = -(-seq_q // 64) * -(-head_dim // 64)
    workspace = batch * heads * _round_up(tiles * (64 * 64 * _FLOAT + 16) // _FLOAT, 4) * _FLOAT
    return [_copy_for_kernel(grad_out), batch * heads * seq_q * _FLOAT, workspace]


def _cudnn_bwd_scratch(args) -> list[int]:
    # _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, ...)
    # cudnn/MHA.cpp run_cudnn_SDP_bprop: grad_out copied to the output's layout where it differs
    # (permute_to_matching_layout), then cuDNN's workspace, modelled as the working set of the
    # FlashAttention-2 backward its kernel runs, as flash's: an fp32 dQ accumulator and the
    # softmax's row sums (cuDNN sizes it; the GPU check measures it)
    grad_out, query, out = args[0], args[1], args[4]
    batch, heads, seq_q, head_dim = query.shape
    copy = 0 if grad_out.stride() == out.stride() else grad_out.numel() * grad_out.element_size()
    return [copy, batch * heads * seq_q * _FLOAT, batch * heads * seq_q * head_dim * _FLOAT]


_SCRATCH = {
    aten._scaled_dot_product_cudnn_attention_backward.default: ("cudnn_attention", _cudnn_bwd_scratch),
    aten._scaled_dot_product_flash_attention_backward.default: ("flash_attention", _flash_bwd_scratch),
    aten._scaled_dot_product_efficient_attention_backward.default: ("efficient_attention", _efficient_bwd_scratch),
    aten._softmax.default: ("softmax", _softmax_scratch),
    aten._log_softmax.default: ("softmax", _softmax_scratch),
    aten._softmax_backward_data.default: ("softmax", _softmax_bwd_scratch),
    aten._log_softmax_backward_data.default: ("softmax", _log_softmax_bwd_scratch),
    aten.embedding_dense_backward.default: ("embedding", _embedding_bwd_scratch),
    aten.convolution.default: ("conv_scratch", _conv_scratch),
    aten.convolution_backward.default: ("conv_scratch", _conv_bwd_scratch),
    aten.native_layer_norm.default: ("layer_norm", _layer_norm_scratch),
    aten.native_layer_norm_backward.default: ("layer_norm", _layer_norm_bwd_scratch),
}


def kernel_scratch(func, args) -> tuple[str, list[int]] | None:
    """(name, buffer sizes in allocation order) of the scratch this op's CUDA kernel allocates
    after its outputs and frees before it returns; None for ops without any."""
    entry = _SCRATCH.get(func)
    if entry is None:
        return None
    name, sizes = entry
    return name, [n for n in sizes(args) if n > 0]
