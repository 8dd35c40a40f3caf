"""Reading image files of every format the data layer takes: one reader per format family.

- DICOM (``.dcm``, ``.dicom``, or any file with the ``DICM`` preamble): pydicom. The pixel pipeline is the standard's:
  modality LUT (rescale slope/intercept or a Modality LUT Sequence), then VOI (the file's VOI LUT or window under
  ``intensity='auto'``, else the run's intensity setting), then MONOCHROME1 inverted (high values shown dark).
- NIfTI (``.nii``, ``.nii.gz``): nibabel, with the file's scaling (scl_slope/scl_inter) applied. Arrays keep
  nibabel's voxel order (i, j, k): a 2-D image's rows are i, its columns j.
- Everything else: PIL. 8-bit images (modes L, RGB, P, RGBA, ...) are converted to RGB and resized exactly as
  before; 16-bit ('I;16', 'I;16B', 'I') and float ('F') images go through the intensity setting instead of PIL's
  RGB conversion, which clips a 16-bit X-ray to white. A TIFF that PIL cannot open (16-bit colour) is read with
  tifffile when it is installed.

Every 2-D reader gives uint8 (img_size, img_size, 3): intensities in [0, 1] become 0..255 (rounded), then a bilinear
resize. Volumes (``read_volume``) are NIfTI files, DICOM series folders or multi-frame DICOM files, returned as float32
(i, j, k) with their voxel spacing; ``medflower.data.volumes`` slices them. See docs/data.md#medical-image-formats.

Every file may be hostile. Before any pixel is decoded, the size the decoded array would take is read from the file's
header (PIL's lazy open, nibabel's header, DICOM Rows/Columns/frames/bits, the ``.npy`` headers of an ``.npz``) and
refused above the site's node-config ``max-image-bytes`` (``ReadPolicy``; docs/data.md#input-limits). Every file is
opened by its real path (symlinks followed), checked at that moment against node-config ``data-roots`` when the site
confines its reads (``set_read_policy``, set by ``roots.check_data_roots``), so a file swapped for a symlink after the
data-roots check is still refused.

pydicom, nibabel and MONAI are imported inside the functions that need them: MONAI alone takes seconds to import,
and most runs read no such file.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .spec import DataError, list_rows, parse_intensity

DICOM_EXTENSIONS = (".dcm", ".dicom")
NIFTI_EXTENSIONS = (".nii", ".nii.gz")
PIL_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".gif", ".webp", ".ppm", ".pgm")  # no DICM check
HIGH_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # PIL modes read as numbers, not as 8-bit colour
AUTO_PERCENTILES = (0.5, 99.5)
PIXEL_DATA_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
# what pydicom raises for a missing or malformed attribute (e.g. no BitsStored or PixelRepresentation)
DICOM_ATTRIBUTE_ERRORS = (AttributeError, KeyError, TypeError, IndexError, NotImplementedError)
VOLUMES_HINT = "read it as a volume instead: dataset 'volumes:<root>' (docs/data.md#volumes)"
MAX_BYTES_KEY = "max-image-bytes"  # node-config: the largest decoded image, volume or npz array a site allocates
DEFAULT_MAX_IMAGE_BYTES = 2**30  # 1 GiB
DECODED_ITEM_BYTES = 4  # images and volumes are counted as the float32 (or RGBA) arrays they may be decoded to
BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}


# ----------------------------------------------------------------------------- what a site may read
@dataclass(frozen=True)
class ReadPolicy:
    """The site's limits on reading: ``roots`` (real paths of node-config data-roots; None = not confined) and
    ``max_bytes`` (node-config max-image-bytes)."""

    roots: tuple[str, ...] | None = None
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES


_POLICY = ReadPolicy()


def read_policy() -> ReadPolicy:
    return _POLICY


def set_read_policy(roots: Iterable[str] | None, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> None:
    """Make every later read of this process confined to ``roots`` (None: anywhere) and ``max_bytes`` per decoded
    array. Loader worker processes forked afterwards inherit it."""
    global _POLICY
    real = None if roots is None else tuple(os.path.realpath(os.path.expanduser(str(r))) for r in roots)
    _POLICY = ReadPolicy(real, int(max_bytes))


def max_image_bytes(node_config: Mapping) -> int:
    """node-config ``max-image-bytes`` as bytes (an integer, or a number with KiB/MiB/GiB/TiB), default 1 GiB;
    DataError naming the key for anything else."""
    raw = node_config.get(MAX_BYTES_KEY)
    if raw is None or str(raw).strip() == "":
        return DEFAULT_MAX_IMAGE_BYTES
    text = str(raw).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number) :]
    try:
        value = float(number) * BYTE_UNITS[unit]
    except (ValueError, KeyError):
        value = float("nan")
    if isinstance(raw, bool) or not (math.isfinite(value) and value >= 1):
        raise DataError(
            f"node-config {MAX_BYTES_KEY} = {raw!r}: expected a size in bytes >= 1, e.g. 1073741824 "
            "or '4GiB' (docs/deployment.md#per-site-data)"
        )
    return int(value)


def _human(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def check_decoded_size(path: str | Path, what: str, shape: Iterable[int], item_bytes: int) -> None:
    """DataError naming ``path``, the bytes decoding ``what`` of ``shape`` (``item_bytes`` each) would need and the
    limit, when that is above node-config max-image-bytes; nothing is allocated."""
    dims = [int(n) for n in shape]
    if any(n < 0 for n in dims):
        raise DataError(f"{path}: {what} has a negative dimension {tuple(dims)}")
    need = math.prod(dims) * max(int(item_bytes), 1)
    limit = _POLICY.max_bytes
    if need > limit:
        raise DataError(
            f"{path}: decoding this {what} of shape {tuple(dims)} would need {need} bytes ({_human(need)}), above this "
            f"site's limit of {limit} bytes ({_human(limit)}, node-config {MAX_BYTES_KEY}); an operator who trusts "
            f'the file raises it, e.g. flower-supernode ... --node-config "{MAX_BYTES_KEY}={max(need, limit * 2)}" '
            "(docs/data.md#input-limits)"
        )


def _is_below(real: str, roots: Iterable[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def opened_path(path: str | Path) -> str:
    """The real path of ``path`` (symlinks followed, '..' removed), resolved now, just before it is opened; DataError
    when the site confines its reads (node-config data-roots) and it lies outside them. Open the returned path."""
    real = os.path.realpath(os.path.expanduser(str(path)))
    roots = _POLICY.roots
    if roots is not None and not _is_below(real, roots):
        raise DataError(
            f"{path}: resolves (symlinks followed) outside this site's node-config data-roots when opened; it is not "
            "read (the site operator allows a folder by adding it to data-roots; see docs/data.md#data-roots)"
        )
    return real


def open_pil(path: str | Path, where: str | None = None) -> Image.Image:
    """PIL's lazy open of ``path`` (``opened_path``: confined), its size and mode checked against max-image-bytes
    before any pixel is decoded; PIL's own decompression-bomb limit stays in force."""
    image = Image.open(opened_path(path))
    try:
        bands = max(len(image.getbands()), 1)
        item = max(DECODED_ITEM_BYTES, bands * (2 if image.mode.startswith("I;16") else 1))
        check_decoded_size(where or path, f"image (mode {image.mode})", (image.size[1], image.size[0]), item)
    except BaseException:
        image.close()
        raise
    return image


def check_npz(path: str | Path) -> None:
    """Every array of an ``.npz`` (its ``.npy`` headers, nothing decompressed) within max-image-bytes; DataError
    naming the file and the array otherwise."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as member:
                    shape, dtype = _npy_header(member)
                check_decoded_size(path, f"array {info.filename[:-4]!r} ({dtype})", shape, dtype.itemsize)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: cannot read npz file: {exc}") from exc


def _npy_header(handle) -> tuple[tuple[int, ...], np.dtype]:
    fmt = np.lib.format
    version = fmt.read_magic(handle)
    if version == (1, 0):
        shape, _, dtype = fmt.read_array_header_1_0(handle)
    elif version == (2, 0):
        shape, _, dtype = fmt.read_array_header_2_0(handle)
    else:
        shape, _, dtype = fmt._read_array_header(handle, version)  # 3.0: no public reader
    return tuple(shape), np.dtype(dtype)


# ----------------------------------------------------------------------------- formats
def file_format(path: str | Path) -> str:
    """'dicom', 'nifti' or 'pil': by extension, else by the DICOM preamble ('DICM' at byte 128)."""
    name = str(path).lower()
    if name.endswith(DICOM_EXTENSIONS):
        return "dicom"
    if name.endswith(NIFTI_EXTENSIONS):
        return "nifti"
    if name.endswith(PIL_EXTENSIONS):
        return "pil"
    return "dicom" if has_dicom_preamble(path) else "pil"


def has_dicom_preamble(path: str | Path) -> bool:
    """The file starts with the 128-byte preamble and 'DICM' (a DICOM Part 10 file)."""
    try:
        with open(opened_path(path), "rb") as handle:
            head = handle.read(132)
    except (OSError, DataError):  # outside data-roots: not read here, refused by the reader that opens it
        return False
    return len(head) == 132 and head[128:] == b"DICM"


# ----------------------------------------------------------------------------- intensity
def normalise_intensity(array: np.ndarray, intensity: str = "auto") -> np.ndarray:
    """float32 in [0, 1] of a >8-bit or float image or volume (any shape), by the ``intensity`` setting.

    ``auto`` and ``percentile:<low>,<high>`` clip to those percentiles (auto: 0.5-99.5) and scale; ``window:<c>,<w>``
    maps c - w/2 .. c + w/2 to 0..1; ``minmax`` the array's range; ``none`` keeps values, clipped to 0..255. Callers
    keep 8-bit data and DICOM windows out of ``auto`` themselves. Non-finite values are set to the nearest finite end
    (NaN to the low end) first; a constant array (or an empty range) gives zeros, never NaN.
    """
    values = np.asarray(array, dtype=np.float32)
    values = _finite(values if values.flags.writeable else values.copy())  # torch (in MONAI) wants writable arrays
    mode, params = parse_intensity(intensity)
    if mode == "none":
        return np.clip(values, 0.0, 255.0) / np.float32(255.0)
    if values.size == 0:
        return values
    if mode == "window":
        center, width = params
        low, high = center - width / 2, center + width / 2
    elif mode == "minmax":
        low, high = float(values.min()), float(values.max())
    else:
        # Percentiles by hand rather than MONAI's ScaleIntensityRangePercentiles: an image that is mostly one value
        # (a wide black border) can have equal percentiles, and then the image's own range is used instead of MONAI's
        # divide-by-zero branch (which warns and returns the values unscaled).
        lower, upper = params if mode == "percentile" else AUTO_PERCENTILES
        low, high = (float(v) for v in np.percentile(values, (lower, upper)))
        if high <= low:
            low, high = float(values.min()), float(values.max())
    if not high > low:
        return np.zeros_like(values)
    from monai.transforms import ScaleIntensityRange  # seconds to import: only when such an image is read

    scaled = ScaleIntensityRange(a_min=low, a_max=high, b_min=0.0, b_max=1.0, clip=True)(values)
    return np.asarray(scaled, dtype=np.float32)


def _finite(values: np.ndarray) -> np.ndarray:
    finite = np.isfinite(values)
    if finite.all():
        return values
    if not finite.any():
        return np.zeros_like(values)
    low, high = values[finite].min(), values[finite].max()
    return np.where(finite, values, np.where(values == np.inf, high, low)).astype(np.float32)


def to_uint8(unit: np.ndarray) -> np.ndarray:
    """uint8 0..255 of intensities in [0, 1] (rounded to nearest)."""
    return np.rint(np.clip(unit, 0.0, 1.0) * 255.0).astype(np.uint8)


def resize_rgb(pixels: np.ndarray, img_size: int) -> np.ndarray:
    """uint8 (img_size, img_size, 3) of a uint8 (H, W) or (H, W, 3) image: bilinear resize, grey repeated 3 times."""
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if image.size != (img_size, img_size):
        image = image.resize((img_size, img_size), Image.Resampling.BILINEAR)
    out = np.asarray(image, dtype=np.uint8)
    return np.repeat(out[..., None], 3, axis=-1) if out.ndim == 2 else out


# ----------------------------------------------------------------------------- 2-D images
def read_image(path: str | Path, img_size: int, intensity: str = "auto", where: str | None = None) -> np.ndarray:
    """uint8 (img_size, img_size, 3) image of ``path`` in any supported format (module docstring).

    ``intensity`` (``DataSpec.intensity``) applies to DICOM, NIfTI, 16-bit and float images; 8-bit images are used
    as they are. DataError names the file (``where`` replaces the default "<path>: cannot open image" prefix).
    """
    where = where or f"{path}: cannot open image"
    kind = file_format(path)
    try:
        if kind == "dicom":
            return resize_rgb(_dicom_image(path, intensity, where), img_size)
        if kind == "nifti":
            return resize_rgb(_nifti_image(path, intensity, where), img_size)
        return _pil_image(path, img_size, intensity, where)
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zlib.error, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: {exc}") from exc
    except DICOM_ATTRIBUTE_ERRORS as exc:
        if kind != "dicom":
            raise
        raise DataError(f"{where}: malformed DICOM attributes: {exc!r}") from exc


def _pil_image(path: str | Path, img_size: int, intensity: str, where: str) -> np.ndarray:
    try:
        image = open_pil(path, where)
    except DataError:
        raise
    except (OSError, ValueError) as exc:  # PIL cannot identify it: a 16-bit colour TIFF is read with tifffile
        if str(path).lower().endswith((".tif", ".tiff")):
            return resize_rgb(_tiff_image(path, intensity, where, exc), img_size)
        raise
    with image:
        if image.mode not in HIGH_DEPTH_MODES:  # 8-bit: exactly as before (existing results do not change)
            image = image.convert("RGB").resize((img_size, img_size), Image.Resampling.BILINEAR)
            return np.asarray(image, dtype=np.uint8)
        values = np.asarray(image)
    return resize_rgb(to_uint8(normalise_intensity(values, intensity)), img_size)


def _tiff_image(path: str | Path, intensity: str, where: str, pil_error: Exception) -> np.ndarray:
    try:
        import tifffile  # optional: only for TIFFs PIL cannot read
    except ImportError:
        raise DataError(
            f"{where}: {pil_error}; a 16-bit colour TIFF needs the tifffile package (pip install tifffile)"
        ) from pil_error
    with tifffile.TiffFile(opened_path(path)) as tiff:
        series = tiff.series[0]
        check_decoded_size(
            where, f"TIFF ({series.dtype})", series.shape, max(DECODED_ITEM_BYTES, np.dtype(series.dtype).itemsize)
        )
        values = np.asarray(series.asarray())
    if values.ndim == 3 and values.shape[-1] in (3, 4):
        values = values[..., :3]
    elif values.ndim != 2:
        raise DataError(f"{where}: TIFF of shape {values.shape}; expected (H, W) or (H, W, 3)")
    if values.dtype == np.uint8 and parse_intensity(intensity)[0] == "auto":
        return values
    return to_uint8(normalise_intensity(values, intensity))


def _nifti_image(path: str | Path, intensity: str, where: str) -> np.ndarray:
    values = nifti_2d(path, where)
    if values.dtype == np.uint8 and parse_intensity(intensity)[0] == "auto":
        return values
    return to_uint8(normalise_intensity(values, intensity))


def nifti_2d(path: str | Path, where: str) -> np.ndarray:
    """The 2-D voxel values of a NIfTI image or label map (axes of length 1 dropped; rows = the file's i axis), with
    its scaling applied; DataError naming ``where`` when it cannot be read or holds more than one slice."""
    import nibabel as nib

    try:
        image = nib.load(opened_path(path))
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zlib.error, nib.filebasedimages.ImageFileError) as exc:
        raise DataError(f"{where}: not a readable NIfTI file: {exc}") from exc
    shape = tuple(image.shape)
    kept = [n for n in shape if n != 1]
    if len(kept) > 2:
        raise DataError(
            f"{where}: NIfTI file of shape {shape} has more than one slice; a 2-D image is expected "
            f"here, so {VOLUMES_HINT}"
        )
    return _nifti_values(image, where).reshape(kept if len(kept) == 2 else (shape + (1, 1))[:2])


def _nifti_values(image, where: str) -> np.ndarray:
    """The voxel values with the file's scaling applied (the stored dtype when it has none); the header's shape and
    data type checked against max-image-bytes before anything is decoded."""
    stored = np.dtype(image.header.get_data_dtype())
    slope, inter = image.header.get_slope_inter()
    scaled = slope not in (None, 1.0) or inter not in (None, 0.0)
    item = max(DECODED_ITEM_BYTES, stored.itemsize, 8 if scaled else 0)  # nibabel scales in float64
    check_decoded_size(where, f"NIfTI volume ({stored})", image.shape, item)
    values = np.asanyarray(image.dataobj)
    if values.dtype.kind not in "biuf":
        raise DataError(
            f"{where}: NIfTI data type {values.dtype} is not supported (expected integer or float "
            "voxels; colour NIfTI is not)"
        )
    return values


def _dicom_dataset(path: str | Path, where: str):
    """The pydicom dataset of ``path``, checked to hold pixel data."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        dataset = pydicom.dcmread(opened_path(path), force=True)
    except DataError:
        raise
    except (InvalidDicomError, OSError, ValueError, EOFError, KeyError, TypeError) as exc:
        raise DataError(f"{where}: not a readable DICOM file: {exc}") from exc
    if not any(keyword in dataset for keyword in PIXEL_DATA_KEYWORDS):
        sop = dataset.get("SOPClassUID")
        what = f" (SOP class {getattr(sop, 'name', sop)})" if sop else ""
        raise DataError(
            f"{where}: DICOM file has no pixel data (no PixelData element){what}; it is not an image "
            "(e.g. a structured report, presentation state or DICOMDIR)"
        )
    return dataset


def dicom_decoded_shape(dataset) -> tuple[tuple[int, ...], int]:
    """(frames, rows, columns, samples) and bytes per sample of a dataset's pixel data, from its attributes."""
    try:
        shape = (
            _frames(dataset),
            int(dataset.get("Rows") or 0),
            int(dataset.get("Columns") or 0),
            int(dataset.get("SamplesPerPixel") or 1),
        )
        bits = int(dataset.get("BitsAllocated") or 8)
    except (TypeError, ValueError):
        shape, bits = (0,), 8
    return shape, max(DECODED_ITEM_BYTES, -(-bits // 8))


def _dicom_pixels(dataset, where: str) -> np.ndarray:
    shape, item = dicom_decoded_shape(dataset)
    check_decoded_size(where, "DICOM pixel data", shape, item)
    try:
        return dataset.pixel_array
    except Exception as exc:  # pydicom raises many kinds (missing decoder plugin, bad length, bad attributes)
        syntax = getattr(getattr(dataset, "file_meta", None), "TransferSyntaxUID", None)
        named = f" (transfer syntax {getattr(syntax, 'name', syntax)})" if syntax else ""
        raise DataError(f"{where}: cannot decode the DICOM pixel data{named}: {exc}") from exc


def _frames(dataset) -> int:
    try:
        return int(dataset.get("NumberOfFrames") or 1)
    except (TypeError, ValueError):
        return 1


def _dicom_image(path: str | Path, intensity: str, where: str) -> np.ndarray:
    """uint8 (H, W) or (H, W, 3) of a single-frame DICOM: modality LUT, VOI, MONOCHROME1 inverted."""
    from pydicom.pixels import apply_modality_lut

    dataset = _dicom_dataset(path, where)
    frames = _frames(dataset)
    if frames > 1:
        raise DataError(
            f"{where}: multi-frame DICOM ({frames} frames); a 2-D image is expected here, so {VOLUMES_HINT}"
        )
    stored = _dicom_pixels(dataset, where)
    mode = parse_intensity(intensity)[0]
    if stored.ndim == 3:  # colour (pydicom gives RGB); no modality LUT or windowing for colour images
        if stored.dtype == np.uint8 and mode == "auto":
            return stored
        return to_uint8(normalise_intensity(stored, intensity))
    if stored.ndim != 2:
        raise DataError(f"{where}: DICOM pixel data of shape {stored.shape}; expected one 2-D frame")
    values = apply_modality_lut(stored, dataset)
    if mode == "auto" and has_voi(dataset):
        unit = dicom_voi(values, dataset)
    elif mode == "auto" and values.dtype == np.uint8:  # 8-bit data with no rescale: as it is
        unit = values.astype(np.float32) / np.float32(255.0)
    else:
        unit = normalise_intensity(values, intensity)
    if str(dataset.get("PhotometricInterpretation", "")).strip() == "MONOCHROME1":
        unit = 1.0 - unit
    return to_uint8(unit)


def has_voi(dataset) -> bool:
    """The dataset has a usable VOI LUT Sequence or a Window Center/Width."""
    sequence = dataset.get("VOILUTSequence")
    if sequence and None not in (sequence[0].get("LUTDescriptor"), sequence[0].get("LUTData")):
        return True
    return dataset.get("WindowCenter") is not None and dataset.get("WindowWidth") is not None


def dicom_voi(values: np.ndarray, dataset) -> np.ndarray:
    """float32 in [0, 1]: pydicom's ``apply_voi_lut`` (the file's first VOI LUT, else its first window), divided by
    its output range (the LUT's values; for a window, the range pydicom maps it onto)."""
    from pydicom.pixels import apply_voi_lut

    if values.dtype.kind == "f" and np.array_equal(values, np.round(values)):
        values = values.astype(np.int64)  # a VOI LUT indexes by whole stored values
    out = apply_voi_lut(values, dataset, index=0).astype(np.float64)
    sequence = dataset.get("VOILUTSequence")
    if sequence and None not in (sequence[0].get("LUTDescriptor"), sequence[0].get("LUTData")):
        entries, first = int(sequence[0].LUTDescriptor[0] or 2**16), int(sequence[0].LUTDescriptor[1])
        ends = apply_voi_lut(np.arange(first, first + entries), dataset, index=0)
    else:  # a window maps everything below it to its low end and everything above to its high end
        ends = apply_voi_lut(np.array([-np.inf, np.inf]), dataset, index=0)
    low, high = float(np.min(ends)), float(np.max(ends))
    if not high > low:
        return np.zeros(out.shape, dtype=np.float32)
    return np.clip((out - low) / (high - low), 0.0, 1.0).astype(np.float32)


# ----------------------------------------------------------------------------- volumes
@dataclass(frozen=True)
class Volume:
    """A 3-D image: float32 values (i, j, k), voxel spacing along those axes, and how its values were stored."""

    array: np.ndarray
    spacing: tuple[float, float, float]
    eight_bit: bool = False  # stored as uint8 with no scaling: intensity 'auto' keeps the values as they are
    monochrome1: bool = False  # DICOM MONOCHROME1: high values are shown dark, so intensities are inverted


def read_volume(path: str | Path) -> tuple[np.ndarray, tuple[float, float, float]]:
    """(float32 3-D array, voxel spacing) of a NIfTI file, a DICOM series folder or a multi-frame DICOM file.

    Axes: NIfTI arrays as nibabel gives them, voxel order (i, j, k); for an axial acquisition k is usually the slice
    direction (inferior-superior) and i, j run within the slice. DICOM series and multi-frame files use the same
    order: i = column, j = row of a slice, k = slice (series: by ImagePositionPatient along the slice normal, else
    InstanceNumber, else file name; multi-frame: frame order). Values have the file's scaling (NIfTI scl_slope/
    scl_inter, DICOM modality LUT per slice) applied. DataError names the file or folder and the problem.
    """
    volume = load_volume(path)
    return volume.array, volume.spacing


def load_volume(path: str | Path) -> Volume:
    """``read_volume`` with how the values were stored (8-bit, MONOCHROME1), which intensity 'auto' needs."""
    path = Path(path)
    if path.is_dir() or (path.is_file() and file_format(path) == "dicom"):
        try:
            return _dicom_series(path) if path.is_dir() else _dicom_multiframe(path)
        except DataError:
            raise
        except (OSError, ValueError, EOFError, *DICOM_ATTRIBUTE_ERRORS) as exc:
            raise DataError(f"{path}: cannot read DICOM volume: {exc!r}") from exc
    if not path.is_file():
        raise DataError(f"{path}: volume not found")
    if file_format(path) != "nifti":
        raise DataError(
            f"{path}: not a volume (expected a .nii/.nii.gz file, a DICOM series folder or a multi-frame DICOM file)"
        )
    import nibabel as nib

    where = f"{path}: cannot read NIfTI volume"
    try:
        image = nib.load(opened_path(path))
        values = _nifti_values(image, where)
        zooms = tuple(float(z) for z in image.header.get_zooms())
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zlib.error, nib.filebasedimages.ImageFileError) as exc:
        raise DataError(f"{where}: {exc}") from exc
    shape = values.shape
    if values.ndim > 3 and all(n == 1 for n in shape[3:]):
        values = values.reshape(shape[:3])
    if values.ndim == 2:
        values = values[:, :, None]
    if values.ndim != 3:
        raise DataError(
            f"{path}: NIfTI data of shape {shape}; expected a 3-D volume (a 4-D series with more than one "
            "volume is not supported)"
        )
    spacing = tuple((zooms + (1.0, 1.0, 1.0))[:3])
    return Volume(values.astype(np.float32), spacing, eight_bit=values.dtype == np.uint8)


def dicom_files(folder: Path) -> list[Path]:
    """The DICOM files directly in ``folder`` (by extension or preamble; hidden files and DICOMDIR left out)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.name.upper() != "DICOMDIR" and file_format(p) == "dicom"
    )


def _dicom_series(folder: Path) -> Volume:
    from pydicom.pixels import apply_modality_lut

    files = dicom_files(folder)
    if not files:
        raise DataError(
            f"{folder}: no DICOM files in this series folder (files ending in .dcm/.dicom or starting "
            "with the DICM preamble)"
        )
    datasets = [_dicom_dataset(p, f"{p}: cannot read DICOM slice") for p in files]
    _check_series(folder, files, datasets)
    frame, item = dicom_decoded_shape(datasets[0])
    check_decoded_size(folder, f"DICOM series of {len(files)} slices", (len(files), *frame[1:]), item)
    order = _slice_order(folder, files, datasets)
    slices, monochrome1, eight_bit = [], False, True
    for position in order:
        dataset, name = datasets[position], files[position]
        where = f"{name}: cannot read DICOM slice"
        if _frames(dataset) > 1:
            raise DataError(
                f"{folder}: {name.name} is a multi-frame DICOM inside a series folder; put it in images/ "
                "as a case of its own"
            )
        stored = _dicom_pixels(dataset, where)
        if stored.ndim != 2:
            raise DataError(
                f"{folder}: {name.name} has pixel data of shape {stored.shape}; a series needs single-frame grey slices"
            )
        values = apply_modality_lut(stored, dataset)
        eight_bit &= values.dtype == np.uint8
        monochrome1 |= str(dataset.get("PhotometricInterpretation", "")).strip() == "MONOCHROME1"
        slices.append(np.asarray(values, dtype=np.float32).T)  # (columns, rows): i = column, j = row
    array = np.stack(slices, axis=-1)
    return Volume(array, _series_spacing(datasets, order), eight_bit=eight_bit, monochrome1=monochrome1)


def _check_series(folder: Path, files: list[Path], datasets: list) -> None:
    """One series, one slice size: DataError naming the folder, the sizes or UIDs and their files."""

    def grouped(values: list) -> str:
        groups: dict = {}
        for value, path in zip(values, files):
            groups.setdefault(value, []).append(path.name)
        return "; ".join(f"{value}: {len(names)} file(s) ({list_rows(names, 3)})" for value, names in groups.items())

    uids = [str(d.get("SeriesInstanceUID", "")) for d in datasets]
    if len(set(uids)) > 1:
        raise DataError(
            f"{folder}: files of {len(set(uids))} DICOM series (SeriesInstanceUID) in one folder; put each "
            f"series in a folder of its own: {grouped(uids)}"
        )
    sizes = [f"{d.get('Rows')}x{d.get('Columns')}" for d in datasets]
    if len(set(sizes)) > 1:
        raise DataError(f"{folder}: the slices of this series have different sizes (rows x columns): {grouped(sizes)}")


def _slice_order(folder: Path, files: list[Path], datasets: list) -> list[int]:
    """Positions of the slices along the slice normal (ImageOrientationPatient x ImagePositionPatient), else by
    InstanceNumber, else by file name; DataError for two slices at one position."""
    try:
        orientation = np.asarray(datasets[0].ImageOrientationPatient, dtype=np.float64)
        normal = np.cross(orientation[:3], orientation[3:])
        keys = [float(np.dot(normal, np.asarray(d.ImagePositionPatient, dtype=np.float64))) for d in datasets]
    except (AttributeError, TypeError, ValueError, IndexError):
        try:
            keys = [float(d.InstanceNumber) for d in datasets]
        except (AttributeError, TypeError, ValueError):
            return list(range(len(files)))
    order = sorted(range(len(files)), key=lambda i: (keys[i], files[i].name))
    repeated = [files[b].name for a, b in zip(order, order[1:]) if keys[a] == keys[b]]
    if repeated:
        raise DataError(
            f"{folder}: {len(repeated)} slice(s) share a position with another slice (ImagePositionPatient "
            f"or InstanceNumber), e.g. {list_rows(repeated, 3)}; a series folder must hold one volume"
        )
    return order


def _series_spacing(datasets: list, order: list[int]) -> tuple[float, float, float]:
    first = datasets[order[0]]
    row, column = _pixel_spacing(first)
    try:
        orientation = np.asarray(first.ImageOrientationPatient, dtype=np.float64)
        normal = np.cross(orientation[:3], orientation[3:])
        positions = [
            float(np.dot(normal, np.asarray(datasets[i].ImagePositionPatient, dtype=np.float64))) for i in order
        ]
        between = float(np.median(np.diff(positions))) if len(positions) > 1 else 0.0
    except (AttributeError, TypeError, ValueError, IndexError):
        between = 0.0
    return column, row, abs(between) or _slice_thickness(first)


def _pixel_spacing(dataset) -> tuple[float, float]:
    """(row spacing, column spacing) in mm; from the shared functional groups of an enhanced file; else 1, 1."""
    spacing = dataset.get("PixelSpacing")
    if spacing is None:
        measures = _shared_measures(dataset)
        spacing = measures.get("PixelSpacing") if measures is not None else None
    try:
        return float(spacing[0]), float(spacing[1])
    except (TypeError, ValueError, IndexError):
        return 1.0, 1.0


def _slice_thickness(dataset) -> float:
    measures = _shared_measures(dataset)
    for source in (dataset, measures):
        for keyword in ("SpacingBetweenSlices", "SliceThickness"):
            value = source.get(keyword) if source is not None else None
            try:
                if value is not None and float(value) > 0:
                    return float(value)
            except (TypeError, ValueError):
                continue
    return 1.0


def _shared_measures(dataset):
    try:
        return dataset.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    except (AttributeError, IndexError, KeyError):
        return None


def _dicom_multiframe(path: Path) -> Volume:
    """A multi-frame DICOM file as a volume: frames in file order along k; one modality LUT for all frames."""
    from pydicom.pixels import apply_modality_lut

    where = f"{path}: cannot read DICOM volume"
    dataset = _dicom_dataset(path, where)
    stored = _dicom_pixels(dataset, where)
    if stored.ndim == 2:
        stored = stored[None]
    if stored.ndim != 3:
        raise DataError(
            f"{where}: pixel data of shape {stored.shape}; a volume needs grey frames (colour is not supported)"
        )
    values = apply_modality_lut(stored, dataset)
    row, column = _pixel_spacing(dataset)
    array = np.transpose(np.asarray(values, dtype=np.float32), (2, 1, 0))  # (frames, rows, cols) -> (i, j, k)
    monochrome1 = str(dataset.get("PhotometricInterpretation", "")).strip() == "MONOCHROME1"
    return Volume(
        array, (column, row, _slice_thickness(dataset)), eight_bit=values.dtype == np.uint8, monochrome1=monochrome1
    )


def volume_intensity(volume: Volume, intensity: str) -> np.ndarray:
    """uint8 volume of the same shape: the intensity setting over the whole volume (not per slice); ``auto`` keeps
    8-bit volumes as they are and clips others to their 0.5-99.5 percentiles. MONOCHROME1 inverted."""
    if volume.eight_bit and parse_intensity(intensity)[0] == "auto":
        unit = volume.array / np.float32(255.0)
    else:
        unit = normalise_intensity(volume.array, intensity)
    if volume.monochrome1:
        unit = 1.0 - unit
    return to_uint8(unit)
