"""AdaptedSegmenter: a timm ViT/Swin/SAM encoder with adapters plus a light decoder that upsamples to the mask.

Only the adapters and the decoder train. The decoder is hand-written (timm has encoders, not
decoders): a 1x1 projection of the patch grid, then ``log2(patch)`` stages of (bilinear x2, 3x3 conv,
GroupNorm, GELU), then a 1x1 conv to one logit per foreground class. GroupNorm rather than BatchNorm,
so the decoder has no running statistics outside its exchanged parameters.

SAM encoders (family ``samvit``: timm's ``samvit_*``, aliases ``sam-b``/``sam-l``/``sam-h``/``medsam``) feed the
decoder from their neck: ``forward_features`` ends with SAM's frozen neck (1x1 conv to 256 channels, LayerNorm2d,
3x3 conv, LayerNorm2d), whose 256-channel grid at 1/16 is the image embedding SAM's own mask decoder reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import medflower.models.litemedsam as litemedsam

from .adapted import AdaptedModel, build_backbone_with_adapter, check_num_classes
from .backbones import backbone_family, resolve_backbone
from .errors import ModelError
from .spec import ModelSpec

_DECODER_SEED_OFFSET = 3_000_009
DECODER_WIDTH = 64
_GROUPS = 8


class LightDecoder(nn.Module):
    """Feature grid ``[B, D, h, w]`` -> mask logits ``[B, K, H, W]`` (K foreground classes)."""

    def __init__(self, in_dim: int, num_classes: int, upsample_stages: int, width: int = DECODER_WIDTH):
        super().__init__()
        self.proj = nn.Conv2d(in_dim, width, kernel_size=1)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, kernel_size=3, padding=1), nn.GroupNorm(_GROUPS, width), nn.GELU())
            for _ in range(upsample_stages)
        )
        self.out = nn.Conv2d(width, num_classes, kernel_size=1)

    def forward(self, grid: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        x = self.proj(grid)
        for stage in self.stages:
            x = stage(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False))
        if tuple(x.shape[-2:]) != tuple(size):
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        return self.out(x)


class AdaptedSegmenter(AdaptedModel):
    """``decoder(grid(backbone.forward_features(x)))``: per-pixel logits, one channel per foreground class."""

    task = "segmentation"
    task_module = "decoder"

    def __init__(
        self,
        backbone: nn.Module,
        decoder: LightDecoder,
        family: str,
        adapter_param_names: Iterable[str] = (),
        spec: ModelSpec | None = None,
        weights_source: str = "random",
    ):
        super().__init__(backbone, adapter_param_names, spec, weights_source)
        self.decoder = decoder
        self.family = family
        self.num_classes = decoder.out.out_channels
        self._freeze_all_but_trainable(adapter_param_names)

    def feature_grid(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder features as a spatial grid ``[B, D, h, w]`` (SAM: its neck's output, already NCHW)."""
        tokens = self.backbone.forward_features(self.input_norm(x))
        if self.family == "samvit":
            return tokens
        if self.family == "swin":  # timm Swin returns NHWC
            return tokens.permute(0, 3, 1, 2)
        tokens = tokens[:, getattr(self.backbone, "num_prefix_tokens", 0) :]
        h, w = self.backbone.patch_embed.grid_size
        return tokens.transpose(1, 2).reshape(x.shape[0], -1, h, w)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature_grid(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder_output(x), self.image_size(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled encoder features ``[B, D]`` (mean over the grid)."""
        return self.encoder_output(x).mean(dim=(2, 3))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, pooled features) from one encoder pass."""
        grid = self.encoder_output(x)
        return self.decoder(grid, self.image_size(x)), grid.mean(dim=(2, 3))


def build_segmenter(spec: ModelSpec, num_classes: int) -> AdaptedSegmenter:
    """Encoder with adapters + LightDecoder to ``num_classes`` foreground channels; deterministic for a spec."""
    check_num_classes(num_classes)
    family = backbone_family(resolve_backbone(spec.backbone))
    if family == "tinyvit":
        return build_prompted_segmenter(spec, num_classes)
    if family not in ("vit", "swin", "samvit"):
        kind = "a ResNet" if family == "resnet" else "none of these"
        raise ModelError(
            f"segmentation needs a ViT or Swin encoder, SAM's image encoder (sam-b, sam-l, sam-h, medsam) or "
            f"LiteMedSAM (litemedsam); "
            f"{spec.backbone!r} is {kind}"
        )
    with torch.random.fork_rng(devices=[]):
        backbone, adapter_param_names, weights_source, feature_dim = build_backbone_with_adapter(spec)
        reduction = spec.img_size // _grid_side(backbone, family, spec.img_size)
        torch.manual_seed(spec.seed + _DECODER_SEED_OFFSET)
        decoder = LightDecoder(feature_dim, num_classes, upsample_stages=max(0, round(math.log2(max(reduction, 1)))))
    return AdaptedSegmenter(backbone, decoder, family, adapter_param_names, spec=spec, weights_source=weights_source)


class PromptedSegmenter(AdaptedModel):
    """LiteMedSAM as a segmenter: its encoder (with adapters) -> image embedding -> SAM's mask decoder prompted with the
    whole image's box or each structure's ground-truth box (``litemedsam.PromptedMaskHead``).

    Input ``x``: images ``[B, 3, S, S]`` (encoded mode: the image embedding ``[B, 256, S/4, S/4]``), and with box
    prompts K more channels, one box plane per structure (1 inside the structure's ground-truth box), appended by the
    loader (``data/transforms.py``). Boxes are read back on the embedding grid (a cell is in when any of its pixels
    is), so the full forward and the encoded mode see the same boxes, whole cells of 4 px.
    """

    task = "segmentation"
    task_module = "decoder"

    def __init__(
        self,
        backbone: nn.Module,
        decoder: nn.Module,
        prompt_encoder: nn.Module,
        adapter_param_names: Iterable[str] = (),
        spec: ModelSpec | None = None,
        weights_source: str = "random",
    ):
        super().__init__(backbone, adapter_param_names, spec, weights_source)
        self.decoder = decoder
        self.prompt_encoder = prompt_encoder  # frozen, not exchanged
        self.family = "tinyvit"
        self.num_classes = decoder.num_classes
        self.embed_channels = 256
        self._freeze_all_but_trainable(adapter_param_names, decoder.frozen_names())

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(images or embeddings, box planes or None) of an input batch."""
        first = self.embed_channels if self.encoded_inputs else 3
        if self.decoder.prompt != "box":
            return x[:, :first] if x.shape[1] != first else x, None
        if x.shape[1] != first + self.num_classes:
            raise ModelError(
                f"sam-prompt='box': expected {first} input channels and {self.num_classes} box planes, got "
                f"{x.shape[1]} channels (the loader appends the planes from the ground-truth masks)"
            )
        return x[:, :first], x[:, first:]

    def shared_tables(self) -> list[str]:
        """Trainable parameters read whole for every image (``litemedsam.PromptedMaskHead.shared_tables``)."""
        return [f"decoder.{name}" for name in self.decoder.shared_tables()]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The image embedding of images ``x`` (box planes after the 3 image channels are ignored)."""
        return self.backbone.forward_features(self.input_norm(x[:, :3]))

    def encoder_output(self, x: torch.Tensor) -> torch.Tensor:
        inputs = self._split(x)[0]
        return inputs if self.encoded_inputs else self.backbone.forward_features(self.input_norm(inputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(self.encoder_output(x), x)

    def _logits(self, embedding: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The mask decoder's logits for ``embedding``, with the boxes of ``x``'s box planes in box mode."""
        _, planes = self._split(x)
        boxes = None
        if planes is not None:
            side = embedding.shape[-1]
            boxes = litemedsam.boxes_from_planes(
                litemedsam.cell_planes(planes, side), self.decoder.img_size // side
            ).to(embedding.dtype)
        return self.decoder(embedding, self.prompt_encoder, boxes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder_output(x).mean(dim=(2, 3))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, pooled features) from one encoder pass."""
        embedding = self.encoder_output(x)
        return self._logits(embedding, x), embedding.mean(dim=(2, 3))


def build_prompted_segmenter(spec: ModelSpec, num_classes: int) -> PromptedSegmenter:
    """LiteMedSAM's encoder with the spec's adapter, SAM's prompt encoder and mask decoder from the same weights."""
    with torch.random.fork_rng(devices=[]):
        backbone, adapter_param_names, weights_source, _ = build_backbone_with_adapter(spec)
        prompt_encoder, mask_decoder = litemedsam.create_prompt_decoder(
            spec.img_size, spec.weights, spec.seed + _DECODER_SEED_OFFSET
        )
    head = litemedsam.PromptedMaskHead(mask_decoder, num_classes, spec.sam_prompt, spec.img_size)
    for p in prompt_encoder.parameters():
        p.requires_grad_(False)
    return PromptedSegmenter(
        backbone, head, prompt_encoder, adapter_param_names, spec=spec, weights_source=weights_source
    )


def _grid_side(backbone: nn.Module, family: str, img_size: int) -> int:
    if family != "swin":  # ViT and SAM (its neck keeps the patch grid): the patch grid, no forward pass
        return int(backbone.patch_embed.grid_size[0])
    with torch.no_grad():
        was_training = backbone.training
        backbone.eval()
        out = backbone.forward_features(torch.zeros(1, 3, img_size, img_size))
        backbone.train(was_training)
    return int(out.shape[1])
