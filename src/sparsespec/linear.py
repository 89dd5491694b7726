"""Weight formats for linear layers: every projection in the model is one of these callables.

A linear maps ``x: [..., in_features]`` to ``[..., out_features]`` and reports the bytes its weights occupy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    """Plain float weights (float32 or bfloat16): ``weight [out, in]``, optional ``bias [out]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.bias = None if bias is None else bias.to(dtype).contiguous()

    @property
    def nbytes(self) -> int:
        size = self.weight.numel() * self.weight.element_size()
        return size + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> DenseLinear:
    """Build the linear for ``weight [out, in]`` (float, any dtype) in the compute ``dtype``."""
    return DenseLinear(weight, bias, dtype)
