"""timm backbones (headless, pooled features) and their weights: random, cached pretrained, or a local file."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import timm
import torch
from torch import nn

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
}

WEIGHT_MODES = ("none", "auto")  # or a path to a local .safetensors/.pth/.pt/.bin file
WEIGHT_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")

# Backbone families, keyed by the timm module that registers the architecture.
_FAMILY_BY_TIMM_MODULE = {
    "vision_transformer": "vit",
    "deit": "vit",
    "swin_transformer": "swin",
    "resnet": "resnet",
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
    """``vit`` | ``swin`` | ``resnet`` | ``other``, from the timm module that defines the architecture."""
    module = timm.models.model_entrypoint(timm_name).__module__.rsplit(".", 1)[-1]
    return _FAMILY_BY_TIMM_MODULE.get(module, "other")


def create_backbone(
    timm_name: str, *, img_size: int, patch_size: int, weights: str, seed: int
) -> tuple[nn.Module, str]:
    """Build a headless timm model (``num_classes=0``) and load its weights.

    Returns ``(model, weights_source)`` where ``weights_source`` is ``"random"``, ``"pretrained:<file>"`` or
    ``"file:<path>"``. Random init is seeded with ``seed`` (global torch RNG; callers fork it).
    """
    family = backbone_family(timm_name)
    kwargs = _timm_kwargs(timm_name, family, img_size, patch_size)

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
    return model, source


def _timm_kwargs(timm_name: str, family: str, img_size: int, patch_size: int) -> dict[str, Any]:
    """Keyword arguments for timm.create_model for this family."""
    if patch_size > 0 and family != "vit":
        raise ModelError(
            f"patch_size={patch_size} applies to ViTs only (backbone {timm_name!r} is a {family} "
            f"model); use patch_size=0"
        )
    kwargs: dict[str, Any] = {"num_classes": 0}
    if family in ("vit", "swin", "other"):  # resnets are size-agnostic and take no img_size
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
    """ViT/Swin inputs must tile into whole patches (timm would silently crop the remainder)."""
    if family not in ("vit", "swin"):
        return
    patch = model.patch_embed.patch_size
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    if img_size % patch:
        raise ModelError(
            f"img_size={img_size} is not a multiple of the patch size {patch} of {timm_name!r}; "
            f"pick img_size divisible by {patch}"
        )


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


def _warn_random(timm_name: str, seed: int, reason: str) -> None:
    msg = (
        f"weights='auto' for backbone {timm_name!r}: {reason}. USING RANDOM INITIALISATION (seed {seed}) - "
        f"results will be far below pretrained quality. To use pretrained weights offline, pass "
        f"weights='/path/to/{timm_name}.safetensors' (a timm state dict, e.g. saved with "
        f"safetensors.torch.save_file(timm.create_model({timm_name!r}, pretrained=True).state_dict(), ...) "
        f"on a machine with internet), or copy a populated HF hub cache to this machine."
    )
    logger.warning(msg)
    warnings.warn(msg, PretrainedWeightsWarning, stacklevel=4)


# ------------------------------------------------------------------------------------------------ file weights


def _check_weights_path(weights: str) -> Path:
    path = Path(weights).expanduser()
    if not path.is_file():
        raise ModelError(
            f"weights file not found: {str(path)!r}; weights must be one of {list(WEIGHT_MODES)} "
            f"or a path to an existing {'/'.join(WEIGHT_FILE_SUFFIXES)} file"
        )
    if path.suffix not in WEIGHT_FILE_SUFFIXES:
        raise ModelError(
            f"weights file {str(path)!r} has unsupported suffix {path.suffix!r}; "
            f"use one of {list(WEIGHT_FILE_SUFFIXES)}"
        )
    return path


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict from .safetensors or a torch file, unwrapping ``{"state_dict": ...}``/``{"model": ...}``."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - report any unreadable file uniformly
        raise ModelError(f"cannot read weights file {str(path)!r}: {type(e).__name__}: {e}") from e
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"weights file {str(path)!r} does not contain a state dict of tensors")
    for prefix in ("module.", "backbone."):  # DDP / AdaptedClassifier checkpoints
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def load_weights_file(model: nn.Module, path: str | os.PathLike) -> None:
    """Load backbone weights from a local file into a headless timm model (classifier keys dropped).

    timm's own checkpoint filter for the architecture (if any) is applied first, so checkpoints at another
    resolution/patch size get their position/patch embeddings resampled. Raises ModelError when no backbone
    key matches or shapes disagree.
    """
    state = read_state_dict(path)
    classifiers = (getattr(model, "pretrained_cfg", {}) or {}).get("classifier") or ("head", "fc")
    classifiers = (classifiers,) if isinstance(classifiers, str) else tuple(classifiers)
    state = {k: v for k, v in state.items() if not any(k == c or k.startswith(c + ".") for c in classifiers)}
    state = _timm_checkpoint_filter(model, state)

    expected = model.state_dict()
    matched = {k: v for k, v in state.items() if k in expected}
    if not matched:
        raise ModelError(
            f"no key of weights file {str(path)!r} matches the backbone "
            f"(file keys e.g. {sorted(state)[:4]}, backbone keys e.g. {list(expected)[:4]})"
        )
    mismatched = [
        (k, tuple(v.shape), tuple(expected[k].shape)) for k, v in matched.items() if v.shape != expected[k].shape
    ]
    if mismatched:
        shown = ", ".join(f"{k}: file {a} vs model {b}" for k, a, b in mismatched[:4])
        raise ModelError(
            f"weights file {str(path)!r} has {len(mismatched)} tensor(s) with the wrong shape "
            f"for the backbone ({shown})"
        )
    model.load_state_dict(matched, strict=False)
    missing = [k for k in expected if k not in matched]
    if missing:
        logger.warning(
            "weights file %s: %d backbone tensor(s) not in the file keep their random init, e.g. %s",
            path,
            len(missing),
            missing[:4],
        )


def _timm_checkpoint_filter(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply the architecture's timm ``checkpoint_filter_fn`` (resampling/renaming) if it has one."""
    filter_fn: Callable | None = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is None:
        return state
    try:
        return filter_fn(state, model)
    except Exception as e:  # noqa: BLE001 - a filter that cannot handle this file: load it unfiltered
        logger.warning(
            "timm checkpoint filter for %s failed (%s); loading the file unfiltered", type(model).__name__, e
        )
        return state
