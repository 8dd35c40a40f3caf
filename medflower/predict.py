"""Apply a run's model to new images at a site: masks or class probabilities, and scores where ground truth is given.

    python -m medflower.predict --run outputs/fedavg-polyp --images /data/new-scans --out predictions/
    python -m medflower.predict --run outputs/fedsa-prostate --site site-1 --images cases/ --out out/ --device cuda

The model is the run's last good checkpoint, assembled for the site as the run's last evaluation assembled it
(``medflower/trained.py``): the global model, or with a personalised method the site's own (``--site``; its state
from the run folder, or ``--state-dir`` for a SuperNode's). Images go through the data layer exactly as in the run:
the same readers (PNG/JPEG/16-bit/TIFF, DICOM, NIfTI), the run's ``intensity`` and ``img-size``, the loaders' batch
transform; volumes are cut along the run's ``slice-axis`` with the intensity window over the whole volume.

``--images`` is one of:

- a folder of 2-D images (every image file in it; a subfolder of DICOM files is one series volume);
- a folder with ``images/`` (and optionally ground truth: ``masks/`` or ``masks-<structure>/`` as a segmentation
  folder has them, or ``masks/<case>.nii.gz`` label volumes as a volumes root has them);
- a CSV manifest with a ``path`` column (relative to the manifest's folder), optionally ``label`` (classification
  ground truth: class index or name) or ``mask`` (a segmentation mask file);
- one image or volume file.

Outputs in ``--out``: for segmentation one mask per image in the input's own geometry (``masks/<name>.png`` for 2-D
images, ``masks/<case>.nii.gz`` with the source's affine for volumes and 2-D NIfTI images; with overlapping
structures one ``masks-<structure>/`` folder each), for classification ``predictions.csv`` (one row per image, the
class probabilities); with ground truth ``scores.csv`` (per image) and ``scores.json`` (Dice, IoU, HD95 per structure;
AUC, balanced accuracy); always ``prediction.json`` (the model card and what was predicted). docs/predict.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from flwr.common.logger import log
from PIL import Image
from torch.utils.data import Dataset

from .config import ConfigError
from .data import DataError, make_loader
from .data.image_datasets import ArrayImageDataset, read_rgb
from .data.maskmap import parse_mask_values
from .data.readers import (
    NIFTI_EXTENSIONS,
    dicom_files,
    file_format,
    load_volume,
    nifti_2d,
    open_pil,
    opened_path,
    volume_intensity,
)
from .data.segfolder import (
    IMAGE_EXTENSIONS,
    MASKS,
    STRUCTURE_PREFIX,
    file_extension,
    file_stem,
    mask_classes,
    mask_folders,
    pair_site,
    read_masks,
    shown_values,
)
from .data.volumes import _resized, case_name, find_cases
from .models import ModelError
from .trained import RunError, Site, TrainedRun, add_run_arguments, with_site_model
from .training import DeviceError, autocast
from .training.metrics import SegmentationScores, classification_metrics, segmentation_scores

MASK_LAYOUTS = ("auto", "label", "planes")


class PredictError(ValueError):
    """Inputs that cannot be predicted (missing images, a volume for a classifier, unreadable ground truth)."""


@dataclass
class Item:
    """One input: a 2-D image file or a volume (file or DICOM series folder), named for its outputs."""

    path: Path
    name: str  # output file stem (image stem, volume case)
    volume: bool
    shown: str  # the path as the user gave it (CSV rows)
    label: int | None = None  # classification ground truth
    masks: Path | tuple[Path, ...] | None = None  # segmentation ground truth (mask file(s) or label volume)
    source_nifti: bool = False  # outputs as NIfTI with the source affine


@dataclass
class Inputs:
    items: list[Item]
    structure_folders: bool = False  # ground truth in masks-<structure>/ folders (one binary plane each)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- finding the inputs
def is_volume(path: Path) -> bool:
    """A DICOM series folder, a multi-frame DICOM file or a NIfTI file with more than one slice."""
    if path.is_dir():
        return True
    kind = file_format(path)
    if kind == "nifti":
        import nibabel as nib

        try:
            shape = nib.load(opened_path(path)).shape
        except Exception as err:  # nibabel raises several kinds for a file it cannot read
            raise PredictError(f"{path}: not a readable NIfTI file: {err}") from None
        return len([n for n in shape if n != 1]) > 2
    if kind == "dicom":
        import pydicom

        try:
            header = pydicom.dcmread(opened_path(path), stop_before_pixels=True, force=True)
        except Exception as err:  # pydicom raises several kinds for a file it cannot read
            raise PredictError(f"{path}: not a readable DICOM file: {err}") from None
        try:
            return int(header.get("NumberOfFrames") or 1) > 1
        except (TypeError, ValueError):
            return False
    return False


def _item(path: Path, shown: str, **fields: Any) -> Item:
    volume = is_volume(path)
    name = (case_name(path) if volume else None) or file_stem(path)
    return Item(path, name, volume, shown, source_nifti=file_extension(path) in NIFTI_EXTENSIONS, **fields)


def _folder_entries(folder: Path) -> list[Path]:
    """Image files directly in ``folder`` and its subfolders of DICOM files (series), sorted by name."""
    entries = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith((".", "_")):
            continue
        if (path.is_file() and file_extension(path) in IMAGE_EXTENSIONS) or (path.is_dir() and dicom_files(path)):
            entries.append(path)
    return entries


def find_inputs(images: str | Path, task: str) -> Inputs:
    """The inputs ``--images`` names (module docstring), with their ground truth where it is given."""
    root = Path(images).expanduser()
    if not root.exists():
        raise PredictError(f"--images {root}: no such file or folder")
    if root.is_file() and root.suffix.lower() == ".csv":
        inputs = _manifest(root, task)
    elif root.is_file():
        inputs = Inputs([_item(root, str(root))])
    elif (root / "images").is_dir():
        inputs = _layout(root)
    else:
        inputs = Inputs([_item(p, p.name) for p in _folder_entries(root)])
    if not inputs.items:
        raise PredictError(
            f"--images {root}: no images in it (image files {', '.join(IMAGE_EXTENSIONS)}, DICOM series folders, or "
            "an images/ folder)"
        )
    if task == "classification" and (volumes := [i.shown for i in inputs.items if i.volume]):
        raise PredictError(
            f"--images {root}: {len(volumes)} volume(s) ({', '.join(volumes[:3])}), but the run trained a "
            "classifier of 2-D images"
        )
    names = [i.name for i in inputs.items]
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise PredictError(
            f"--images {root}: several inputs would write the same output name {', '.join(repeated[:5])} (inputs "
            "are named by file stem); rename them or predict them separately"
        )
    return inputs


def _layout(root: Path) -> Inputs:
    """A folder with images/ and optionally masks/ or masks-<structure>/: a segmentation folder or a volumes root."""
    entries = _folder_entries(root / "images")
    volumes = any(is_volume(p) for p in entries)
    folders = mask_folders(root)
    if not folders:
        return Inputs([_item(p, f"images/{p.name}") for p in entries])
    if volumes:
        if [f.name for f in folders] != [MASKS]:
            raise PredictError(f"{root}: volumes take their ground truth from masks/<case>.nii[.gz] label volumes")
        try:
            cases = find_cases(root)
        except DataError as err:
            raise PredictError(str(err)) from None
        return Inputs([_item(image, f"images/{image.name}", masks=mask) for _, image, mask in cases])
    try:
        pairs = pair_site(root)
    except DataError as err:
        raise PredictError(str(err)) from None
    planes = any(f.name.startswith(STRUCTURE_PREFIX) for f in folders)
    items = [_item(image, f"images/{image.name}", masks=masks if planes else masks[0]) for image, masks in pairs]
    return Inputs(items, structure_folders=planes)


def _manifest(path: Path, task: str) -> Inputs:
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as err:
        raise PredictError(f"{path}: cannot read the manifest: {err}") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    if "path" not in frame.columns:
        raise PredictError(f"{path}: a manifest needs a 'path' column; found {', '.join(frame.columns) or 'none'}")
    missing = [(line, p) for line, p in enumerate(frame["path"], start=2) if not (path.parent / p.strip()).exists()]
    if missing:
        shown = ", ".join(f"line {line} ({p!r})" for line, p in missing[:5])
        raise PredictError(f"{path}: {len(missing)} image(s) not found (paths are relative to {path.parent}): {shown}")
    items = []
    for _, row in frame.iterrows():
        shown = row["path"].strip()
        fields: dict[str, Any] = {}
        if task == "classification" and row.get("label", "").strip():
            fields["label"] = row["label"].strip()
        if task == "segmentation" and row.get("mask", "").strip():
            fields["masks"] = path.parent / row["mask"].strip()
        items.append(_item(path.parent / shown, shown, **fields))
    return Inputs(items)


# ----------------------------------------------------------------------------- reading
class ImageFiles(Dataset):
    """2-D image files as the run's loaders take them: ``read_rgb`` at the run's size and intensity (label 0)."""

    task = "classification"

    def __init__(self, paths: list[Path], img_size: int, intensity: str) -> None:
        self.paths, self.img_size, self.intensity = paths, img_size, intensity

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return read_rgb(self.paths[i], self.img_size, f"{self.paths[i]}: cannot open image", self.intensity), 0


def image_shape(path: Path) -> tuple[int, int]:
    """(rows, columns) of a 2-D image file as its reader orients it."""
    kind = file_format(path)
    if kind == "nifti":
        return tuple(nifti_2d(path, f"{path}: cannot read NIfTI image").shape)
    if kind == "dicom":
        import pydicom

        header = pydicom.dcmread(opened_path(path), stop_before_pixels=True, force=True)
        return int(header.Rows), int(header.Columns)
    try:
        with open_pil(path, f"{path}: cannot open image") as image:
            return image.size[1], image.size[0]
    except OSError:
        import tifffile  # a TIFF PIL cannot open; read_image read it with tifffile

        with tifffile.TiffFile(opened_path(path)) as tiff:
            return tuple(tiff.series[0].shape[:2])


def volume_slices(volume_pixels: np.ndarray, axis: int, img_size: int) -> np.ndarray:
    """uint8 (n, S, S, 3) slices of a uint8 volume across ``axis``, resized as the volumes source resizes them."""
    size = (img_size, img_size)
    grey = np.stack([_resized(s, size, Image.Resampling.BILINEAR) for s in np.moveaxis(volume_pixels, axis, 0)])
    return np.repeat(grey[..., None], 3, axis=-1)


# ----------------------------------------------------------------------------- the model's outputs
def batches(model: torch.nn.Module, dataset: Dataset, batch_size: int, device: torch.device, precision: str):
    """The model's float32 outputs, batch by batch, on the CPU, through the run's evaluation loader."""
    loader = make_loader(dataset, batch_size, shuffle=False, seed=0)
    with torch.no_grad():
        for x, _ in loader:
            with autocast(device, precision):
                logits = model(x.to(device))
            yield logits.float().cpu()


def to_geometry(logits: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Segmentation logits [n, K, S, S] resized (bilinear) to the input's own rows and columns."""
    if tuple(logits.shape[-2:]) == tuple(shape):
        return logits
    return F.interpolate(logits, size=tuple(shape), mode="bilinear", align_corners=False)


def label_map(planes: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """uint8 class indices of boolean structure planes [K, ...]: 0 where none is predicted, else the index (1..K) of
    the predicted structure with the largest logit; one structure: 255 (PNG's binary convention) or 1."""
    if len(planes) == 1:
        return planes[0].astype(np.uint8)
    masked = np.where(planes, logits, -np.inf)
    return np.where(planes.any(axis=0), masked.argmax(axis=0) + 1, 0).astype(np.uint8)


# ----------------------------------------------------------------------------- ground truth
def truth_planes(item: Item, num: int, shape: tuple[int, ...], value_map) -> np.ndarray:
    """bool [K, *shape] ground truth of an item (a mask in the image's geometry, or a label volume)."""
    where = item.masks if isinstance(item.masks, Path) else item.masks[0]
    if item.volume:
        labels = load_volume(item.masks).array
        if value_map is not None:
            flat = value_map.planes(labels.reshape(labels.shape[0], -1), str(item.masks))
            planes = flat.reshape((-1, *labels.shape))
        else:
            classes = mask_classes(labels.astype(np.int64))
            if classes is None:
                raise PredictError(f"{item.masks}: label values {shown_values(labels)} are not class indices")
            planes = _class_planes(classes, num, item.masks)
    else:
        mask = read_masks(item.masks, value_map)
        planes = mask if mask.ndim == 3 else _class_planes(mask, num, where)
    if planes.shape[0] != num:
        raise PredictError(f"{where}: ground truth of {planes.shape[0]} structure(s), but the model has {num}")
    if tuple(planes.shape[1:]) != tuple(shape):
        raise PredictError(
            f"{where}: ground truth of size {tuple(planes.shape[1:])} for an image of size {tuple(shape)}; a mask "
            "must lie on its image"
        )
    return planes.astype(bool)


def _class_planes(classes: np.ndarray, num: int, where: Path) -> np.ndarray:
    """bool [K, ...] planes of class-index ground truth (class k + 1 is structure k), as the run's loss reads it."""
    if int(classes.max(initial=0)) > num:
        raise PredictError(
            f"{where}: ground truth holds class {int(classes.max())}, but the model has {num} structures"
        )
    return np.stack([classes == k + 1 for k in range(num)])


def class_index(label: str, names: list[str], shown: str) -> int:
    if label in names:
        return names.index(label)
    if label.lstrip("+-").isdigit() and 0 <= int(label) < len(names):
        return int(label)
    raise PredictError(f"{shown}: label {label!r} is neither a class of the run ({', '.join(names)}) nor an index")


# ----------------------------------------------------------------------------- writing
def write_mask(
    item: Item, planes: np.ndarray, logits: np.ndarray, out: Path, layout: str, names: list[str]
) -> list[Path]:
    """The item's predicted mask(s) in its geometry: a label map in masks/, or one binary mask per structure in
    masks-<structure>/; NIfTI (with the source's affine) for volumes and NIfTI images, else PNG."""
    binary = layout == "planes" or len(planes) == 1
    if layout == "label":
        written = [(out / MASKS, label_map(planes, logits))]
    else:
        written = [(out / f"{STRUCTURE_PREFIX}{name}", plane.astype(np.uint8)) for name, plane in zip(names, planes)]
    paths = []
    for folder, values in written:
        folder.mkdir(parents=True, exist_ok=True)
        if item.volume or item.source_nifti:
            path = folder / f"{item.name}.nii.gz"
            _write_nifti(item, values, path)
        else:
            path = folder / f"{item.name}.png"
            Image.fromarray(values * np.uint8(255 if binary else 1)).save(path)  # binary: 0/255, else class indices
        paths.append(path)
    return paths


def _write_nifti(item: Item, values: np.ndarray, path: Path) -> None:
    """A uint8 label volume (or 2-D label map) with the source's affine (NIfTI) or its voxel spacing (DICOM)."""
    import nibabel as nib

    if item.source_nifti:
        source = nib.load(opened_path(item.path))
        data = values.reshape(source.shape) if values.size == np.prod(source.shape) else values
        image = nib.Nifti1Image(np.ascontiguousarray(data, dtype=np.uint8), source.affine)
        image.set_qform(source.header.get_qform(), int(source.header["qform_code"]))
        image.set_sform(source.header.get_sform(), int(source.header["sform_code"]))
    else:
        spacing = load_volume(item.path).spacing if item.volume else (1.0, 1.0, 1.0)
        image = nib.Nifti1Image(np.ascontiguousarray(values, dtype=np.uint8), np.diag([*spacing, 1.0]))
    nib.save(image, str(path))


def _progress(total: int, unit: str):
    try:
        from tqdm.auto import tqdm  # installed with peft and datasets
    except ImportError:  # pragma: no cover - a log line per update instead

        class _Lines:
            def __init__(self):
                self.done = 0

            def update(self, n: int) -> None:
                self.done += n
                log(INFO, "[medflower] predicted %d/%d %ss", self.done, total, unit)

            def close(self) -> None:
                pass

        return _Lines()
    return tqdm(total=total, unit=unit, desc="predict", disable=None)


# ----------------------------------------------------------------------------- predicting
@dataclass
class Predictor:
    """What one prediction needs besides the model: the run, the inputs and the output settings."""

    run: TrainedRun
    inputs: Inputs
    out: Path
    batch_size: int
    layout: str = "auto"
    probabilities: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    scored: list[tuple[Item, SegmentationScores]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    device: str = ""  # the device the model ran on

    def __call__(self, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
        self.device = str(device)
        model.to(device).eval()
        if self.run.task == "classification":
            return self.classify(model, device)
        return self.segment(model, device)

    # -- classification
    def classify(self, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
        cfg, items = self.run.cfg, self.inputs.items
        dataset = ImageFiles([i.path for i in items], cfg.img_size, cfg.intensity)
        progress = _progress(len(items), "image")
        chunks = []
        for logits in batches(model, dataset, self.batch_size, device, cfg.precision):
            chunks.append(torch.softmax(logits, dim=1).numpy())
            progress.update(len(logits))
        progress.close()
        probs = np.concatenate(chunks)
        names = list(self.run.class_names)
        names += [f"class-{c}" for c in range(len(names), probs.shape[1])]
        labelled = [(n, class_index(i.label, names, i.shown)) for n, i in enumerate(items) if i.label is not None]
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "predictions.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["image", "predicted", *(f"p_{n}" for n in names), *(["label"] if labelled else [])])
            for n, item in enumerate(items):
                label = names[class_index(item.label, names, item.shown)] if item.label is not None else ""
                row = [item.shown, names[int(probs[n].argmax())], *(f"{p:.9g}" for p in probs[n])]
                writer.writerow(row + ([label] if labelled else []))
        self.written.append("predictions.csv")
        scores: dict[str, Any] = {}
        if labelled:
            rows, y = (np.array(v) for v in zip(*labelled))
            scores = {**classification_metrics(y, probs[rows]), "n": len(rows)}
            self._write_json("scores.json", scores)
        return {"images": len(items), "scores": scores, "probabilities": probs}

    # -- segmentation
    def segment(self, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
        cfg, items = self.run.cfg, self.inputs.items
        value_map = parse_mask_values(cfg.mask_values)
        names: list[str] = []
        progress = _progress(len(items), "image")
        images = [i for i in items if not i.volume]
        outputs: dict[str, np.ndarray] = {}
        dataset = ImageFiles([i.path for i in images], cfg.img_size, cfg.intensity)
        position = 0
        for logits in batches(model, dataset, self.batch_size, device, cfg.precision):
            for item_logits in logits:
                item = images[position]
                position += 1
                names = names or self._structure_names(len(item_logits))
                full = to_geometry(item_logits[None], image_shape(item.path))[0].numpy()
                outputs[item.name] = self._finish(item, full, names, value_map)
            progress.update(len(logits))
        for item in (i for i in items if i.volume):
            volume = load_volume(item.path)
            pixels = volume_intensity(volume, cfg.intensity)
            axis = cfg.slice_axis
            slices = volume_slices(pixels, axis, cfg.img_size)
            dataset = ArrayImageDataset(slices, np.zeros(len(slices), dtype=np.int64), cfg.img_size)
            shape = np.moveaxis(pixels, axis, 0).shape[1:]
            parts = [to_geometry(lg, shape) for lg in batches(model, dataset, self.batch_size, device, cfg.precision)]
            per_slice = torch.cat(parts).numpy()  # [n, K, a, b]
            names = names or self._structure_names(per_slice.shape[1])
            full = np.moveaxis(np.moveaxis(per_slice, 1, 0), 1, axis + 1)  # [K, i, j, k]
            outputs[item.name] = self._finish(item, full, names, value_map, slice_axis=axis)
            progress.update(1)
        progress.close()
        scores: dict[str, Any] = {}
        if self.scored:
            scores = SegmentationScores.concat([s for _, s in self.scored]).metrics(names)
            scores["n"] = sum(len(s.dice) for _, s in self.scored)
            self._write_scores(names)
            self._write_json("scores.json", scores)
        return {"images": len(items), "scores": scores, "structures": names, "logits": outputs}

    def _structure_names(self, num: int) -> list[str]:
        names = list(self.run.class_names)
        return names if len(names) == num else [f"structure-{k + 1}" for k in range(num)]

    def _finish(self, item: Item, logits: np.ndarray, names: list[str], value_map, slice_axis: int | None = None):
        """Write an item's mask(s) (and probabilities), score it against its ground truth; returns its logits."""
        planes = logits > 0  # sigmoid > 0.5, as the run's evaluation thresholds
        layout = self.layout
        if layout == "auto":
            overlapping = "+" in self.run.cfg.mask_values or self.inputs.structure_folders
            layout = "planes" if overlapping and len(names) > 1 else "label"
        for path in write_mask(item, planes, logits, self.out, layout, names):
            self.written.append(str(path.relative_to(self.out)))
        if self.probabilities:
            folder = self.out / "probabilities"
            folder.mkdir(parents=True, exist_ok=True)
            np.save(folder / f"{item.name}.npy", torch.sigmoid(torch.from_numpy(logits)).numpy().astype(np.float32))
        if item.masks is not None:
            truth = truth_planes(item, len(names), logits.shape[1:], value_map)
            if slice_axis is None:
                pred, target = planes[None], truth[None]
            else:  # a volume is scored slice by slice, as the run scored its slices
                pred = np.moveaxis(planes, slice_axis + 1, 0)
                target = np.moveaxis(truth, slice_axis + 1, 0)
            self.scored.append((item, segmentation_scores(pred, target, self.run.cfg.empty_masks)))
        return logits

    def _write_scores(self, names: list[str]) -> None:
        with open(self.out / "scores.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["image", "structure", "dice", "iou", "hd95"])
            for item, s in self.scored:
                for k, name in enumerate(names):
                    values = [_mean(getattr(s, metric)[:, k]) for metric in ("dice", "iou", "hd95")]
                    writer.writerow([item.shown, name, *("" if v is None else f"{v:.6g}" for v in values)])
        self.written.append("scores.csv")

    def _write_json(self, name: str, value: dict[str, Any]) -> None:
        (self.out / name).write_text(json.dumps(value, indent=1))
        self.written.append(name)


def _mean(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def predict(
    run: str | Path | TrainedRun,
    images: str | Path,
    out: str | Path,
    site: str | None = None,
    state_dir: str | Path | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    masks: str = "auto",
    probabilities: bool = False,
) -> dict[str, Any]:
    """Predict every input of ``images`` with the run's (site's) model and write the outputs into ``out``; returns
    ``prediction.json``'s content plus the outputs in memory (``probabilities`` or ``logits``, not written there)."""
    from .modelcard import model_card

    if masks not in MASK_LAYOUTS:
        raise PredictError(f"masks={masks!r}: one of {', '.join(MASK_LAYOUTS)}")
    started = time.monotonic()
    run = run if isinstance(run, TrainedRun) else TrainedRun(run)
    if run.cfg.sam_prompt == "box":
        raise PredictError(
            "the run prompts SAM's mask decoder with each structure's ground-truth box (sam-prompt='box'); there is "
            "no box for a new image, so this model cannot predict alone"
        )
    chosen: Site | None = run.site(site, state_dir)
    inputs = find_inputs(images, run.task)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    predictor = Predictor(run, inputs, out, int(batch_size or run.cfg.batch_size), masks, probabilities)
    result = with_site_model(run, chosen, predictor, device)
    report = {
        "model": model_card(run, chosen),
        "images": str(images),
        "inputs": len(inputs.items),
        "outputs": predictor.written,
        "scores": result["scores"],
        "device": predictor.device,
        "seconds": round(time.monotonic() - started, 3),
    }
    (out / "prediction.json").write_text(json.dumps(report, indent=1))
    return {**report, **{k: v for k, v in result.items() if k in ("probabilities", "logits", "structures")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medflower.predict", description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--images",
        required=True,
        help="a folder of images, a segmentation folder or volumes root, a CSV manifest, or one file",
    )
    parser.add_argument("--out", required=True, help="the folder the masks, CSVs and scores go into")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps or auto (default)")
    parser.add_argument("--batch-size", type=int, default=None, help="images per batch (default: the run's)")
    parser.add_argument(
        "--masks",
        choices=MASK_LAYOUTS,
        default="auto",
        help="label: one label map per image; planes: one binary mask per structure "
        "(auto: planes where the structures overlap)",
    )
    parser.add_argument(
        "--probabilities",
        action="store_true",
        help="segmentation: also write each image's per-structure probabilities (.npy)",
    )
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = predict(
            args.run,
            args.images,
            args.out,
            args.site,
            args.state_dir,
            args.device,
            args.batch_size,
            args.masks,
            args.probabilities,
        )
    except (RunError, PredictError, DataError, ConfigError, ModelError, DeviceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    scores = ", ".join(f"{k}={v:.4f}" for k, v in report["scores"].items() if isinstance(v, float))
    print(f"{report['inputs']} input(s) predicted into {args.out}" + (f"; {scores}" if scores else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
