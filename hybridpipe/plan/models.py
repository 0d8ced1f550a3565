"""Built-in profiles from published model sizes (GPT-3's family, ResNet-101) costed on a described
accelerator: the planner's input for clusters beyond this machine (``python -m hybridpipe.plan --simulate``).

Design reasons:

* A layer's time is its floating-point operations divided by the accelerator's dense peak in the
  model's precision times an efficiency (the fraction of peak a well-tuned framework reaches:
  Megatron-LM reports about half of peak for GPT models on A100s), plus a fixed cost per call
  (kernel launches, small kernels), so that tiny micro-batches cost more per sample, as measured
  profiles do. The backward is twice the forward (two matrix products per forward one).
* Transformer FLOPs per sequence of ``s`` tokens and width ``h`` (Narayanan et al. 2021, the
  count behind GPT-3's "6 · parameters · tokens"): a block's forward ``s·(24h² + 4sh)``, the
  output head's ``2shV``. Activations per block ``34·s·h`` bytes in 16-bit training with
  flash attention (Korthikanti et al. 2022, without the ``5as²`` attention-score term). Weights
  and gradients in 16 bits, Adam's master weights and two moments in fp32: 12 bytes of
  optimizer state per 2 bytes of weights (``OPTIMIZER_STATE_FACTOR``).
* The optimizer's step reads and writes its state once per step: its time is those bytes over the
  accelerator's memory bandwidth (``UPDATE_TRAFFIC``).
* ResNet-101 (He et al. 2016, torchvision's layout: stride in the 3×3 convolution) at 224×224 in
  fp32 with momentum SGD, as Horovod's paper trained it: the stem, 33 bottleneck blocks and the classifier as
  layers, each with its multiply-adds, parameters, output and stored activations counted from
  its convolutions' shapes (batch-norm and ReLU outputs stored, as autograd keeps them).
* The output head is a layer of its own with its own weights: a pipeline cannot share the
  embedding's weights with it across stages (tied weights become a copy, as in Megatron).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpipe.errors import HybridPipeError
from hybridpipe.plan.profile import LayerCost, Profile

__all__ = ["Accelerator", "ACCELERATORS", "ModelPreset", "MODELS", "model_profile", "OPTIMIZER_STATE_FACTOR"]

GIB = 2**30
OPTIMIZER_STATE_FACTOR = {"bf16": 6.0, "fp16": 6.0, "fp32": 1.0}  # 16-bit: Adam, fp32 master; fp32: momentum
# bytes the optimizer's step reads and writes per byte of 16-bit weights (fp32 master, two moments, the
# gradient, the 16-bit copy) or of fp32 weights (weight, gradient, momentum)
UPDATE_TRAFFIC = {"bf16": 14.0, "fp16": 14.0, "fp32": 5.0}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Accelerator:
    """An accelerator and the host it usually sits in (the ``--simulate`` defaults).

    Attributes:
        name: Its name.
        peak_tflops: Dense peak per precision ("bf16", "fp16", "fp32"), TFLOP/s, from the vendor's sheet.
        memory_bytes: Its memory.
        per_host: Accelerators per host.
        intra_host_gbps: Bandwidth between two accelerators of a host, Gbit/s.
        inter_host_gbps: A host's network, all its NICs together, Gbit/s.
        latency_us: One message's latency (a pipeline hop, a ring step).
        memory_tbps: Memory bandwidth, TB/s (the optimizer's step is bound by it).
    """

    name: str
    peak_tflops: dict[str, float]
    memory_bytes: float
    per_host: int
    intra_host_gbps: float
    inter_host_gbps: float
    latency_us: float
    memory_tbps: float


ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 SXM 80GB (8 per host, NVLink 900 GB/s, 8 × 400 Gbit/s)",
                        {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, 80 * GIB, 8, 900 * 8, 8 * 400, 5.0, 3.35),
    "a100": Accelerator("NVIDIA A100 SXM 80GB (8 per host, NVLink 600 GB/s, 8 × 200 Gbit/s)",
                        {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 80 * GIB, 8, 600 * 8, 8 * 200, 5.0, 2.04),
    "v100": Accelerator("NVIDIA V100 SXM2 32GB (8 per host, NVLink 150 GB/s, 4 × 100 Gbit/s)",
                        {"fp16": 125.0, "fp32": 15.7}, 32 * GIB, 8, 150 * 8, 4 * 100, 8.0, 0.9),
    "p100": Accelerator("NVIDIA P100 16GB (4 per host, PCIe 10 GB/s, 25 Gbit/s RoCE: Horovod's paper)",
                        {"fp16": 21.2, "fp32": 10.6}, 16 * GIB, 4, 10 * 8, 25, 10.0, 0.73),
}


@dataclass(frozen=True)
class ModelPreset:
    """A published model: its shape, precision and the global batch it was trained with."""

    name: str
    kind: str                  # "transformer" or "resnet"
    precision: str
    global_batch: int          # samples (sequences, images) per step as published
    layers: int = 0            # transformer blocks
    hidden: int = 0
    heads: int = 0
    context: int = 2048
    vocabulary: int = 50257
    note: str = ""


def _gpt3(name: str, layers: int, hidden: int, heads: int, batch_tokens: str, sequences: int) -> ModelPreset:
    return ModelPreset(name, "transformer", "bf16", sequences, layers, hidden, heads,
                       note=f"GPT-3 paper (Brown et al. 2020) Table 2.1: {layers} layers, d_model {hidden}, "
                            f"{heads} heads, context 2048, batch {batch_tokens} tokens ({sequences} sequences)")


MODELS = {preset.name: preset for preset in (
    _gpt3("gpt3-125m", 12, 768, 12, "0.5M", 256), _gpt3("gpt3-350m", 24, 1024, 16, "0.5M", 256),
    _gpt3("gpt3-760m", 24, 1536, 16, "0.5M", 256), _gpt3("gpt3-1.3b", 24, 2048, 24, "1M", 512),
    _gpt3("gpt3-2.7b", 32, 2560, 32, "1M", 512), _gpt3("gpt3-6.7b", 32, 4096, 32, "2M", 1024),
    _gpt3("gpt3-13b", 40, 5140, 40, "2M", 1024), _gpt3("gpt3-175b", 96, 12288, 96, "3.2M", 1536),
    ModelPreset("resnet101", "resnet", "fp32", 64 * 8,
                note="ResNet-101 (He et al. 2016) at 224×224, fp32; batch 64 images per GPU"),
)}


def _layer(name: str, forward_flops: float, output_bytes: float, activation_bytes: float, parameter_bytes: float,
           tflops: float, call_ms: float) -> LayerCost:
    forward_ms = forward_flops / (tflops * 1e12) * 1e3
    return LayerCost(name=name, forward_ms=forward_ms, backward_ms=2 * forward_ms, output_bytes=output_bytes,
                     activation_bytes=activation_bytes, parameter_bytes=int(parameter_bytes),
                     forward_call_ms=call_ms, backward_call_ms=2 * call_ms)


def _transformer(preset: ModelPreset, tflops: float, call_ms: float) -> tuple[list[LayerCost], float, float]:
    s, h, vocabulary, b = preset.context, preset.hidden, preset.vocabulary, BYTES[preset.precision]
    layers = [_layer("Embedding", 0.0, s * h * b, s * h * b, (vocabulary + s) * h * b, tflops, call_ms)]
    block_flops = s * (24 * h * h + 4 * s * h)
    layers += [_layer("Block", block_flops, s * h * b, 34 * s * h * b / 2, (12 * h * h + 13 * h) * b, tflops,
                      call_ms) for _ in range(preset.layers)]
    # the head keeps its input and the logits; the loss's fp32 softmax is counted with it
    layers.append(_layer("Head", 2 * s * h * vocabulary, s * vocabulary * b, s * h * b + s * vocabulary * (b + 4),
                         (vocabulary * h + 2 * h) * b, tflops, call_ms))
    loss_ms = 3 * 5 * s * vocabulary / (tflops * 1e12) * 1e3  # softmax and its gradient: a few FLOPs per logit
    return layers, s * 8, loss_ms  # input: token ids (int64)


RESNET101_STAGES = ((3, 64, 1), (4, 128, 2), (23, 256, 2), (3, 512, 2))  # blocks, width, stride of the first


def _resnet101(tflops: float, call_ms: float) -> tuple[list[LayerCost], float, float]:
    b = BYTES["fp32"]
    # stem: 7×7/2 convolution 3→64 at 112², batch-norm, ReLU, 3×3/2 max-pool to 56²
    layers = [_layer("Stem", 2 * 112 * 112 * 49 * 3 * 64, 64 * 56 * 56 * b,
                     (3 * 224 * 224 + 3 * 64 * 112 * 112 + 64 * 56 * 56) * b, (49 * 3 * 64 + 2 * 64) * b,
                     tflops, call_ms)]
    channels, size = 64, 56
    for blocks, width, stride in RESNET101_STAGES:
        for index in range(blocks):
            step = stride if index == 0 else 1
            out, downsample = size // step, index == 0
            macs = (size * size * channels * width + out * out * 9 * width * width + out * out * width * 4 * width
                    + (out * out * channels * 4 * width if downsample else 0))
            weights = (channels * width + 9 * width * width + 4 * width * width
                       + (channels * 4 * width if downsample else 0)) + 2 * 6 * width + (8 * width if downsample else 0)
            stored = (channels * size * size + 2 * width * size * size + 2 * width * out * out
                      + 4 * width * out * out * (3 if downsample else 2))
            layers.append(_layer("Bottleneck", 2 * macs, 4 * width * out * out * b, stored * b, weights * b, tflops,
                                 call_ms))
            channels, size = 4 * width, out
    layers.append(_layer("Classifier", 2 * channels * 1000, 1000 * b, (channels * size * size + channels) * b,
                         (channels * 1000 + 1000) * b, tflops, call_ms))
    return layers, 3 * 224 * 224 * b, 0.0


def model_profile(name: str, accelerator: str = "h100", efficiency: float = 0.5,
                  call_overhead_us: float = 50.0) -> Profile:
    """The :class:`Profile` of a built-in model on an accelerator.

    Args:
        name: One of :data:`MODELS` (e.g. ``"gpt3-1.3b"``, ``"gpt3-175b"``, ``"resnet101"``).
        accelerator: One of :data:`ACCELERATORS` (its peak in the model's precision is used).
        efficiency: The fraction of that peak the layers reach, in (0, 1].
        call_overhead_us: A layer's fixed forward cost per call (its backward: twice that).

    Raises:
        HybridPipeError: an unknown name, an efficiency outside (0, 1], or an accelerator without the
            model's precision (each names the valid values).
    """
    if name not in MODELS:
        raise HybridPipeError(f"unknown model {name!r} (use one of {', '.join(MODELS)})")
    if accelerator not in ACCELERATORS:
        raise HybridPipeError(f"unknown accelerator {accelerator!r} (use one of {', '.join(ACCELERATORS)})")
    if not 0 < efficiency <= 1:
        raise HybridPipeError(f"efficiency must be in (0, 1], a fraction of the peak (got {efficiency}; "
                              "e.g. 0.5 for half of the peak)")
    if call_overhead_us < 0:
        raise HybridPipeError(f"call overhead must be >= 0 microseconds (got {call_overhead_us})")
    preset, device = MODELS[name], ACCELERATORS[accelerator]
    if preset.precision not in device.peak_tflops:
        raise HybridPipeError(f"{accelerator} has no {preset.precision} peak listed (it has "
                              f"{', '.join(device.peak_tflops)})")
    tflops = device.peak_tflops[preset.precision] * efficiency
    call_ms = call_overhead_us / 1e3
    if preset.kind == "transformer":
        layers, input_bytes, loss_ms = _transformer(preset, tflops, call_ms)
    else:
        layers, input_bytes, loss_ms = _resnet101(tflops, call_ms)
    update_ms_per_mb = UPDATE_TRAFFIC[preset.precision] * 2**20 / (device.memory_tbps * 1e12) * 1e3
    return Profile(layers=layers, sample_batch=1, input_bytes=input_bytes, loss_ms=loss_ms,
                   update_ms_per_mb=update_ms_per_mb, device=f"{accelerator} (modelled)",
                   note=f"{preset.note}; times from FLOPs at {efficiency:g} × {device.peak_tflops[preset.precision]:g} "
                        f"TFLOP/s ({preset.precision}) plus {call_overhead_us:g} µs per forward call",
                   extra={"model": name, "accelerator": accelerator, "efficiency": efficiency,
                          "precision": preset.precision})
