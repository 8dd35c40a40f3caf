"""Segmentation folders with nested structures: mask value maps, masks-<structure>/ folders, split.csv and
groups.csv, NIfTI masks and .nii.gz / .dcm pairing (docs/data.md#masks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflower.data import DataError, DataSpec, describe_source, load_client_data
from medflower.data import segfolder as sf
from medflower.data.maskmap import parse_mask_values
from medflower.data.sources import SegFolderSource, source_key

REFUGE = "0=disc+cup,128=disc,255="
SIZE = 16


def fundus_mask(shift: int = 0) -> np.ndarray:
    """REFUGE coding: 255 background, 128 the disc rim, 0 the cup inside it."""
    mask = np.full((SIZE, SIZE), 255, np.uint8)
    mask[3 + shift : 13 + shift, 3:13] = 128
    mask[6 + shift : 10 + shift, 6:10] = 0
    return mask


def write_image(path: Path, value: int = 90) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((SIZE, SIZE, 3), value, np.uint8)).save(path)


def write_mask(path: Path, mask: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(mask).save(path)


def refuge_site(folder: Path, count: int = 4) -> Path:
    for i in range(count):
        write_image(folder / "images" / f"f{i}.jpg", 40 + 20 * i)
        write_mask(folder / "masks" / f"f{i}.bmp", fundus_mask(i % 3))
    return folder


def drishti_site(folder: Path, count: int = 4, cup_missing: int | None = None) -> Path:
    """images/, masks-disc/, masks-cup/ (0/255 each), the cup inside the disc."""
    for i in range(count):
        mask = fundus_mask(i % 3)
        write_image(folder / "images" / f"d{i}.png", 40 + 20 * i)
        write_mask(folder / "masks-disc" / f"d{i}.png", np.where(mask < 255, 255, 0).astype(np.uint8))
        if i != cup_missing:
            write_mask(folder / "masks-cup" / f"d{i}_mask.png", np.where(mask == 0, 255, 0).astype(np.uint8))
    return folder


def spec_of(root: Path, **fields) -> DataSpec:
    return DataSpec(**{"dataset": f"segfolder:{root}", "partition": "iid", "img_size": SIZE, **fields})


# ---------------------------------------------------------------- value maps


def test_refuge_value_map_gives_the_full_disc_and_the_cup(tmp_path):
    root = refuge_site(tmp_path / "refuge")
    source = SegFolderSource(root, REFUGE)
    assert source.class_names == ("disc", "cup") and source.labels.tolist() == [1, 1, 1, 1]
    spec = spec_of(root, mask_values=REFUGE)
    image, planes = source.dataset(np.arange(4), 0, spec)[0]
    assert image.shape == (SIZE, SIZE, 3) and planes.shape == (2, SIZE, SIZE) and planes.dtype == np.uint8
    written = fundus_mask(0)
    np.testing.assert_array_equal(planes[0], (written < 255).astype(np.uint8))  # disc = rim + cup
    np.testing.assert_array_equal(planes[1], (written == 0).astype(np.uint8))
    assert np.all(planes[1] <= planes[0])  # nested
    # resized: each plane nearest on its own
    small = source.dataset(np.arange(4), 0, spec_of(root, mask_values=REFUGE, img_size=8))[0][1]
    assert small.shape == (2, 8, 8) and set(np.unique(small).tolist()) == {0, 1}
    # a lossy JPEG mask: each pixel takes the nearest listed value instead of failing on JPEG noise
    big = np.kron(fundus_mask(), np.ones((4, 4), np.uint8))
    write_mask(tmp_path / "lossy.jpg", big)
    planes = sf.read_mask(tmp_path / "lossy.jpg", parse_mask_values(REFUGE))
    assert (planes[0] == (big < 255)).mean() > 0.97 and (planes[1] == (big == 0)).mean() > 0.97


def test_a_value_outside_the_map_names_the_file_and_the_value(tmp_path):
    root = refuge_site(tmp_path / "refuge")
    mask = fundus_mask()
    mask[0, 0] = 7
    write_mask(root / "masks" / "f1.bmp", mask)
    with pytest.raises(
        DataError,
        match=r"1 mask\(s\) with bad values: masks/f1.bmp \(values \{0, 7, 128, 255\}; "
        r"not in the map: \{7\}\); every value must be listed in run-config mask-values",
    ):
        SegFolderSource(root, REFUGE)
    with pytest.raises(DataError, match=r"f1.bmp: mask value\(s\) \{7\} are not in run-config mask-values"):
        sf.read_mask(root / "masks" / "f1.bmp", parse_mask_values(REFUGE))


def test_without_a_map_0_128_255_is_still_refused_and_points_to_mask_values(tmp_path):
    root = refuge_site(tmp_path / "refuge")
    with pytest.raises(
        DataError,
        match=r"4 mask\(s\) with bad values: masks/f0.bmp \(values \{0, 128, 255\}\).*"
        r"set run-config mask-values .*'0=disc\+cup,128=disc,255='",
    ):
        describe_source(spec_of(root))
    with pytest.raises(DataError, match=r"f0.bmp: mask values \{0, 128, 255\} are neither binary .*mask-values"):
        sf.read_mask(root / "masks" / "f0.bmp")


def test_a_source_opened_without_the_map_refuses_a_spec_with_one(tmp_path):
    """The map decides the classes when the source opens; a spec naming another map must not reuse it."""
    root = refuge_site(tmp_path / "refuge")
    write_mask(root / "masks" / "f0.bmp", np.where(fundus_mask() < 255, 255, 0).astype(np.uint8))
    for i in range(1, 4):
        write_mask(root / "masks" / f"f{i}.bmp", np.zeros((SIZE, SIZE), np.uint8))
    source = SegFolderSource(root)
    assert source.class_names == ("foreground",) and source.labels.tolist() == [1, 0, 0, 0]
    with pytest.raises(DataError, match="opened with mask-values '' but the spec has '0=,255=disc'"):
        source.dataset(np.arange(4), 0, spec_of(root, mask_values="0=,255=disc"))


def test_nifti_label_map_through_a_value_map(tmp_path):
    nib = pytest.importorskip("nibabel")
    labels = np.zeros((SIZE, SIZE), np.int16)
    labels[2:8, 2:8], labels[9:14, 9:14] = 1, 2
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(labels[..., None], np.eye(4)), str(path))  # 2-D slice stored as (H, W, 1)
    zones = sf.read_mask(path, parse_mask_values("0=,1=peripheral,2=transition"))
    np.testing.assert_array_equal(zones, np.stack([labels == 1, labels == 2]).astype(np.uint8))
    gland = sf.read_mask(path, parse_mask_values("0=,1=prostate,2=prostate"))
    np.testing.assert_array_equal(gland[0], (labels > 0).astype(np.uint8))
    np.testing.assert_array_equal(sf.read_mask(path), labels.astype(np.uint8))  # class indices without a map
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 3), np.int16), np.eye(4)), str(tmp_path / "vol.nii"))
    with pytest.raises(DataError, match=r"vol.nii: NIfTI mask: .*\(4, 4, 3\) has more than one slice"):
        sf.read_mask(tmp_path / "vol.nii")


def test_nii_gz_and_dcm_images_pair_by_their_stem(tmp_path):
    assert (sf.file_stem(Path("a.nii.gz")), sf.file_stem(Path("b.NII")), sf.file_stem(Path("c.dcm"))) == ("a", "b", "c")
    site = tmp_path / "site"
    for name in ("a.nii.gz", "b.dcm", "c.png"):
        (site / "images").mkdir(parents=True, exist_ok=True)
        (site / "images" / name).write_bytes(b"")
    for name in ("a.nii.gz", "b_seg.png", "c.nii"):
        (site / "masks").mkdir(parents=True, exist_ok=True)
        (site / "masks" / name).write_bytes(b"")
    pairs = sf.pair_site(site)
    assert [(image.name, masks[0].name) for image, masks in pairs] == [
        ("a.nii.gz", "a.nii.gz"),
        ("b.dcm", "b_seg.png"),
        ("c.png", "c.nii"),
    ]


def write_dicom(path: Path, pixels: np.ndarray) -> None:
    """A minimal 12-bit MONOCHROME2 DICOM file (secondary capture) holding ``pixels``."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID, "OT"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def test_dicom_and_nifti_images_with_their_masks(tmp_path):
    """A DICOM image with a PNG mask and a NIfTI image with a NIfTI label map: the mask lies on the image."""
    nib = pytest.importorskip("nibabel")
    pytest.importorskip("pydicom")
    labels = np.zeros((SIZE, SIZE), np.uint8)
    labels[2:7, 3:12], labels[9:14, 5:9] = 1, 2
    scan = (300 + 1500 * (labels > 0) + 700 * (labels == 2)).astype(np.uint16)  # 12-bit intensities
    site = tmp_path / "prostate"
    write_dicom(site / "images" / "case1.dcm", scan)
    write_mask(site / "masks" / "case1.png", labels)
    nib.save(nib.Nifti1Image(scan.astype(np.int16), np.eye(4)), str(site / "images" / "case2.nii.gz"))
    nib.save(nib.Nifti1Image(labels.astype(np.int16), np.eye(4)), str(site / "masks" / "case2.nii.gz"))
    zones = "0=,1=peripheral,2=transition"
    source = SegFolderSource(site, zones)
    assert source.class_names == ("peripheral", "transition") and len(source) == 2
    dataset = source.dataset(np.arange(2), 0, spec_of(site, mask_values=zones, intensity="minmax"))
    for image, planes in (dataset[0], dataset[1]):
        assert image.shape == (SIZE, SIZE, 3) and planes.shape == (2, SIZE, SIZE)
        np.testing.assert_array_equal(planes[1], (labels == 2).astype(np.uint8))
        grey = image[..., 0].astype(int)
        assert grey[labels == 2].min() > grey[labels == 1].max() > grey[labels == 0].max()


# ---------------------------------------------------------------- masks-<structure>/ folders


def test_structure_folders_give_one_plane_each_with_the_cup_nested(tmp_path):
    root = tmp_path / "fed"
    drishti_site(root / "drishti-a")
    drishti_site(root / "drishti-b", count=5)
    spec = DataSpec(dataset=f"segfolder:{root}", partition="natural", img_size=SIZE, test_fraction=0.25)
    assert describe_source(spec) == (2, ["cup", "disc"])  # sorted folder names
    client = load_client_data(spec, 0, 2)
    assert client.site == "drishti-a" and client.class_names == ["cup", "disc"]
    image, planes = client.train[0]
    assert planes.shape == (2, SIZE, SIZE) and planes.dtype == np.uint8
    assert planes[0].sum() > 0 and np.all(planes[0] <= planes[1])  # the cup lies inside the disc
    stem = sf.file_stem(client.train.image_paths[0])
    written = fundus_mask(int(stem[1:]) % 3)
    np.testing.assert_array_equal(planes[1], (written < 255).astype(np.uint8))
    # every mask folder counts in the source's identity
    before = source_key(spec)
    write_mask(root / "drishti-a" / "masks-cup" / "d0_mask.png", np.zeros((SIZE, SIZE), np.uint8))
    assert source_key(spec) != before


def test_structure_folder_errors(tmp_path):
    site = drishti_site(tmp_path / "one", cup_missing=2)
    assert sf.has_layout(site) and not sf.has_layout(site / "images")
    with pytest.raises(DataError, match=r"one: unpaired files \(1 image\(s\) without a mask in masks-cup/: d2.png\)"):
        describe_source(spec_of(site))
    site = drishti_site(tmp_path / "grey")
    write_mask(site / "masks-cup" / "d1_mask.png", np.full((SIZE, SIZE), 128, np.uint8))
    with pytest.raises(DataError, match=r"masks-cup/d1_mask.png \(values \{128\}\).*must be binary"):
        describe_source(spec_of(site))
    site = drishti_site(tmp_path / "both")
    write_mask(site / "masks" / "d0.png", np.zeros((SIZE, SIZE), np.uint8))
    with pytest.raises(DataError, match="has both masks/ and masks-cup/, masks-disc/"):
        describe_source(spec_of(site))
    root = tmp_path / "mixed"
    drishti_site(root / "a")
    refuge_site(root / "b")
    with pytest.raises(DataError, match=r"different mask folders \(a: cup, disc; b: masks/\)"):
        describe_source(spec_of(root))
    with pytest.raises(DataError, match="masks are in masks-<structure>/ folders .*leave mask-values empty"):
        SegFolderSource(drishti_site(tmp_path / "mapped"), REFUGE)


# ---------------------------------------------------------------- split.csv, groups.csv


def test_split_and_groups_files_are_honoured(tmp_path):
    root = tmp_path / "fed"
    for site in ("a", "b"):
        drishti_site(root / site, count=6)
    (root / "a" / "split.csv").write_text("stem,split\nd0,test\nd1,TEST\nd2,val\nd3,val\nd4,train\n")
    (root / "groups.csv").write_text(
        "stem,group,site\n" + "".join(f"d{i},patient-{i // 2},{site}\n" for site in ("a", "b") for i in range(6))
    )
    source = SegFolderSource(root)
    assert source.splits.tolist() == ["test", "test", "val", "val", "train", ""] + [""] * 6
    assert source.groups.tolist()[:3] == ["a/patient-0", "a/patient-0", "a/patient-1"]
    assert source.groups.tolist()[6] == "b/patient-0"  # the same name on another site is another patient
    spec = DataSpec(dataset=f"segfolder:{root}", partition="natural", img_size=SIZE, val_fraction=0.2)
    client = load_client_data(spec, 0, 2)
    names = {split: sorted(p.name for p in getattr(client, split).image_paths) for split in ("train", "val", "test")}
    assert names["test"] == ["d0.png", "d1.png"] and names["val"] == ["d2.png", "d3.png"]
    assert names["train"] == ["d4.png", "d5.png"]  # d5 has no split but its patient is in train
    before = source_key(spec)  # the csv files count in the source's identity
    (root / "a" / "split.csv").write_text("stem,split\nd0,test\nd1,test\n")
    assert source_key(spec) != before


def test_a_site_without_groups_csv_beside_one_with_it_has_one_group_per_image(tmp_path):
    """Fed-Polyp: CVC-ClinicDB's video sequences in its groups.csv, Kvasir-SEG without one (one image per group)."""
    root = tmp_path / "fed"
    drishti_site(root / "a", count=4)
    drishti_site(root / "b", count=3)
    (root / "a" / "groups.csv").write_text("stem,group\nd0,v1\nd1,v1\nd2,v2\nd3,v2\n")
    assert SegFolderSource(root).groups.tolist() == [
        "a/v1",
        "a/v1",
        "a/v2",
        "a/v2",
        "b/image:d0",
        "b/image:d1",
        "b/image:d2",
    ]


def test_split_and_groups_file_errors(tmp_path):
    site = drishti_site(tmp_path / "s", count=3)
    (site / "groups.csv").write_text("stem,group\nd0,p1\n")
    with pytest.raises(DataError, match=r"2 image\(s\) have no row in groups.csv .*: s/d1, s/d2"):
        SegFolderSource(site)
    (site / "groups.csv").write_text("stem,group\nd0,p1\nd1,p1\nd2,p2\nghost,p3\n")
    with pytest.raises(DataError, match=r"groups.csv: 1 row\(s\) name no image of site s .*line 5 \('ghost'\)"):
        SegFolderSource(site)
    (site / "groups.csv").unlink()
    (site / "split.csv").write_text("stem,split\nd0,holdout\n")
    with pytest.raises(DataError, match=r"split must be train, val, test or empty in 1 row\(s\): line 2 \('holdout'\)"):
        SegFolderSource(site)
    (site / "split.csv").write_text("name,split\nd0,test\n")
    with pytest.raises(DataError, match="missing column\\(s\\) stem; expected stem,split"):
        SegFolderSource(site)
    root = tmp_path / "two"
    drishti_site(root / "a", count=2)
    drishti_site(root / "b", count=2)
    (root / "split.csv").write_text("stem,split\nd0,test\n")
    with pytest.raises(
        DataError,
        match=r"stem\(s\) are images of several sites; add a site column: line 2 "
        r"\('d0': a, b\)",
    ):
        SegFolderSource(root)
