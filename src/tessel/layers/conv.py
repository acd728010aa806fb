"""`Conv2d`: nn.Conv2d whose forward runs tessel's implicit-GEMM conv2d kernel."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tessel.kernels.conv2d import conv2d


class _Conv2dFunction(torch.autograd.Function):
    """Forward on tessel's conv2d; backward with torch's own convolution gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.conf = (stride, padding, dilation, groups, bias is not None)
        return conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, has_bias = ctx.conf
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(x.shape, weight, grad_out, stride, padding, dilation, groups)
        if ctx.needs_input_grad[1]:
            grad_w = torch.nn.grad.conv2d_weight(x, weight.shape, grad_out, stride, padding, dilation, groups)
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None, None, None, None


class Conv2d(nn.Conv2d):
    """Drop-in nn.Conv2d (same constructor, parameters and state_dict) on tessel's conv2d.

    Zero padding given as ints runs straight through the kernel; string padding ('same') and the
    other padding modes ('reflect', 'replicate', 'circular') pad with F.pad first, as nn.Conv2d does.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            if padding == "same":
                x = F.pad(x, self._reversed_padding_repeated_twice)
            padding = (0, 0)
        squeeze = x.dim() == 3  # nn.Conv2d accepts an unbatched [C, H, W] input
        if squeeze:
            x = x.unsqueeze(0)
        out = _Conv2dFunction.apply(
            x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups
        )
        return out.squeeze(0) if squeeze else out

    @classmethod
    def from_conv(cls, layer: nn.Conv2d) -> Conv2d:
        """A tessel Conv2d sharing `layer`'s parameters."""
        new = cls(
            layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
            layer.dilation, layer.groups, layer.bias is not None, layer.padding_mode, device="meta",
        )  # fmt: skip
        new.weight = layer.weight
        new.bias = layer.bias
        return new
