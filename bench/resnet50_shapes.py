"""The parameter shapes of torchvision's ResNet-50, computed by code (torchvision is not needed).

ResNet-50's gradients are the classic fusion benchmark: 161 tensors, 25,557,032 floats, from
64-element BatchNorm vectors up to the 2048×1000 classifier. The names and the order are those of
``torchvision.models.resnet50().named_parameters()`` (gradients become ready in roughly the
reverse order during backward).

Run it to print the list: ``python bench/resnet50_shapes.py``.
"""

from __future__ import annotations

import math

__all__ = ["resnet50_parameter_shapes", "RESNET50_TENSORS", "RESNET50_PARAMETERS"]

#: What torchvision's resnet50() has; the function below asserts both.
RESNET50_TENSORS = 161
RESNET50_PARAMETERS = 25_557_032

_BLOCKS_PER_STAGE = (3, 4, 6, 3)
_WIDTHS = (64, 128, 256, 512)
_EXPANSION = 4


def resnet50_parameter_shapes(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """Returns ``[(name, shape), ...]`` for every parameter of ResNet-50, in torchvision's order.

    Stem: conv1 7×7 3→64 (no bias), bn1. Four stages of bottleneck blocks [3, 4, 6, 3] with widths
    64, 128, 256, 512: conv1 1×1 in→width, conv2 3×3 width→width, conv3 1×1 width→4·width, each
    followed by a BatchNorm (weight and bias); the first block of each stage has a downsample
    branch, conv 1×1 in→4·width plus BatchNorm. Then fc 2048→num_classes with bias.

    Args:
        num_classes: classifier outputs (1000 for ImageNet; the asserted totals assume 1000).

    Returns:
        The 161 (name, shape) pairs.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def conv(name: str, out_channels: int, in_channels: int, kernel: int) -> None:
        shapes.append((f"{name}.weight", (out_channels, in_channels, kernel, kernel)))

    def batch_norm(name: str, channels: int) -> None:
        shapes.append((f"{name}.weight", (channels,)))
        shapes.append((f"{name}.bias", (channels,)))

    conv("conv1", 64, 3, 7)
    batch_norm("bn1", 64)
    in_channels = 64
    for stage, (blocks, width) in enumerate(zip(_BLOCKS_PER_STAGE, _WIDTHS), start=1):
        out_channels = width * _EXPANSION
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            conv(f"{prefix}.conv1", width, in_channels, 1)
            batch_norm(f"{prefix}.bn1", width)
            conv(f"{prefix}.conv2", width, width, 3)
            batch_norm(f"{prefix}.bn2", width)
            conv(f"{prefix}.conv3", out_channels, width, 1)
            batch_norm(f"{prefix}.bn3", out_channels)
            if block == 0:
                conv(f"{prefix}.downsample.0", out_channels, in_channels, 1)
                batch_norm(f"{prefix}.downsample.1", out_channels)
            in_channels = out_channels
    shapes.append(("fc.weight", (num_classes, in_channels)))
    shapes.append(("fc.bias", (num_classes,)))

    if num_classes == 1000:
        total = sum(math.prod(shape) for _, shape in shapes)
        assert len(shapes) == RESNET50_TENSORS, f"ResNet-50 has {RESNET50_TENSORS} tensors, computed {len(shapes)}"
        assert total == RESNET50_PARAMETERS, f"ResNet-50 has {RESNET50_PARAMETERS:,} parameters, computed {total:,}"
    return shapes


if __name__ == "__main__":
    listing = resnet50_parameter_shapes()
    for name, shape in listing:
        print(f"{name:32s} {str(shape):22s} {math.prod(shape):>10,}")
    print(f"{len(listing)} tensors, {sum(math.prod(s) for _, s in listing):,} parameters")
