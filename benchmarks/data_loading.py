"""Images per second of each reader, decoding (cold) and from the decoded-image cache, against training.

Files are generated in a temporary folder at realistic sizes:

- ``jpeg-8bit``: 3504 x 2336 RGB JPEG (a fundus camera's size), smooth content with a little noise;
- ``png-16bit``: 2048 x 2048 12-bit grey X-ray in a 16-bit PNG;
- ``dicom``: the same X-ray as an uncompressed DICOM with rescale slope/intercept and a window;
- ``nifti-volume``: 320 x 320 x 24 int16 MRI volumes (.nii.gz) with label volumes, read as slices by
  ``volumes:<root>``.

For each img_size (``--img-sizes``):

- **cold**: the first pass over the rows, which decodes every file. For the 2-D formats this is one pass of a
  ``DataLoader`` over ``decoded(ImageFileDataset, cache_dir, key)`` (the csv source's dataset in the decoded-image
  cache), i.e. reading, intensity, resize and writing the cache; for volumes, opening ``volumes:<root>``
  (reading, intensity over each volume, slicing, resizing), per slice.
- **cached**: a later process's passes (repeated for at least a second): ``decoded`` memory-maps the cache (no file
  is decoded) and a ``make_loader`` DataLoader gives batches of normalised float tensors (what the training step
  consumes); volumes are in memory after opening, so their figure is the same loader over the source's arrays.
- **training**: ViT-Tiny + LoRA (``medflower.models``, random weights) at the same img_size: forward, cross-entropy,
  backward and an SGD step on batches of ``--batch-size`` images, after one warm-up step.

The issue's goal: cached loading at least 10x faster than the training step consumes images.

    python benchmarks/data_loading.py                          # img_size 224 and 32, ~3-4 min on 2 CPU cores
    python benchmarks/data_loading.py --img-sizes 64 --files 4 --train-steps 2   # quick look

Results are printed as a table and written to benchmarks/results/data_loading.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import print_table, write_results  # noqa: E402
from medflower.data import DataSpec, make_loader  # noqa: E402
from medflower.data.cache import cache_key, decoded  # noqa: E402
from medflower.data.sources import open_source  # noqa: E402


def smooth_field(height: int, width: int, seed: int) -> np.ndarray:
    """float in [0, 1]: a few broad blobs and a vignette (image-like content that compresses like real images)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y, x = y / height - 0.5, x / width - 0.5
    field = np.exp(-(x**2 + y**2) * 4.0)
    for _ in range(6):
        cy, cx, r = rng.uniform(-0.4, 0.4), rng.uniform(-0.4, 0.4), rng.uniform(0.03, 0.15)
        field += 0.4 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r**2))
    field += rng.normal(0, 0.02, field.shape).astype(np.float32)
    return np.clip(field / field.max(), 0, 1)


def write_files(folder: Path, count: int) -> dict[str, Path]:
    """Manifests (jpeg-8bit, png-16bit, dicom) and a volumes root (nifti-volume) of ``count`` files each."""
    import nibabel as nib
    from PIL import Image
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import DigitalXRayImageStorageForPresentation, ExplicitVRLittleEndian, generate_uid

    made = {}
    for kind in ("jpeg-8bit", "png-16bit", "dicom"):
        (folder / kind).mkdir(parents=True)
        lines = ["path,label"]
        for i in range(count):
            if kind == "jpeg-8bit":
                field = smooth_field(2336, 3504, i)
                rgb = np.stack([field, field * 0.6, field * 0.3], axis=-1)
                Image.fromarray((rgb * 255).astype(np.uint8)).save(folder / kind / f"{i}.jpg", quality=90)
                name = f"{i}.jpg"
            else:
                xray = (smooth_field(2048, 2048, i) * 4095).astype(np.uint16)
                if kind == "png-16bit":
                    Image.fromarray(xray).save(folder / kind / f"{i}.png")
                    name = f"{i}.png"
                else:
                    meta = FileMetaDataset()
                    meta.MediaStorageSOPClassUID = DigitalXRayImageStorageForPresentation
                    meta.MediaStorageSOPInstanceUID = generate_uid()
                    meta.TransferSyntaxUID = ExplicitVRLittleEndian
                    ds = Dataset()
                    ds.file_meta = meta
                    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
                    ds.set_pixel_data(xray, photometric_interpretation="MONOCHROME2", bits_stored=12)
                    ds.RescaleSlope, ds.RescaleIntercept = 1, 0
                    ds.WindowCenter, ds.WindowWidth = 2048, 4096
                    name = f"{i}.dcm"
                    ds.save_as(folder / kind / name, enforce_file_format=True)
            lines.append(f"{name},{i % 2}")
        (folder / kind / "manifest.csv").write_text("\n".join(lines) + "\n")
        made[kind] = folder / kind / "manifest.csv"
    root = folder / "volumes"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    for i in range(max(1, count // 4)):
        mri = np.stack([smooth_field(320, 320, 100 * i + k) for k in range(24)], axis=-1)
        labels = (mri > 0.7).astype(np.uint8)
        nib.save(nib.Nifti1Image((mri * 1200).astype(np.int16), np.eye(4)), root / "images" / f"case{i}.nii.gz")
        nib.save(nib.Nifti1Image(labels, np.eye(4)), root / "masks" / f"case{i}.nii.gz")
    made["nifti-volume"] = root
    return made


def loader_pass(dataset, batch_size: int) -> float:
    """Seconds for one pass of a make_loader DataLoader (normalised float batches)."""
    started = time.perf_counter()
    for _ in make_loader(dataset, batch_size=batch_size, shuffle=False, seed=0):
        pass
    return time.perf_counter() - started


def repeated_rate(run, rows: int, at_least_s: float = 1.0) -> float:
    """Rows per second of ``run()`` (one pass over ``rows`` rows) repeated for at least ``at_least_s`` seconds."""
    passes, started = 0, time.perf_counter()
    while passes == 0 or time.perf_counter() - started < at_least_s:
        run()
        passes += 1
    return rows * passes / (time.perf_counter() - started)


def measure_reader(kind: str, path: Path, img_size: int, batch_size: int, cache_dir: Path) -> dict:
    row = {"reader": kind, "img_size": img_size}
    if kind == "nifti-volume":
        spec = DataSpec(dataset=f"volumes:{path}", partition="iid", img_size=img_size)
        started = time.perf_counter()
        source = open_source(spec)
        cold = time.perf_counter() - started
        rows = len(source)
        in_memory = source.dataset(np.arange(rows), 0, spec)
        cached = repeated_rate(lambda: loader_pass(in_memory, batch_size), rows)
        return {**row, "rows": rows, "cold_per_s": rows / cold, "cached_per_s": cached}
    spec = DataSpec(dataset=f"csv:{path}", partition="iid", img_size=img_size)
    source = open_source(spec)
    rows = len(source)
    dataset = source.dataset(np.arange(rows), 0, spec)
    key = cache_key(dataset, spec)
    cold = loader_pass(decoded(dataset, str(cache_dir), key), batch_size)
    later = decoded(source.dataset(np.arange(rows), 0, spec), str(cache_dir), key)
    assert later.cached_on_disk, "the cache was not written"
    cached = repeated_rate(lambda: loader_pass(later, batch_size), rows)
    items = repeated_rate(lambda: [later[i] for i in range(rows)], rows)
    return {**row, "rows": rows, "cold_per_s": rows / cold, "cached_per_s": cached, "cached_items_per_s": items}


def training_rate(img_size: int, batch_size: int, steps: int) -> float:
    """Images per second of ViT-Tiny + LoRA training steps (after one warm-up step)."""
    import torch

    from medflower.models import ModelSpec, build_classifier

    torch.manual_seed(0)
    patch = 16 if img_size >= 64 else 8
    model = build_classifier(
        ModelSpec(backbone="vit-tiny", adapter="lora", img_size=img_size, patch_size=patch, weights="none"), 2
    ).train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    x = torch.randn(batch_size, 3, img_size, img_size)
    y = torch.randint(0, 2, (batch_size,))
    for step in range(steps + 1):
        if step == 1:
            started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return batch_size * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--img-sizes", type=int, nargs="+", default=[224, 32])
    parser.add_argument("--files", type=int, default=12, help="files per 2-D format (volumes: files / 4, at least 1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=3, help="timed training steps (after one warm-up)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "data_loading.json")
    args = parser.parse_args()

    started = time.perf_counter()
    import monai.transforms  # noqa: F401  (a site pays these imports once; they are not a reader's cost per image)
    import nibabel  # noqa: F401
    import pydicom.pixels  # noqa: F401

    print(f"MONAI, pydicom and nibabel imported in {time.perf_counter() - started:.1f} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        files = write_files(Path(tmp) / "files", args.files)
        print(f"files written in {time.perf_counter() - started:.1f} s", flush=True)
        for img_size in args.img_sizes:
            train = training_rate(img_size, args.batch_size, args.train_steps)
            print(json.dumps({"img_size": img_size, "train_per_s": train}), flush=True)
            for kind, path in files.items():
                row = measure_reader(kind, path, img_size, args.batch_size, Path(tmp) / f"cache-{img_size}")
                row["train_per_s"] = train
                row["cached_vs_train"] = row["cached_per_s"] / train
                rows.append(row)
                print(json.dumps(row), flush=True)

    header = [
        "img_size",
        "reader",
        "rows",
        "cold_per_s",
        "cached_per_s",
        "cached_items_per_s",
        "train_per_s",
        "cached_vs_train",
    ]
    print_table(header, rows, ",.1f")
    write_results(args.out, "rows", rows)


if __name__ == "__main__":
    main()
