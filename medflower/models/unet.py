"""U-Net and ResU-Net: whole-model segmentation baselines from segmentation_models_pytorch (FedSCA's Figure 7).

Not foundation-model tuning: every parameter trains from a seeded random init (``adapter='full'``), so they run
under the strategies that exchange whatever a model trains (``fedavg``, ``fedprox``, ``local``, ``scaffold``,
``feddyn``) and under LAT (``lat``), which shares only the lowest encoder stages.

- ``unet``: smp ``Unet`` with the ``vgg13_bn`` encoder. smp has no plain U-Net encoder; VGG-13 is the classic
  U-Net contracting path (two 3x3 conv + BatchNorm + ReLU per level, 2x2 max-pooling between levels, widths
  64-128-256-512-512) and smp's decoder is its expanding path (upsample x2, concatenate the skip, two 3x3 conv +
  BatchNorm + ReLU), with a centre block of two convs at 1/32.
- ``resunet`` (``resnet34``) and ``resunet-<18|34|50|101|152>``: smp ``Unet`` with a ResNet encoder.

Both have 5 downsamplings, so inputs must be divisible by 32. The output is ``[B, K, H, W]`` logits, one sigmoid
channel per foreground structure like the rest of medflower's segmenters (BCE + soft Dice).

Exchanged arrays, in forward order:
- the encoder's parameters as ``backbone.stages.<s>.<path inside the encoder, '/'-separated>``, stage ``s`` = 0 the
  shallowest. A stage is one "adapter module" for LAT (``naming.adapter_module`` groups by everything before the last
  '.'), so ``lat-layers=L`` shares the L lowest encoder stages. VGG: stage s = the convs at 1/2^s; ResNet: stage 0 =
  the stem (conv1, bn1), stage s = ``layer<s>``.
- the decoder (``decoder.*``) and the segmentation head (``head.*``): never an adapter module, so LAT keeps them on
  the site;
- then the BatchNorm running statistics as ``statistics.<module path>.running_mean``/``running_var``: they travel
  with the parameters (the rule for a fully trained backbone, docs/models.md) under every strategy that sends the
  whole model; they belong to no adapter module, so under ``lat``/``sgca`` each site keeps its own (as FedBN does).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

import medflower.models.arrays as arrays

from .adapted import AdaptedModel, check_num_classes
from .errors import ModelError
from .spec import OUTPUT_STRIDE, UNET_BACKBONES, UNET_ENCODERS, ModelSpec, check_unet_spec, is_unet

STAGE_PREFIX = "backbone.stages."
STATISTICS_PREFIX = "statistics."
_IN_STAGE_SEPARATOR = "/"


def encoder_stages(encoder: nn.Module) -> list[list[str]]:
    """The encoder's stages, shallowest first, each a list of its submodule paths (only stages with parameters).

    VGG (smp ``VGGEncoder``): the layers between max-pools, stage s at 1/2^s. ResNet (smp ``ResNetEncoder``): the
    stem (conv1, bn1), then layer1..layer4.
    """
    if isinstance(getattr(encoder, "features", None), nn.Sequential):
        stages: list[list[str]] = [[]]
        for i, module in enumerate(encoder.features):
            if isinstance(module, nn.MaxPool2d):
                stages.append([])
            elif any(True for _ in module.parameters()):
                stages[-1].append(f"features.{i}")
        return [s for s in stages if s]
    if all(hasattr(encoder, n) for n in ("conv1", "bn1", "layer1", "layer4")):
        return [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]]
    raise ModelError(f"no stage map for the smp encoder {type(encoder).__name__}")


class UNetSegmenter(AdaptedModel):
    """smp ``Unet``: ``head(decoder(backbone(x)))``, every parameter trainable; see the module docstring for names."""

    task = "segmentation"
    task_module = "decoder"

    def __init__(self, encoder: nn.Module, decoder: nn.Module, head: nn.Sequential, spec: ModelSpec, encoder_name: str):
        super().__init__(encoder, spec=spec, weights_source="random")
        self.decoder = decoder
        self.head = head
        self.encoder_name = encoder_name
        self.num_classes = head[0].out_channels
        self.stages = encoder_stages(encoder)
        self._name_arrays()

    def _name_arrays(self) -> None:
        stage_of = {path: s for s, paths in enumerate(self.stages) for path in paths}
        named: list[tuple[int, int, str, str]] = []  # (stage or len(stages) past the encoder, position, clean, raw)
        for position, (raw, p) in enumerate(self.named_parameters()):
            p.requires_grad_(True)
            if not raw.startswith("backbone."):
                named.append((len(self.stages), position, raw, raw))
                continue
            inner = raw[len("backbone.") :]
            stage = next((s for path, s in stage_of.items() if inner.startswith(path + ".")), None)
            if stage is None:
                raise ModelError(f"encoder parameter {inner!r} belongs to no stage of {self.encoder_name!r}")
            clean = f"{STAGE_PREFIX}{stage}.{inner.replace('.', _IN_STAGE_SEPARATOR)}"
            named.append((stage, position, clean, raw))
        named.sort()  # stage order = depth order (smp registers them so already); decoder and head after
        self._trainable_raw = OrderedDict((clean, raw) for _, _, clean, raw in named)
        self.trains_backbone = True  # BatchNorm in train mode during training; its statistics travel
        self._statistics_raw = OrderedDict(
            (STATISTICS_PREFIX + raw, raw) for raw, _ in self.named_buffers() if arrays.is_running_statistic(raw)
        )

    def stage_names(self, stage: int) -> list[str]:
        """Exchanged names of encoder stage ``stage``'s parameters (what ``lat-layers=stage+1`` adds)."""
        prefix = f"{STAGE_PREFIX}{stage}."
        return [n for n in self._trainable_raw if n.startswith(prefix)]

    def _check_input(self, x: torch.Tensor) -> None:
        h, w = x.shape[-2:]
        if h % OUTPUT_STRIDE or w % OUTPUT_STRIDE:
            raise ModelError(
                f"input {h}x{w} is not divisible by {OUTPUT_STRIDE}: backbone {self.spec.backbone!r} downsamples 5 "
                f"times (img_size must be a multiple of {OUTPUT_STRIDE})"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self.head(self.decoder(self.backbone(x)))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled deepest encoder features ``[B, C]``."""
        self._check_input(x)
        return self.backbone(x)[-1].mean(dim=(2, 3))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, pooled deepest encoder features) from one encoder pass."""
        self._check_input(x)
        feats = self.backbone(x)
        return self.head(self.decoder(feats)), feats[-1].mean(dim=(2, 3))


def build_unet(spec: ModelSpec, num_classes: int) -> UNetSegmenter:
    """smp ``Unet`` for ``spec.backbone`` with ``num_classes`` sigmoid channels, random init seeded by ``spec.seed``."""
    check_num_classes(num_classes)
    if not is_unet(spec.backbone):
        raise ModelError(f"{spec.backbone!r} is not a U-Net baseline; choose one of {list(UNET_BACKBONES)}")
    check_unet_spec(spec)
    import segmentation_models_pytorch as smp  # imported on first build: it takes seconds

    encoder = UNET_ENCODERS[spec.backbone]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        net = smp.Unet(encoder_name=encoder, encoder_weights=None, in_channels=3, classes=num_classes, activation=None)
    return UNetSegmenter(net.encoder, net.decoder, net.segmentation_head, spec, encoder)
