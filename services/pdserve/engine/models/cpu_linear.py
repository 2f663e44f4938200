"""Linear layers with oneDNN-prepacked weights, for CPU inference.

On CPU, `F.linear` over a row-major [out, in] weight runs far below memory bandwidth for
the few-row matmuls of decode: one batch-1 step of the 55M demo model spends ~13 ms in
them, ~7 ms once each weight is reordered into oneDNN's blocked layout (issue 3). The
reorder happens once, at load; the ops are the pair `torch.compile`'s CPU weight-freezing
pass emits. Elsewhere (CUDA, float16, a torch without oneDNN) the plain `nn.Linear` stays.
"""

from __future__ import annotations

import torch
from torch import nn

# The batch size oneDNN picks the packed layout for. 512 was fastest for every row count
# measured (1, 16, 128, 512, 2048); a hint of 1 made 128-row matmuls 5x slower and a hint
# of 16 (or none) made 1-row matmuls 7-15x slower, as oneDNN then reorders on every call.
PACK_BATCH_HINT = 512


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch build can run prepacked linears for weights on `device`."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PrepackedLinear(nn.Module):
    """`nn.Linear` for inference whose weight lives in oneDNN's layout (no dense copy)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Not persistent: the packed tensor is opaque (no strides, no bytes to save).
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT),
            persistent=False,
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # attr "none": no fused activation after the matmul.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def prepack_linears(model: nn.Module) -> None:
    """Replace every `nn.Linear` in `model` by a `PrepackedLinear`, in place.

    Call after the weights are loaded on the CPU. A tied `lm_head` gets its own packed
    copy; the embedding keeps the dense tensor it looks rows up in.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PrepackedLinear(child))
