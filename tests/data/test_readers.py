"""Tests of the image readers (medflower/data/readers.py): 16-bit and float images, intensity settings, DICOM pixel
pipeline (modality LUT, VOI, MONOCHROME1), NIfTI, volumes from NIfTI files and DICOM series, csv manifests of DICOM."""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, MRImageStorage, generate_uid

from medflower.data import DataError, DataSpec, load_client_data
from medflower.data.image_datasets import read_rgb
from medflower.data.readers import (
    file_format,
    load_volume,
    normalise_intensity,
    read_image,
    read_volume,
    volume_intensity,
)


def write_dicom(path: Path, pixels: np.ndarray | None, series: str = "1.2.3", **attributes) -> Path:
    """A DICOM Part 10 file of ``pixels`` (uint16 / int16 (H, W), uint8 (H, W, 3), or (frames, H, W)); None = no
    pixel data. ``attributes`` are set on the dataset (e.g. RescaleSlope, WindowCenter, PhotometricInterpretation)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = MRImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = MRImageStorage, meta.MediaStorageSOPInstanceUID
    ds.SeriesInstanceUID, ds.Modality = series, "MR"
    if pixels is not None:
        colour = pixels.ndim == 3 and pixels.shape[-1] == 3 and pixels.dtype == np.uint8
        photometric = "RGB" if colour else attributes.pop("PhotometricInterpretation", "MONOCHROME2")
        bits = 8 if pixels.dtype == np.uint8 else 16
        ds.set_pixel_data(pixels, photometric_interpretation=photometric, bits_stored=bits)
    for name, value in attributes.items():
        setattr(ds, name, value)
    ds.save_as(path, enforce_file_format=True)
    return path


def gradient16(height: int = 4, width: int = 256, top: int = 4095) -> np.ndarray:
    return np.tile(np.linspace(0, top, width).round().astype(np.uint16), (height, 1))


# ----------------------------------------------------------------------------- 16-bit, float, 8-bit


def test_16bit_png_spans_the_full_range_instead_of_saturating(tmp_path):
    path = tmp_path / "xray.png"
    Image.fromarray(gradient16()).save(path)
    assert Image.open(path).mode == "I;16"
    old = np.asarray(Image.open(path).convert("RGB"))  # what PIL's RGB conversion makes of it: mostly white
    assert (old == 255).mean() > 0.9
    out = read_image(path, 256, intensity="minmax")
    assert out.shape == (256, 256, 3) and out.dtype == np.uint8
    row = out[0, :, 0].astype(int)
    assert row[0] == 0 and row[-1] == 255 and np.all(np.diff(row) >= 0) and len(np.unique(row)) > 200
    auto = read_image(path, 256)[0, :, 0].astype(int)  # percentile 0.5-99.5: the full range too
    assert auto[0] == 0 and auto[-1] == 255 and np.all(np.diff(auto) >= 0) and (auto == 255).mean() < 0.02
    assert np.array_equal(out[..., 0], out[..., 2])  # grey in every channel


def test_big_endian_16bit_tiff(tmp_path):
    pixels = gradient16(8, 64)
    path = tmp_path / "b.tif"
    Image.frombytes("I;16B", (64, 8), pixels.astype(">u2").tobytes()).save(path)
    assert np.array_equal(read_image(path, 64, "minmax")[..., 0], read_image_of(tmp_path, pixels, "minmax"))


def read_image_of(folder: Path, pixels: np.ndarray, intensity: str) -> np.ndarray:
    Image.fromarray(pixels).save(folder / "little.png")
    return read_image(folder / "little.png", pixels.shape[1], intensity)[..., 0]


def test_float_tiff(tmp_path):
    values = np.linspace(-1.0, 3.0, 16 * 16, dtype=np.float32).reshape(16, 16)
    path = tmp_path / "f.tif"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode == "F"
    expected = np.rint((values + 1.0) / 4.0 * 255).astype(np.uint8)
    assert np.array_equal(read_image(path, 16, "minmax")[..., 0], expected)
    assert np.array_equal(read_image(path, 16, "none")[..., 0], np.rint(np.clip(values, 0, 255)).astype(np.uint8))
    window = read_image(path, 16, "window:1,2")[..., 0]  # 0 .. 2 -> 0 .. 255
    assert np.array_equal(window, np.rint(np.clip(values / 2.0, 0, 1) * 255).astype(np.uint8))


def test_constant_and_non_finite_images_give_no_nan():
    assert not normalise_intensity(np.full((4, 4), 7.0)).any()
    assert not normalise_intensity(np.full((4, 4), 7.0), "minmax").any()
    values = np.array([[np.nan, 0.0], [1.0, np.inf]])
    out = normalise_intensity(values, "minmax")
    assert np.isfinite(out).all() and out.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_percentile_and_window_settings():
    values = np.arange(1001, dtype=np.float32)  # 0..1000
    pct = normalise_intensity(values, "percentile:10,90")
    assert pct[100] == 0 and pct[900] == 1 and pct[:100].max() == 0 and pct[900:].min() == 1
    assert pct[500] == pytest.approx(0.5)
    win = normalise_intensity(values, "window:400,200")  # 300 .. 500
    assert win[300] == 0 and win[500] == 1 and win[400] == pytest.approx(0.5) and win[:300].max() == 0


def test_8bit_images_are_read_as_before_whatever_the_setting(tmp_path):
    rng = np.random.default_rng(0)
    for name, pixels in (
        ("a.png", rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)),
        ("g.png", rng.integers(0, 256, (30, 20), dtype=np.uint8)),
        ("j.jpg", rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)),
    ):
        Image.fromarray(pixels).save(tmp_path / name)
        with Image.open(tmp_path / name) as image:
            before = np.asarray(image.convert("RGB").resize((16, 16), Image.Resampling.BILINEAR))
        for intensity in ("auto", "minmax", "window:10,20"):
            assert np.array_equal(read_rgb(tmp_path / name, 16, intensity=intensity), before)


def test_unreadable_image_names_the_file(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"not an image")
    with pytest.raises(DataError, match="broken.png: cannot open image"):
        read_image(path, 8)
    with pytest.raises(DataError, match="line 7"):
        read_rgb(path, 8, where="manifest.csv: line 7")


# ----------------------------------------------------------------------------- DICOM


def test_dicom_rescale_slope_and_intercept_through_a_window(tmp_path):
    stored = np.array(
        [[0, 100, 200, 300], [400, 450, 460, 470], [480, 490, 500, 510], [520, 540, 560, 600]], dtype=np.uint16
    )
    path = write_dicom(tmp_path / "ct.dcm", stored, RescaleSlope=2, RescaleIntercept=-1000)
    # modality LUT: 2 * stored - 1000 = -1000 .. 200; the window -100 .. 100 (center 0, width 200) maps to 0 .. 255
    out = read_image(path, 4, intensity="window:0,200")[..., 0]
    expected = np.rint(np.clip((2.0 * stored - 1000 + 100) / 200, 0, 1) * 255).astype(np.uint8)
    assert np.array_equal(out, expected)
    assert out[1, 1] == 0 and out[2, 1] == 102 and out[2, 3] == 153 and out[3, 3] == 255  # -100, -20, 20, 200 HU


def test_dicom_window_of_the_file_is_used_under_auto(tmp_path):
    stored = np.arange(0, 2000, 125, dtype=np.uint16).reshape(4, 4)  # 0 .. 1875
    path = write_dicom(tmp_path / "w.dcm", stored, WindowCenter=1000, WindowWidth=501)
    out = read_image(path, 4)[..., 0]
    # DICOM linear VOI (PS3.3 C.11.2.1.2): c' = 999.5, w' = 500 -> 749.5 .. 1249.5 maps to 0 .. 1
    c, w = 999.5, 500.0
    expected = np.rint(np.clip((stored - c) / w + 0.5, 0, 1) * 255).astype(np.uint8)
    expected[stored <= c - w / 2] = 0
    expected[stored > c + w / 2] = 255
    assert np.array_equal(out, expected)
    assert len(np.unique(out)) > 4  # a window, not the percentile range
    no_window = read_image(write_dicom(tmp_path / "n.dcm", stored), 4)[..., 0]
    assert no_window[0, 0] == 0 and no_window[-1, -1] == 255 and not np.array_equal(no_window, out)


def test_monochrome1_is_inverted(tmp_path):
    stored = np.arange(16, dtype=np.uint16).reshape(4, 4) * 100
    two = read_image(write_dicom(tmp_path / "m2.dcm", stored), 4, intensity="minmax")[..., 0]
    one = read_image(
        write_dicom(tmp_path / "m1.dcm", stored, PhotometricInterpretation="MONOCHROME1"), 4, intensity="minmax"
    )[..., 0]
    assert two[0, 0] == 0 and two[-1, -1] == 255
    assert np.array_equal(one, 255 - two)


def test_dicom_without_pixel_data_is_an_error_naming_the_file(tmp_path):
    path = write_dicom(tmp_path / "report.dcm", None)
    with pytest.raises(DataError, match=r"report\.dcm.*no pixel data"):
        read_image(path, 8)


def test_multiframe_dicom_as_an_image_points_to_volumes(tmp_path):
    path = write_dicom(tmp_path / "cine.dcm", np.zeros((3, 4, 4), np.uint16), NumberOfFrames=3)
    with pytest.raises(DataError, match=r"cine\.dcm.*multi-frame.*volumes:"):
        read_image(path, 8)
    array, _ = read_volume(path)
    assert array.shape == (4, 4, 3)


def test_dicom_found_by_preamble_and_colour_dicom(tmp_path):
    stored = np.arange(16, dtype=np.uint16).reshape(4, 4)
    path = write_dicom(tmp_path / "IM0001", stored)  # no extension: the 'DICM' preamble tells
    assert file_format(path) == "dicom"
    assert read_image(path, 4, "minmax")[-1, -1, 0] == 255
    rgb = np.zeros((4, 4, 3), np.uint8)
    rgb[..., 0], rgb[..., 2] = 200, 50
    out = read_image(write_dicom(tmp_path / "colour.dcm", rgb), 4)
    assert np.array_equal(out, rgb)


# ----------------------------------------------------------------------------- NIfTI


def test_nifti_2d_and_one_slice_3d(tmp_path):
    pixels = np.arange(12, dtype=np.int16).reshape(3, 4) * 10
    for name, data in (("flat.nii.gz", pixels), ("slab.nii", pixels[:, :, None])):
        nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / name)
        out = read_image(tmp_path / name, 4, "minmax")[..., 0]
        assert out.shape == (4, 4) and out[0, 0] == 0 and out[-1, -1] == 255
    nib.save(nib.Nifti1Image(np.zeros((3, 4, 5), np.int16), np.eye(4)), tmp_path / "vol.nii.gz")
    with pytest.raises(DataError, match=r"vol\.nii\.gz.*more than one slice.*volumes:"):
        read_image(tmp_path / "vol.nii.gz", 4)


def test_nifti_volume_keeps_axes_spacing_and_scaling(tmp_path):
    data = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    image = nib.Nifti1Image(data, np.diag([0.5, 0.6, 3.0, 1.0]))
    image.header.set_slope_inter(2.0, -5.0)
    nib.save(image, tmp_path / "v.nii.gz")
    array, spacing = read_volume(tmp_path / "v.nii.gz")
    assert array.dtype == np.float32 and array.shape == (2, 3, 4)
    assert np.array_equal(array, data * 2.0 - 5.0)
    assert spacing == pytest.approx((0.5, 0.6, 3.0))
    eight = tmp_path / "u8.nii.gz"
    nib.save(nib.Nifti1Image(np.full((2, 2, 2), 7, np.uint8), np.eye(4)), eight)
    assert load_volume(eight).eight_bit and (volume_intensity(load_volume(eight), "auto") == 7).all()


# ----------------------------------------------------------------------------- DICOM series


def write_series(folder: Path, volume: np.ndarray, names: list[str] | None = None, **attributes) -> None:
    """One DICOM file per slice volume[:, :, k] (i = column, j = row), at z = 2.5 * k mm; files named by ``names``."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(volume.shape[2]):
        name = names[k] if names else f"slice{k:03d}.dcm"
        write_dicom(
            folder / name,
            np.ascontiguousarray(volume[:, :, k].T),
            ImageOrientationPatient=[1, 0, 0, 0, 1, 0],
            ImagePositionPatient=[0, 0, 2.5 * k],
            PixelSpacing=[0.7, 0.8],
            InstanceNumber=k + 1,
            **attributes,
        )


def test_dicom_series_is_ordered_by_position_not_by_file_name(tmp_path):
    volume = np.arange(3 * 4 * 5, dtype=np.uint16).reshape(3, 4, 5) * 7
    shuffled = ["e.dcm", "b.dcm", "d.dcm", "a.dcm", "c.dcm"]  # slice k is written to shuffled[k]
    write_series(tmp_path / "case", volume, shuffled, RescaleSlope=1, RescaleIntercept=-100)
    array, spacing = read_volume(tmp_path / "case")
    assert array.shape == (3, 4, 5)
    assert np.array_equal(array, volume - 100.0)
    assert spacing == pytest.approx((0.8, 0.7, 2.5))  # (column spacing, row spacing, slice distance)
    (tmp_path / "case" / "notes.txt").write_text("not DICOM")  # other files in the folder are ignored
    assert np.array_equal(read_volume(tmp_path / "case")[0], array)


def test_dicom_series_with_mixed_sizes_or_series_is_an_error(tmp_path):
    write_series(tmp_path / "mixed", np.zeros((4, 4, 2), np.uint16))
    write_dicom(
        tmp_path / "mixed" / "odd.dcm",
        np.zeros((6, 4), np.uint16),
        ImagePositionPatient=[0, 0, 9],
        ImageOrientationPatient=[1, 0, 0, 0, 1, 0],
    )
    with pytest.raises(DataError, match=r"mixed: the slices of this series have different sizes") as error:
        read_volume(tmp_path / "mixed")
    assert "4x4: 2 file(s)" in str(error.value) and "6x4: 1 file(s) (odd.dcm)" in str(error.value)
    write_series(tmp_path / "two", np.zeros((4, 4, 2), np.uint16))
    write_dicom(tmp_path / "two" / "other.dcm", np.zeros((4, 4), np.uint16), series="9.9.9")
    with pytest.raises(DataError, match=r"two.*2 DICOM series"):
        read_volume(tmp_path / "two")
    shutil.rmtree(tmp_path / "two")
    (tmp_path / "two").mkdir()
    with pytest.raises(DataError, match="no DICOM files"):
        read_volume(tmp_path / "two")


# ----------------------------------------------------------------------------- csv manifests


def test_csv_manifest_of_dicom_xrays_loads_for_classification(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for i in range(24):
        pixels = (gradient16(20, 20, 1000) + rng.integers(0, 50, (20, 20)) + 3000 * (i % 2)).astype(np.uint16)
        write_dicom(tmp_path / f"x{i:02d}.dcm", pixels, RescaleSlope=1, RescaleIntercept=0)
        rows.append(f"x{i:02d}.dcm,{['normal', 'pneumonia'][i % 2]}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    spec = DataSpec(dataset=f"csv:{tmp_path / 'manifest.csv'}", partition="iid", img_size=16, intensity="minmax")
    client = load_client_data(spec, 0, 1)
    assert client.task == "classification" and client.class_names == ["normal", "pneumonia"]
    image, label = client.train[0]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8 and label in (0, 1)
    assert image.max() > 230 and image.min() < 25  # minmax of each image: not saturated
    assert client.train.intensity == "minmax"
