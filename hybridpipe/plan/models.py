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

import dataclasses
from dataclasses import dataclass

from hybridpipe.errors import UsageError
from hybridpipe.plan.profile import LayerCost, Profile

__all__ = ["Accelerator", "ACCELERATORS", "ModelPreset", "MODELS", "model_profile", "OPTIMIZER_STATE_FACTOR",
           "conv_layers", "PUBLISHED_IMAGES_PER_SECOND", "published_seconds_per_image"]

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
    ModelPreset("inception3", "cnn", "fp32", 64 * 8,
                note="Inception V3 (Szegedy et al. 2016) at 299×299 without the auxiliary head, fp32; batch 64 "
                     "images per GPU"),
    ModelPreset("vgg16", "cnn", "fp32", 64 * 8,
                note="VGG-16 (Simonyan and Zisserman 2015) at 224×224, fp32; batch 64 images per GPU"),
    # GPipe's 24-layer Transformer (Huang et al. 2019, Table 3, GPUs): its Table 1 defines Transformer-L's layer
    # as model dimension 2048, feed-forward 8192 (4 × 2048), 32 heads; the vocabulary of 32k word pieces and
    # 1024-token sequences are assumed (the ratios between partition counts hardly depend on them)
    ModelPreset("transformer24", "transformer", "fp32", 32, 24, 2048, 32, context=1024, vocabulary=32000,
                note="GPipe's Transformer with 24 layers (Huang et al. 2019): d_model 2048, feed-forward 8192, "
                     "32 heads as its Table 1's Transformer-L; 1024 tokens, vocabulary 32000 assumed; fp32"),
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


def _resnet101(tflops: float, call_ms: float) -> tuple[list[LayerCost], float, float]:
    """ResNet-101's layers costed at ``tflops`` (the counts of :func:`resnet_layers`)."""
    b = BYTES["fp32"]
    layers = [_layer(name, 2 * macs, outputs * b, stored * b, weights * b, tflops, call_ms)
              for name, macs, weights, outputs, stored in resnet_layers()]
    return layers, 3 * 224 * 224 * b, 0.0


# ---- convolutional networks of tf_cnn_benchmarks, counted from their definitions -------------------------------
# Each entry: (layer name, multiply-adds per image, parameters, output elements per image, stored elements per
# image). A "layer" is a unit a pipeline can cut between (a convolution of the stem, an Inception module, a
# bottleneck block, a fully connected layer); its parameters include its batch-norm's scale and shift.

ConvLayer = tuple[str, float, float, float, float]


class _Shapes:
    """Tracks one branch's activation shape through convolutions, counting multiply-adds and parameters."""

    def __init__(self, channels: int, size: int) -> None:
        self.channels, self.height, self.width = channels, size, size
        self.macs = self.params = self.stored = 0.0

    def conv(self, out: int, kh: int, kw: int | None = None, stride: int = 1, pad: tuple[int, int] | int = 0,
             bn: bool = True, bias: bool = False) -> _Shapes:
        kw = kh if kw is None else kw
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        self.height = (self.height + 2 * ph - kh) // stride + 1
        self.width = (self.width + 2 * pw - kw) // stride + 1
        self.macs += self.height * self.width * kh * kw * self.channels * out
        self.params += kh * kw * self.channels * out + (2 * out if bn else 0) + (out if bias else 0)
        self.stored += self.channels * self.height * self.width * stride * stride  # its input (approximately)
        self.stored += out * self.height * self.width * (3 if bn else 1)  # conv, batch-norm, ReLU outputs
        self.channels = out
        return self

    def pool(self, kernel: int, stride: int, pad: int = 0) -> _Shapes:
        self.height = (self.height + 2 * pad - kernel) // stride + 1
        self.width = (self.width + 2 * pad - kernel) // stride + 1
        self.stored += self.channels * self.height * self.width
        return self

    @property
    def elements(self) -> float:
        return self.channels * self.height * self.width


def _module(name: str, channels: int, size: int, branches) -> tuple[ConvLayer, int, int]:
    """An Inception module: each branch a function of a fresh :class:`_Shapes`; outputs concatenated."""
    made = [branch(_Shapes(channels, size)) for branch in branches]
    out = sum(b.channels for b in made)
    height = made[0].height
    layer = (name, sum(b.macs for b in made), sum(b.params for b in made), out * height * height,
             sum(b.stored for b in made) + channels * size * size)
    return layer, out, height


def inception3_layers() -> list[ConvLayer]:
    """Inception V3 (Szegedy et al. 2016) at 299 × 299, torchvision's / tf_cnn_benchmarks' layout without the
    auxiliary head: 23.8 M parameters, 5.7 G multiply-adds."""
    layers: list[ConvLayer] = []
    x = _Shapes(3, 299)
    for name, args, pool in (("Conv2d_1a_3x3", (32, 3, 3, 2), None), ("Conv2d_2a_3x3", (32, 3), None),
                             ("Conv2d_2b_3x3", (64, 3, 3, 1, 1), (3, 2)), ("Conv2d_3b_1x1", (80, 1), None),
                             ("Conv2d_4a_3x3", (192, 3), (3, 2))):
        before = (x.macs, x.params, x.stored)
        x.conv(*args)
        if pool:
            x.pool(*pool)
        layers.append((name, x.macs - before[0], x.params - before[1], x.elements, x.stored - before[2]))
    channels, size = x.channels, x.height

    def a(pool_features):
        return (lambda b: b.conv(64, 1), lambda b: b.conv(48, 1).conv(64, 5, pad=2),
                lambda b: b.conv(64, 1).conv(96, 3, pad=1).conv(96, 3, pad=1),
                lambda b: b.pool(3, 1, 1).conv(pool_features, 1))

    def c(c7):
        return (lambda b: b.conv(192, 1),
                lambda b: b.conv(c7, 1).conv(c7, 1, 7, pad=(0, 3)).conv(192, 7, 1, pad=(3, 0)),
                lambda b: (b.conv(c7, 1).conv(c7, 7, 1, pad=(3, 0)).conv(c7, 1, 7, pad=(0, 3))
                           .conv(c7, 7, 1, pad=(3, 0)).conv(192, 1, 7, pad=(0, 3))),
                lambda b: b.pool(3, 1, 1).conv(192, 1))

    def e_branch(b, first):  # a 1×1 (and 3×3), then 1×3 and 3×1 side by side, concatenated
        b.conv(first[0], 1)
        if len(first) > 1:
            b.conv(first[1], 3, pad=1)
        c_in, h = b.channels, b.height
        left, right = _Shapes(c_in, h).conv(384, 1, 3, pad=(0, 1)), _Shapes(c_in, h).conv(384, 3, 1, pad=(1, 0))
        b.macs += left.macs + right.macs
        b.params += left.params + right.params
        b.stored += left.stored + right.stored
        b.channels = 768
        return b

    e = (lambda b: b.conv(320, 1), lambda b: e_branch(b, (384,)), lambda b: e_branch(b, (448, 384)),
         lambda b: b.pool(3, 1, 1).conv(192, 1))
    modules = [("Mixed_5b", a(32)), ("Mixed_5c", a(64)), ("Mixed_5d", a(64)),
               ("Mixed_6a", (lambda b: b.conv(384, 3, stride=2),
                             lambda b: b.conv(64, 1).conv(96, 3, pad=1).conv(96, 3, stride=2),
                             lambda b: b.pool(3, 2))),
               ("Mixed_6b", c(128)), ("Mixed_6c", c(160)), ("Mixed_6d", c(160)), ("Mixed_6e", c(192)),
               ("Mixed_7a", (lambda b: b.conv(192, 1).conv(320, 3, stride=2),
                             lambda b: b.conv(192, 1).conv(192, 1, 7, pad=(0, 3)).conv(192, 7, 1, pad=(3, 0))
                             .conv(192, 3, stride=2),
                             lambda b: b.pool(3, 2))),
               ("Mixed_7b", e), ("Mixed_7c", e)]
    for name, branches in modules:
        layer, channels, size = _module(name, channels, size, branches)
        layers.append(layer)
    layers.append(("Logits", channels * 1000, channels * 1000 + 1000, 1000, channels * size * size + channels))
    return layers


def vgg16_layers() -> list[ConvLayer]:
    """VGG-16 (Simonyan and Zisserman 2015, configuration D) at 224 × 224: 13 convolutions with biases (no
    batch-norm) and three fully connected layers: 138.4 M parameters, 15.5 G multiply-adds."""
    layers: list[ConvLayer] = []
    x = _Shapes(3, 224)
    for index, (width, pool) in enumerate(((64, 0), (64, 1), (128, 0), (128, 1), (256, 0), (256, 0), (256, 1),
                                           (512, 0), (512, 0), (512, 1), (512, 0), (512, 0), (512, 1))):
        before = (x.macs, x.params, x.stored)
        x.conv(width, 3, pad=1, bn=False, bias=True)
        if pool:
            x.pool(2, 2)
        layers.append((f"conv{index + 1}", x.macs - before[0], x.params - before[1], x.elements,
                       x.stored - before[2]))
    features = x.elements
    for name, fan_in, out in (("fc6", features, 4096), ("fc7", 4096, 4096), ("fc8", 4096, 1000)):
        layers.append((name, fan_in * out, fan_in * out + out, out, fan_in + 2 * out))
    return layers


def resnet_layers(stages: tuple[tuple[int, int, int], ...] = ((3, 64, 1), (4, 128, 2), (23, 256, 2), (3, 512, 2))
                  ) -> list[ConvLayer]:
    """A bottleneck ResNet (He et al. 2016; torchvision's layout, stride in the 3×3) at 224 × 224: ResNet-101
    by default (44.5 M parameters, 7.8 G multiply-adds); ``RESNET_STAGES`` has ResNet-50 and -152."""
    layers: list[ConvLayer] = [("Stem", 112 * 112 * 49 * 3 * 64, 49 * 3 * 64 + 2 * 64, 64 * 56 * 56,
                                3 * 224 * 224 + 3 * 64 * 112 * 112 + 64 * 56 * 56)]
    channels, size = 64, 56
    for blocks, width, stride in stages:
        for index in range(blocks):
            step = stride if index == 0 else 1
            out, downsample = size // step, index == 0
            macs = (size * size * channels * width + out * out * 9 * width * width + out * out * width * 4 * width
                    + (out * out * channels * 4 * width if downsample else 0))
            weights = (channels * width + 9 * width * width + 4 * width * width
                       + (channels * 4 * width if downsample else 0)) + 2 * 6 * width + (8 * width if downsample else 0)
            stored = (channels * size * size + 2 * width * size * size + 2 * width * out * out
                      + 4 * width * out * out * (3 if downsample else 2))
            layers.append(("Bottleneck", macs, weights, 4 * width * out * out, stored))
            channels, size = 4 * width, out
    layers.append(("Classifier", channels * 1000, channels * 1000 + 1000, 1000, channels * size * size + channels))
    return layers


RESNET_STAGES = {"resnet50": ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)),
                 "resnet101": ((3, 64, 1), (4, 128, 2), (23, 256, 2), (3, 512, 2)),
                 "resnet152": ((3, 64, 1), (8, 128, 2), (36, 256, 2), (3, 512, 2))}


def conv_layers(name: str) -> list[ConvLayer]:
    """The layer table of a convolutional preset (``inception3``, ``vgg16``, ``resnet50``/``101``/``152``)."""
    if name == "inception3":
        return inception3_layers()
    if name == "vgg16":
        return vgg16_layers()
    if name in RESNET_STAGES:
        return resnet_layers(RESNET_STAGES[name])
    raise UsageError(f"no layer table for {name!r} (have inception3, vgg16, {', '.join(RESNET_STAGES)})")


# Images per second one GPU trains, as published: TensorFlow's performance page ("Benchmarks", Details for
# NVIDIA DGX-1 (Tesla P100), training, synthetic data, batch 64 per GPU, tf_cnn_benchmarks, May 2017):
# InceptionV3 142, ResNet-50 219, ResNet-152 91.8, VGG16 154. ResNet-101 is not on the page: its time per image
# is interpolated between ResNet-50's and ResNet-152's in proportion to multiply-adds (same blocks, same kernels).
PUBLISHED_IMAGES_PER_SECOND = {("p100", "inception3"): 142.0, ("p100", "resnet50"): 219.0,
                               ("p100", "resnet152"): 91.8, ("p100", "vgg16"): 154.0}
PUBLISHED_BATCH = 64


def published_seconds_per_image(name: str, accelerator: str) -> float | None:
    """One training image's time on one GPU (forward and backward) from :data:`PUBLISHED_IMAGES_PER_SECOND`,
    ResNet-101 interpolated by multiply-adds between ResNet-50 and -152; None where nothing is published."""
    if (accelerator, name) in PUBLISHED_IMAGES_PER_SECOND:
        return 1.0 / PUBLISHED_IMAGES_PER_SECOND[(accelerator, name)]
    if name == "resnet101" and (accelerator, "resnet50") in PUBLISHED_IMAGES_PER_SECOND:
        macs = {n: sum(layer[1] for layer in conv_layers(n)) for n in ("resnet50", "resnet101", "resnet152")}
        low, high = (1.0 / PUBLISHED_IMAGES_PER_SECOND[(accelerator, n)] for n in ("resnet50", "resnet152"))
        return low + (high - low) * (macs["resnet101"] - macs["resnet50"]) / (macs["resnet152"] - macs["resnet50"])
    return None


def _conv_net(name: str, tflops: float, call_ms: float) -> tuple[list[LayerCost], float, float]:
    b, size = BYTES["fp32"], 299 if name == "inception3" else 224
    layers = [_layer(layer, 2 * macs, out * b, stored * b, params * b, tflops, call_ms)
              for layer, macs, params, out, stored in conv_layers(name)]
    return layers, 3 * size * size * b, 0.0


def _as_published(name: str, accelerator: str, layers: list[LayerCost], batch_update_ms: float) -> list[LayerCost]:
    """The layers' times scaled so that a step of :data:`PUBLISHED_BATCH` images (forward, backward and the
    optimizer's ``batch_update_ms``) takes what :func:`published_seconds_per_image` says (their shares kept:
    each layer's FLOPs over the total)."""
    seconds = published_seconds_per_image(name, accelerator)
    if seconds is None:
        published = ", ".join(f"{model} on {gpu}" for gpu, model in PUBLISHED_IMAGES_PER_SECOND)
        raise UsageError(f"no published single-GPU throughput for {name} on {accelerator} (there is for "
                         f"{published}, and resnet101 interpolated on p100)")
    total_ms = sum(layer.forward_ms + layer.backward_ms for layer in layers)
    scale = (seconds * 1e3 - batch_update_ms / PUBLISHED_BATCH) / total_ms
    return [dataclasses.replace(layer, forward_ms=layer.forward_ms * scale, backward_ms=layer.backward_ms * scale,
                                forward_call_ms=0.0, backward_call_ms=0.0) for layer in layers]


def model_profile(name: str, accelerator: str = "h100", efficiency: float = 0.5,
                  call_overhead_us: float = 50.0, measured: bool = False) -> Profile:
    """The :class:`Profile` of a built-in model on an accelerator.

    Args:
        name: One of :data:`MODELS` (e.g. ``"gpt3-1.3b"``, ``"gpt3-175b"``, ``"resnet101"``).
        accelerator: One of :data:`ACCELERATORS` (its peak in the model's precision is used).
        efficiency: The fraction of that peak the layers reach, in (0, 1].
        call_overhead_us: A layer's fixed forward cost per call (its backward: twice that).
        measured: Time the layers from the GPU's published training throughput on this network
            (:data:`PUBLISHED_IMAGES_PER_SECOND`) instead of its peak: each layer keeps its share of the FLOPs,
            with no fixed cost per call; ``efficiency`` is then unused.

    Raises:
        UsageError: an unknown name, an efficiency outside (0, 1], or an accelerator without the
            model's precision (each names the valid values).
    """
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r} (use one of {', '.join(MODELS)})")
    if accelerator not in ACCELERATORS:
        raise UsageError(f"unknown accelerator {accelerator!r} (use one of {', '.join(ACCELERATORS)})")
    if not 0 < efficiency <= 1:
        raise UsageError(f"efficiency must be in (0, 1], a fraction of the peak (got {efficiency}; "
                         "e.g. 0.5 for half of the peak)")
    if call_overhead_us < 0:
        raise UsageError(f"call overhead must be >= 0 microseconds (got {call_overhead_us})")
    preset, device = MODELS[name], ACCELERATORS[accelerator]
    if preset.precision not in device.peak_tflops:
        raise UsageError(f"{accelerator} has no {preset.precision} peak listed (it has "
                         f"{', '.join(device.peak_tflops)})")
    tflops = device.peak_tflops[preset.precision] * efficiency
    call_ms = call_overhead_us / 1e3
    if preset.kind == "transformer":
        layers, input_bytes, loss_ms = _transformer(preset, tflops, call_ms)
    elif preset.kind == "cnn":
        layers, input_bytes, loss_ms = _conv_net(name, tflops, call_ms)
    else:
        layers, input_bytes, loss_ms = _resnet101(tflops, call_ms)
    update_ms_per_mb = UPDATE_TRAFFIC[preset.precision] * 2**20 / (device.memory_tbps * 1e12) * 1e3
    if measured:
        layers = _as_published(name, accelerator, layers,
                               update_ms_per_mb * sum(layer.parameter_bytes for layer in layers) / 2**20)
    return Profile(layers=layers, sample_batch=1, input_bytes=input_bytes, loss_ms=loss_ms,
                   update_ms_per_mb=update_ms_per_mb, device=f"{accelerator} (modelled)",
                   note=f"{preset.note}; " + (
                       f"times from the published {1 / published_seconds_per_image(name, accelerator):.1f} images/s "
                       "of one GPU, shared by FLOPs" if measured else
                       f"times from FLOPs at {efficiency:g} × {device.peak_tflops[preset.precision]:g} TFLOP/s "
                       f"({preset.precision}) plus {call_overhead_us:g} µs per forward call"),
                   extra={"model": name, "accelerator": accelerator, "efficiency": efficiency,
                          "precision": preset.precision})
