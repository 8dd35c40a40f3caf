"""Backbone checkpoint files in the layouts the papers' backbones are distributed in, mapped onto timm backbones.

``backbone-weights=<file>`` reads a ``.safetensors`` or torch (``.pth``/``.pt``/``.bin``) file, or finds the file in
a Hugging Face hub cache folder copied from another machine. The layout (``FORMATS``) is detected from the file's
keys, in this order:

1. ``dino``: a dict with a ``teacher`` state dict (a DINO training checkpoint). The teacher is taken (a leading
   ``module.`` stripped), its ``backbone.*`` keys kept and its projection head dropped.
2. The state dict is unwrapped from ``state_dict`` / ``model`` entries, then a ``module.`` prefix every key has is
   stripped, then ``backbone.`` (every key has it, or every other key is a ``head.*``/``decoder.*`` one).
3. ``sam``: keys ``image_encoder.*`` (original SAM / MedSAM). ``prompt_encoder.*`` and ``mask_decoder.*`` are
   dropped, timm's ``samvit`` filter renames the rest, and the position embedding, the relative-position tables and
   the patch embedding are resized to the backbone's input and patch size. Needs a ``samvit_*`` backbone.
4. ``mae``: keys ``decoder_*`` (MAE / RETFound pretraining): ``decoder_*`` and ``mask_token`` are dropped.
5. ``timm``: anything else, read with timm's key names. DINO's backbone-only ViT files
   (``dino_vitbase16_pretrain.pth``) and torchvision ResNet files (``resnet50-0676ba61.pth``) use the same names.

Then, for every format, classifier keys the headless backbone lacks (``_HEADS`` and the pretrained config's
``classifier``) are dropped and timm's ``checkpoint_filter_fn`` for the architecture resamples position and patch
embeddings. The result must fit the backbone (``TOLERATED``): no shape mismatch, and no backbone tensor missing from
the file or file tensor the backbone lacks except position embeddings, class/register tokens, relative-position tables
and the final norm (loaded with a warning naming them); BatchNorm's ``num_batches_tracked`` counters may be missing
(old torchvision files). Anything else is one ``ModelError`` naming the file, the format assumed, the first missing,
unexpected and mis-shaped keys and their counts.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ModelError

logger = logging.getLogger(__name__)

WEIGHT_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm's hub repos hold, in timm's order

FORMATS: dict[str, str] = {
    "timm": "timm state dict (timm's key names; DINO backbone files and torchvision ResNets use the same)",
    "sam": "SAM/MedSAM checkpoint (image_encoder.* mapped by timm's samvit filter; prompt_encoder.*, mask_decoder.* "
    "dropped)",
    "mae": "MAE/RETFound checkpoint (the ViT encoder; decoder_*, mask_token dropped)",
    "dino": "DINO training checkpoint (the teacher's backbone.*; its projection head and the student dropped)",
}

# Keys that may differ between a checkpoint and the backbone without an error (a warning names them): position
# embeddings, prefix tokens, SAM's relative-position tables and the final norm, which variants of one architecture
# add, drop or replace (fc_norm for norm under average pooling, no class token, registers, ...).
TOLERATED = re.compile(r"^(pos_embed|cls_token|reg_token|dist_token|(fc_)?norm\.(weight|bias))$|\.rel_pos_[hw]$")
_HEADS = ("head", "fc", "fc_norm", "head_dist")  # classifier (and pre-classifier norm) module names
_IGNORED = re.compile(r"(^|\.)num_batches_tracked$")  # BatchNorm step counters: unused with a momentum
_SHOWN = 5  # keys listed per kind in a message
# Harmless Python objects training scripts store next to the weights (MAE's and DINO's ``args``).
_SAFE_GLOBALS = [argparse.Namespace, pathlib.PosixPath]


@dataclass(frozen=True)
class Checkpoint:
    """The backbone tensors of a weights file, unwrapped (SAM's keep their ``image_encoder.`` names until
    ``map_to_backbone``), and how they were found."""

    file: Path
    format: str  # a key of FORMATS
    state: dict[str, torch.Tensor]
    dropped: tuple[str, ...] = ()  # file keys the format leaves out (decoders, prompt encoders, heads)
    notes: tuple[str, ...] = ()  # wrappers and prefixes taken off
    folder: Path | None = None  # the Hugging Face cache folder the file was found in

    def describe(self) -> str:
        """``'<file>' (format <id>: <what it is>[; notes])`` for messages."""
        where = f" found in Hugging Face cache folder {str(self.folder)!r}" if self.folder else ""
        notes = "".join(f"; {n}" for n in self.notes)
        return f"{str(self.file)!r}{where} (format {self.format}: {FORMATS[self.format]}{notes})"


# --------------------------------------------------------------------------------------------------- reading


def read_checkpoint(path: str | Path, *, folder: Path | None = None) -> Checkpoint:
    """Read a weights file and detect its layout (see the module docstring); raises ModelError if it has none."""
    path = Path(path)
    fmt, state, dropped, notes = detect_format(_read(path), path)
    return Checkpoint(path, fmt, state, tuple(dropped), tuple(notes), folder)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A file's state dict as it is (unwrapped from ``state_dict``/``model``, a common ``module.`` prefix stripped),
    read without running pickled code; ModelError when it holds none."""
    path = Path(path)
    obj = _read(path)
    notes: list[str] = []
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
    return _strip_common(_tensors(obj, path), "module.", notes)


def _read(path: Path) -> Any:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - an old (non-zip) torch file: no listing
            unsafe = []
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelError(
            f"weights file {str(path)!r} holds Python objects torch does not load without running their code "
            f"({', '.join(unsafe[:4]) or first}); if you trust the file, re-save its tensors with "
            f"torch.save(torch.load(file, weights_only=False)['model'], 'weights.pth') (or the entry that holds "
            f"them) and pass that file"
        ) from e
    except Exception as e:  # noqa: BLE001 - report any unreadable file uniformly
        raise ModelError(f"cannot read weights file {str(path)!r}: {type(e).__name__}: {e}") from e


def detect_format(obj: Any, path: Path) -> tuple[str, dict[str, torch.Tensor], list[str], list[str]]:
    """``(format, state, dropped keys, notes)`` of a loaded checkpoint object, from its keys."""
    notes: list[str] = []
    if isinstance(obj, Mapping) and isinstance(obj.get("teacher"), Mapping):
        teacher = _strip_common(_tensors(obj["teacher"], path, "teacher"), "module.", notes)
        backbone = {k[len("backbone.") :]: v for k, v in teacher.items() if k.startswith("backbone.")}
        if backbone:
            notes.insert(0, "the 'teacher' entry")
            return "dino", backbone, [k for k in teacher if not k.startswith("backbone.")], notes
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
            notes.append(f"the {wrapper!r} entry")
    state = _strip_common(_tensors(obj, path), "module.", notes)
    state, dropped = _take_backbone(state, notes)
    if any(k.startswith("image_encoder.") for k in state):
        keep = {k: v for k, v in state.items() if k.startswith("image_encoder.")}
        return "sam", keep, dropped + [k for k in state if k not in keep], notes
    if any(k.startswith("decoder_") for k in state):
        drop = [k for k in state if k.startswith("decoder_") or k == "mask_token"]
        return "mae", {k: v for k, v in state.items() if k not in drop}, dropped + drop, notes
    return "timm", state, dropped, notes


def _tensors(obj: Any, path: Path, entry: str = "") -> dict[str, torch.Tensor]:
    where = f" entry {entry!r}" if entry else ""
    if not isinstance(obj, Mapping) or not obj:
        raise ModelError(f"weights file {str(path)!r}{where} does not contain a state dict of tensors")
    other = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if other:
        raise ModelError(
            f"weights file {str(path)!r}{where} does not contain a state dict of tensors (entries that are not "
            f"tensors: {other[:_SHOWN]}; a state dict is expected at the top level or under 'state_dict', 'model' "
            f"or 'teacher')"
        )
    return {str(k): v for k, v in obj.items()}


def _strip_common(state: dict[str, torch.Tensor], prefix: str, notes: list[str]) -> dict[str, torch.Tensor]:
    if all(k.startswith(prefix) for k in state):
        notes.append(f"prefix {prefix!r} stripped")
        return {k[len(prefix) :]: v for k, v in state.items()}
    return state


def _take_backbone(state: dict[str, torch.Tensor], notes: list[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The ``backbone.*`` part of a whole-model checkpoint (e.g. an AdaptedClassifier's or DINO's)."""
    inside = [k for k in state if k.startswith("backbone.")]
    if not inside:
        return state, []
    outside = [k for k in state if not k.startswith("backbone.")]
    if outside and not all(k.startswith(("head.", "decoder.")) for k in outside):
        return state, []
    notes.append("prefix 'backbone.' stripped" + (" and its head/decoder dropped" if outside else ""))
    return {k[len("backbone.") :]: state[k] for k in inside}, outside


# ------------------------------------------------------------------------------------------ Hugging Face folders


def find_weights_in_folder(folder: str | Path, hf_hub_id: str | None = None, filename: str | None = None) -> Path:
    """The weights file in a Hugging Face hub cache folder copied from another machine.

    ``folder`` is a hub cache root (holding ``models--<org>--<name>/``; or ``HF_HOME`` holding ``hub/``), one repo
    folder (holding ``snapshots/``) or one snapshot folder (holding ``model.safetensors``). In a cache root the repo
    ``hf_hub_id`` names (timm's ``pretrained_cfg.hf_hub_id`` of the backbone) is taken, else the only repo of the
    same architecture; in a repo the snapshot ``refs/main`` names, else the newest with a weights file.
    """
    folder = Path(folder).expanduser()
    root = folder / "hub" if not _repos(folder) and _repos(folder / "hub") else folder
    if (root / "snapshots").is_dir():
        return _file_in_repo(root, filename)
    repos = _repos(root)
    if repos:
        return _file_in_repo(_pick_repo(root, repos, hf_hub_id), filename)
    return _file_in_snapshot(root, filename)


def weights_folder_problem(folder: str | Path) -> str | None:
    """Why ``folder`` holds no weights file in a Hugging Face hub cache layout, or None when it holds one."""
    folder = Path(folder).expanduser()
    root = folder / "hub" if not _repos(folder) and _repos(folder / "hub") else folder
    repos = [root] if (root / "snapshots").is_dir() else _repos(root)
    snapshots = [s for r in repos for s in _snapshots(r)] if repos else [root]
    if any(_snapshot_file(s) for s in snapshots):
        return None
    return (
        f"folder {str(folder)!r} holds no weights file in a Hugging Face hub cache layout (a cache root with "
        f"models--<org>--<name>/snapshots/<hash>/model.safetensors, one such repo folder or one snapshot folder)"
        + _broken_links_hint(snapshots)
    )


def _repos(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("models--*") if p.is_dir()) if folder.is_dir() else []


def _snapshots(repo: Path) -> list[Path]:
    snapshots = repo / "snapshots"
    return sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_FILE_SUFFIXES and p.is_file())


def _snapshot_file(snapshot: Path, filename: str | None = None) -> Path | None:
    """The snapshot's weights file: ``filename``, else timm's hub file names, else its only weights file."""
    if not snapshot.is_dir():
        return None
    for name in ([filename] if filename else []) + list(HF_WEIGHT_FILES):
        if (snapshot / name).is_file():
            return snapshot / name
    files = _weight_files(snapshot)
    return files[0] if len(files) == 1 else None


def _broken_links_hint(folders: list[Path]) -> str:
    broken = [p for f in folders if f.is_dir() for p in f.iterdir() if p.is_symlink() and not p.exists()]
    if not broken:
        return ""
    return (
        f"; {str(broken[0])!r} is a link whose target is missing: copy the cache with its blobs/ folder, "
        f"or with cp -rL so the links become files"
    )


def _pick_repo(root: Path, repos: list[Path], hf_hub_id: str | None) -> Path:
    names = [r.name for r in repos]
    if not hf_hub_id:
        if len(repos) == 1:
            return repos[0]
        raise ModelError(
            f"Hugging Face cache folder {str(root)!r} holds {len(repos)} repos ({names[:_SHOWN]}) and the backbone "
            f"names no hub repo; pass the folder of the repo to load"
        )
    want = "models--" + hf_hub_id.replace("/", "--")
    if want in names:
        return root / want
    org, _, name = hf_hub_id.partition("/")
    arch = name.split(".", 1)[0]
    same = [r for r in repos if r.name == f"models--{org}--{arch}" or r.name.startswith(f"models--{org}--{arch}.")]
    if len(same) == 1:
        logger.warning(
            "Hugging Face cache folder %s has no %s; using %s (the same architecture, another pretrained tag)",
            root,
            want,
            same[0].name,
        )
        return same[0]
    if same:
        raise ModelError(
            f"Hugging Face cache folder {str(root)!r} has no {want} but {len(same)} repos of architecture "
            f"{arch!r} ({[r.name for r in same][:_SHOWN]}); name the tag in the backbone (e.g. "
            f"'{same[0].name.split('--', 2)[-1]}') or pass the repo's folder"
        )
    raise ModelError(
        f"Hugging Face cache folder {str(root)!r} has no repo for the backbone (looked for {want}); it holds "
        f"{len(repos)} repo(s): {names[:_SHOWN]}"
    )


def _file_in_repo(repo: Path, filename: str | None) -> Path:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if _snapshot_file(snapshot, filename):
            return _file_in_snapshot(snapshot, filename)
    snapshots = [s for s in _snapshots(repo) if _snapshot_file(s, filename)]
    if not snapshots:
        raise ModelError(
            f"Hugging Face repo folder {str(repo)!r} has no snapshot holding a weights file "
            f"({', '.join(HF_WEIGHT_FILES)})" + _broken_links_hint(_snapshots(repo))
        )
    snapshots.sort(key=lambda s: s.stat().st_mtime, reverse=True)
    if len(snapshots) > 1:
        logger.info("Hugging Face repo folder %s: using the newest snapshot %s", repo, snapshots[0].name)
    return _file_in_snapshot(snapshots[0], filename)


def _file_in_snapshot(snapshot: Path, filename: str | None) -> Path:
    found = _snapshot_file(snapshot, filename)
    if found:
        return found
    files = _weight_files(snapshot) if snapshot.is_dir() else []
    if files:
        raise ModelError(
            f"folder {str(snapshot)!r} holds {len(files)} weights files ({[f.name for f in files][:_SHOWN]}) and "
            f"none of {list(HF_WEIGHT_FILES)}; pass the file to load"
        )
    raise ModelError(
        f"folder {str(snapshot)!r} holds no weights file ({', '.join(HF_WEIGHT_FILES)}, or one "
        f"{'/'.join(WEIGHT_FILE_SUFFIXES)} file)" + _broken_links_hint([snapshot] if snapshot.is_dir() else [])
    )


# ------------------------------------------------------------------------------------------------------ loading


def load_checkpoint(model: nn.Module, path: str | Path) -> Checkpoint:
    """Load a weights file (or the file in a Hugging Face cache folder) into a headless timm backbone.

    Detects the layout, maps it to the backbone's names and sizes, checks the fit (module docstring) and loads it.
    Raises ModelError when the file does not fit; returns the Checkpoint read.
    """
    path = Path(path).expanduser()
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if path.is_dir():
        file = find_weights_in_folder(path, cfg.get("hf_hub_id"), cfg.get("hf_hub_filename"))
        checkpoint = read_checkpoint(file, folder=path)
    else:
        checkpoint = read_checkpoint(path)
    state = map_to_backbone(checkpoint, model)
    matched = check_fit(checkpoint, state, model)
    model.load_state_dict(matched, strict=False)
    logger.info(
        "backbone %s: loaded %d tensors from %s; %d file keys dropped by the format%s",
        backbone_name(model),
        len(matched),
        checkpoint.describe(),
        len(checkpoint.dropped),
        _first(list(checkpoint.dropped)),
    )
    return checkpoint


def backbone_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return cfg.get("architecture") or type(model).__name__


def _is_sam(model: nn.Module) -> bool:
    return type(model).__module__.rsplit(".", 1)[-1] == "vision_transformer_sam"


def map_to_backbone(checkpoint: Checkpoint, model: nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the backbone's names and at its sizes (classifier keys dropped)."""
    if checkpoint.format == "sam" and not _is_sam(model):
        raise ModelError(
            f"weights file {checkpoint.describe()} holds a SAM image encoder; backbone {backbone_name(model)!r} is "
            f"not one: use a samvit_* backbone (samvit_base_patch16 for sam_vit_b and medsam_vit_b files)"
        )
    expected = model.state_dict()
    classifiers = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ("head", "fc")
    classifiers = ((classifiers,) if isinstance(classifiers, str) else tuple(classifiers)) + _HEADS
    state = {
        k: v
        for k, v in checkpoint.state.items()
        if k in expected or not any(k == c or k.startswith(c + ".") for c in classifiers)
    }
    state = timm_checkpoint_filter(model, state)
    if _is_sam(model):
        state = _resize_sam(state, expected)
    return state


def timm_checkpoint_filter(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply the architecture's timm ``checkpoint_filter_fn`` (resampling/renaming) if it has one."""
    filter_fn: Callable | None = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is None:
        return state
    try:
        return filter_fn(dict(state), model)
    except Exception as e:  # noqa: BLE001 - a filter that cannot handle this file: load it unfiltered
        logger.warning(
            "timm checkpoint filter for %s failed (%s); loading the file unfiltered", type(model).__name__, e
        )
        return state


def _resize_sam(state: dict[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SAM's NHWC position embedding, relative-position tables and patch embedding at the backbone's sizes."""
    from timm.layers import resample_abs_pos_embed_nhwc, resample_patch_embed

    out = dict(state)
    for k, v in state.items():
        want = expected.get(k)
        if want is None or v.shape == want.shape or v.ndim != want.ndim:
            continue
        if k == "pos_embed" and v.ndim == 4 and v.shape[-1] == want.shape[-1]:
            out[k] = resample_abs_pos_embed_nhwc(v.float(), list(want.shape[1:3])).to(v.dtype)
        elif k.endswith((".rel_pos_h", ".rel_pos_w")) and v.ndim == 2 and v.shape[1] == want.shape[1]:
            # as SAM's get_rel_pos interpolates a table of another length: linearly along the distance axis
            resized = F.interpolate(v.float().T[None], size=want.shape[0], mode="linear")
            out[k] = resized[0].T.contiguous().to(v.dtype)
        elif k == "patch_embed.proj.weight" and v.shape[:2] == want.shape[:2]:
            out[k] = resample_patch_embed(v.float(), list(want.shape[2:])).to(v.dtype)
        else:
            continue
        logger.info("SAM weights: %s resized from %s to %s", k, tuple(v.shape), tuple(want.shape))
    return out


def check_fit(checkpoint: Checkpoint, state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors to load; ModelError unless the file fits the backbone (module docstring)."""
    expected = model.state_dict()
    matched = {k: v for k, v in state.items() if k in expected}
    name = backbone_name(model)
    if not matched:
        raise ModelError(
            f"no key of weights file {checkpoint.describe()} matches backbone {name!r} "
            f"(file keys e.g. {sorted(state)[:4]}, backbone keys e.g. {list(expected)[:4]})"
        )
    shapes = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in matched.items() if v.shape != expected[k].shape]
    missing = [k for k in expected if k not in state and not _IGNORED.search(k)]
    unexpected = [k for k in state if k not in expected]
    if shapes or any(not TOLERATED.search(k) for k in missing + unexpected):
        parts = [
            f"{len(missing)} of {len(expected)} backbone tensors missing from the file{_first(missing)}",
            f"{len(unexpected)} file tensors the backbone lacks{_first(unexpected)}",
            f"{len(shapes)} with the wrong shape"
            + (": " + ", ".join(f"{k}: file {a} vs backbone {b}" for k, a, b in shapes[:_SHOWN]) if shapes else ""),
        ]
        raise ModelError(
            f"weights file {checkpoint.describe()} does not fit backbone {name!r}: {'; '.join(parts)}. Only "
            f"position embeddings, class/register tokens, relative-position tables and the final norm may differ; "
            f"check that the backbone is the checkpoint's architecture"
        )
    if missing or unexpected:
        logger.warning(
            "weights file %s: %d backbone tensor(s) not in the file keep their random init%s; %d file tensor(s) "
            "the backbone lacks are ignored%s",
            checkpoint.describe(),
            len(missing),
            _first(missing),
            len(unexpected),
            _first(unexpected),
        )
    return matched


def _first(keys: list[str]) -> str:
    if not keys:
        return ""
    more = f", ... ({len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return f" ({', '.join(keys[:_SHOWN])}{more})"
