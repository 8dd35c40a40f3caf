"""Hostile files: a site reads the decoded size from a file's header and refuses it above node-config max-image-bytes
before anything is allocated (docs/data.md#input-limits). Every file here is small and made by the test."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, MRImageStorage, generate_uid

from medflower.data import DataError
from medflower.data.readers import (
    DEFAULT_MAX_IMAGE_BYTES,
    check_npz,
    load_volume,
    max_image_bytes,
    read_image,
    read_policy,
)
from medflower.data.roots import site_reads
from medflower.data.segfolder import mask_pixels
from medflower.data.sources import MedmnistSource

SMALL = {"max-image-bytes": 2**20}  # 1 MiB: the declared sizes below stay small even where a check were missing


def nifti_header_only(path: Path, shape: tuple[int, ...], dtype=np.float32) -> Path:
    """A NIfTI file of a header and 4 bytes of data that declares ``shape``."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(dtype)
    header["vox_offset"] = 352
    path.write_bytes(header.binaryblock + b"\0" * 8)
    return path


def dicom_header_only(path: Path, rows: int, columns: int, frames: int = 1) -> Path:
    """A DICOM file declaring rows x columns x frames 16-bit pixels, holding 8 bytes of pixel data."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = MRImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = MRImageStorage, meta.MediaStorageSOPInstanceUID, "MR"
    ds.Rows, ds.Columns, ds.SamplesPerPixel, ds.PhotometricInterpretation = rows, columns, 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    if frames > 1:
        ds.NumberOfFrames = frames
    ds.PixelData = b"\0" * 8
    ds.save_as(path, enforce_file_format=True)
    return path


def assert_names_the_limit(message: str, path: Path, need: int, limit: int = SMALL["max-image-bytes"]) -> None:
    assert str(path) in message and f"{need} bytes" in message and f"limit of {limit} bytes" in message
    assert "node-config max-image-bytes" in message and "--node-config" in message  # and how to raise it


def test_a_nifti_header_declaring_16_gib_is_refused_before_allocating(tmp_path):
    path = nifti_header_only(tmp_path / "bomb.nii", (2048, 2048, 1024))  # float32: 16 GiB
    assert path.stat().st_size < 1024
    with pytest.raises(DataError) as err:
        load_volume(path)  # the default limit, 1 GiB
    assert_names_the_limit(str(err.value), path, 2048 * 2048 * 1024 * 4, DEFAULT_MAX_IMAGE_BYTES)
    with site_reads(SMALL), pytest.raises(DataError, match="max-image-bytes"):
        read_image(nifti_header_only(tmp_path / "slice.nii", (1024, 1024)), 16)  # 4 MiB as float32


def test_a_png_that_decodes_past_the_limit_is_refused_from_its_header(tmp_path):
    path = tmp_path / "bomb.png"
    Image.new("L", (1024, 1024)).save(path, optimize=True)  # 1 MiB of pixels in a few kB; counted at 4 bytes each
    assert path.stat().st_size < 20_000
    with site_reads(SMALL):
        with pytest.raises(DataError) as err:
            read_image(path, 16)
        assert_names_the_limit(str(err.value), path, 1024 * 1024 * 4)
        with pytest.raises(DataError, match="max-image-bytes"):
            mask_pixels(path)  # segmentation masks go through the same open
        small = tmp_path / "small.png"
        Image.new("RGB", (64, 64)).save(small)
        assert read_image(small, 16).shape == (16, 16, 3)  # within the limit: read as before


def test_an_npz_array_past_the_limit_is_refused_from_its_npy_header(tmp_path):
    path = tmp_path / "bombmnist.npz"
    splits = ("train", "val", "test")
    arrays = {f"{s}_images": np.zeros((2048 if s == "train" else 2, 32, 32), np.uint8) for s in splits}
    arrays.update({f"{s}_labels": np.zeros((len(arrays[f"{s}_images"]), 1), np.int64) for s in splits})
    np.savez_compressed(path, **arrays)  # train_images: 2 MiB, compressed to a few kB
    assert path.stat().st_size < 50_000
    with site_reads(SMALL):
        with pytest.raises(DataError) as err:
            MedmnistSource("bombmnist", path)
        assert_names_the_limit(str(err.value), path, 2048 * 32 * 32)
        assert "'train_images'" in str(err.value)
    check_npz(path)  # the default limit: fine
    assert len(MedmnistSource("bombmnist", path).labels) == 2052


def test_dicom_rows_columns_frames_and_bits_are_checked_before_decoding(tmp_path):
    single = dicom_header_only(tmp_path / "big.dcm", 1024, 1024)
    with site_reads(SMALL):
        with pytest.raises(DataError) as err:
            read_image(single, 16)
        assert_names_the_limit(str(err.value), single, 1024 * 1024 * 4)
        frames = dicom_header_only(tmp_path / "frames.dcm", 128, 128, frames=64)
        with pytest.raises(DataError) as err:
            load_volume(frames)
        assert_names_the_limit(str(err.value), frames, 64 * 128 * 128 * 4)


def test_max_image_bytes_is_read_from_the_node_config_and_restored_after(tmp_path):
    assert max_image_bytes({}) == DEFAULT_MAX_IMAGE_BYTES == 2**30
    assert max_image_bytes({"max-image-bytes": 5000}) == 5000
    assert max_image_bytes({"max-image-bytes": "4GiB"}) == 4 * 2**30
    for bad in ("lots", 0, -1, "1.5XB", True):
        with pytest.raises(DataError, match="node-config max-image-bytes"):
            max_image_bytes({"max-image-bytes": bad})
    before = read_policy()
    with site_reads({"max-image-bytes": 123, "data-roots": str(tmp_path)}):
        assert read_policy().max_bytes == 123 and read_policy().roots == (str(tmp_path.resolve()),)
    with site_reads({"data-roots": str(tmp_path)}, own_data=True):
        assert read_policy().roots is None  # a site's own data-path is not confined
    assert read_policy() == before


# ----------------------------------------------------------------------------- run-config sizes
@pytest.mark.parametrize(
    ("key", "value", "valid"),
    [
        ("img-size", 100_000, "[1, 4096]"),
        ("num-classes", 10**7, "[0, 100000]"),
        ("num-rounds", 10**9, "[1, 100000]"),
        ("batch-size", 10**9, "[1, 65536]"),
        ("synthetic-size", 10**9, "[1, 1e+06]"),
        ("lora-rank", 10**6, "[1, 4096]"),
    ],
)
def test_run_config_sizes_have_upper_bounds_naming_key_value_and_range(key, value, valid):
    from medflower.config import ConfigError, ExperimentConfig, defaults

    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_run_config({**defaults(), key: value}, check_paths=False)
    high = valid.strip("[]").split(", ")[1]
    assert str(err.value) == f"run-config '{key}' = {value!r} is invalid: must be <= {high} (valid range {valid})"


def test_a_fedamp_step_that_can_make_self_weights_negative_is_refused_before_round_1():
    from medflower.config import ConfigError, ExperimentConfig, defaults

    run = {**defaults(), "strategy": "fedamp", "fedamp-alpha": 1.0, "min-nodes": 3}
    with pytest.raises(ConfigError, match=r"'fedamp-alpha' = 1.0 is invalid: .* 3 sites .*\(0, 0.5\]"):
        ExperimentConfig.from_run_config(run, check_paths=False)
    ExperimentConfig.from_run_config({**run, "fedamp-alpha": 0.5}, check_paths=False)
    ExperimentConfig.from_run_config({**run, "fedamp-alpha": 0.0}, check_paths=False)  # sigma/(M - 1) per task
