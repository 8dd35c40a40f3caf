"""Tests of volume folders (medflower/data/volumes.py, dataset 'volumes:<root>'): slicing along each axis, pairing,
label checks, empty-slice policy, case groups, cases.csv sites and splits, mask value maps, DICOM series cases."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from test_readers import write_series

from medflower.data import DataError, DataSpec, describe_source, load_client_data
from medflower.data.partition import partition_rows
from medflower.data.sources import open_source, source_key
from medflower.data.volumes import VolumeSource, list_files


def save_nifti(path: Path, data: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.eye(4)), path)
    return path


def labelled_case(shape=(8, 8, 6), foreground=(2, 3), seed=0) -> tuple[np.ndarray, np.ndarray]:
    """(int16 image, uint8 label map) with foreground (1, and 2 inside it) in slices ``foreground`` of axis 2."""
    image = np.random.default_rng(seed).integers(0, 2000, shape).astype(np.int16)
    labels = np.zeros(shape, np.uint8)
    for k in foreground:
        labels[2:6, 2:6, k] = 1
        labels[3:5, 3:5, k] = 2
    return image, labels


def write_root(
    root: Path, cases: dict[str, tuple[np.ndarray, np.ndarray]], mask_suffix: str = "", table: str | None = None
) -> Path:
    for case, (image, labels) in cases.items():
        save_nifti(root / "images" / f"{case}.nii.gz", image)
        save_nifti(root / "masks" / f"{case}{mask_suffix}.nii.gz", labels)
    if table is not None:
        (root / "cases.csv").write_text(table)
    return root


def spec_of(root: Path, **fields) -> DataSpec:
    return DataSpec(**{"dataset": f"volumes:{root}", "partition": "iid", "img_size": 8, **fields})


def test_slices_along_each_axis_hold_the_volume_content(tmp_path):
    cube = (np.arange(8**3) % 251).astype(np.uint8).reshape(8, 8, 8)  # uint8: intensity 'auto' keeps values
    labels = np.zeros_like(cube)
    labels[1:7, 1:7, 1:7] = 1
    root = write_root(tmp_path / "cube", {"c": (cube, labels)})
    for axis in (0, 1, 2):
        source = open_source(spec_of(root, slice_axis=axis))
        assert len(source) == 8 and source.slice_index.tolist() == list(range(8))
        images = source.dataset(np.arange(8), 0, spec_of(root, slice_axis=axis)).images
        for k in (0, 3, 7):
            assert np.array_equal(images[k, ..., 0], np.take(cube, k, axis=axis))
            assert np.array_equal(images[k, ..., 2], np.take(cube, k, axis=axis))
            assert np.array_equal(source.masks[k], np.take(labels, k, axis=axis))
        assert source.labels.tolist() == [0, 1, 1, 1, 1, 1, 1, 0]


def test_number_of_slices_follows_the_axis_and_images_are_resized(tmp_path):
    image, labels = labelled_case(shape=(6, 10, 4), foreground=(1,))
    root = write_root(tmp_path / "v", {"a": (image, labels)}, mask_suffix="_seg")
    for axis, count in ((0, 6), (1, 10), (2, 4)):
        source = open_source(spec_of(root, slice_axis=axis, img_size=12))
        assert len(source) == count and source.gray.shape == (count, 12, 12) and source.masks.shape == (count, 12, 12)
        assert set(np.unique(source.masks)) <= {0, 1, 2}
    spec = spec_of(root, img_size=12)
    item = source.dataset(np.arange(4), 0, spec)[1]
    assert item[0].shape == (12, 12, 3) and item[0].dtype == np.uint8 and item[1].dtype == np.uint8


def test_intensity_is_set_per_volume_not_per_slice(tmp_path):
    image = np.zeros((4, 4, 2), np.int16)
    image[..., 0], image[..., 1] = 100, 1000  # two constant slices: per slice both would be black
    labels = np.ones((4, 4, 2), np.uint8)
    root = write_root(tmp_path / "i", {"a": (image, labels)})
    gray = open_source(spec_of(root, img_size=4, intensity="minmax")).gray
    assert (gray[0] == 0).all() and (gray[1] == 255).all()
    window = open_source(spec_of(root, img_size=4, intensity="window:550,900")).gray  # 100 .. 1000
    assert (window[0] == 0).all() and (window[1] == 255).all()


def test_label_volume_of_another_shape_names_both_files(tmp_path):
    root = tmp_path / "bad"
    save_nifti(root / "images" / "a.nii.gz", np.zeros((4, 4, 3), np.int16))
    save_nifti(root / "masks" / "a.nii.gz", np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(
        DataError,
        match=r"masks/a\.nii\.gz: label volume of shape \(4, 4, 2\) does not match its "
        r"image .*images/a\.nii\.gz of shape \(4, 4, 3\)",
    ):
        open_source(spec_of(root))


def test_fractional_label_values_are_an_error(tmp_path):
    root = tmp_path / "frac"
    save_nifti(root / "images" / "a.nii.gz", np.zeros((4, 4, 3), np.int16))
    save_nifti(root / "masks" / "a.nii.gz", np.full((4, 4, 3), 0.5, np.float32))
    with pytest.raises(DataError, match=r"a\.nii\.gz: label values must be whole numbers.*0\.5"):
        open_source(spec_of(root))


def test_unpaired_volumes_are_listed(tmp_path):
    root = tmp_path / "unpaired"
    image, labels = labelled_case()
    save_nifti(root / "images" / "a.nii.gz", image)
    save_nifti(root / "images" / "b.nii", image)
    save_nifti(root / "masks" / "a_mask.nii.gz", labels)
    save_nifti(root / "masks" / "z.nii.gz", labels)
    with pytest.raises(DataError, match=r"without a label volume in masks/: b;.*without an image in images/: z"):
        open_source(spec_of(root))


def test_empty_slice_policy(tmp_path):
    # 10 slices per case, 2 with foreground: keep = 10, drop = 2, keep:0.5 = 2 + 4
    cases = {f"case{c}": labelled_case(shape=(8, 8, 10), foreground=(4, 5), seed=c) for c in range(3)}
    root = write_root(tmp_path / "e", cases)
    counts = {policy: len(open_source(spec_of(root, empty_slices=policy))) for policy in ("keep", "drop", "keep:0.5")}
    assert counts == {"keep": 30, "drop": 6, "keep:0.5": 18}
    half = open_source(spec_of(root, empty_slices="keep:0.5"))
    assert half.labels.sum() == 6 and (half.labels == 0).sum() == 12
    again = VolumeSource(root, 8, empty_slices="keep:0.5")  # the same seeded choice in every process
    assert np.array_equal(again.slice_index, half.slice_index)
    other_seed = VolumeSource(root, 8, empty_slices="keep:0.5", seed=1)
    assert not np.array_equal(other_seed.slice_index, half.slice_index)
    assert source_key(spec_of(root, empty_slices="drop")) != source_key(spec_of(root))  # rows differ: key differs


def test_every_slice_carries_its_case_as_group(tmp_path):
    cases = {name: labelled_case(seed=i) for i, name in enumerate(("p1", "p2", "p3"))}
    source = open_source(spec_of(write_root(tmp_path / "g", cases)))
    assert source.groups.tolist() == ["p1"] * 6 + ["p2"] * 6 + ["p3"] * 6
    assert source.row_name(7) == "p2 slice 1"
    assert source.sites(2) is None and source.splits is None
    assert source.task == "segmentation" and source.class_names == ("class-1", "class-2")


def test_cases_table_gives_sites_and_splits(tmp_path):
    cases = {f"case{c}": labelled_case(seed=c) for c in range(4)}
    table = "case,site,split,dims\ncase0,A,train,x\ncase1,A,test,x\ncase2,B,train,x\ncase3,B,val,x\n"
    root = write_root(tmp_path / "t", cases, table=table)
    source = open_source(spec_of(root))
    assert source.sites(2).tolist() == ["A"] * 12 + ["B"] * 12
    assert source.splits.tolist() == ["train"] * 6 + ["test"] * 6 + ["train"] * 6 + ["val"] * 6
    partitioning = partition_rows(spec_of(root, partition="natural"), 2)
    assert partitioning.sites == ("A", "B")
    assert set(source.cases[partitioning.rows[1]]) == {"case2", "case3"}
    client = load_client_data(spec_of(root, partition="natural"), 0, 2)
    assert client.site == "A" and len(client.train) == 6 and len(client.test) == 6 and len(client.val) == 0


def test_cases_table_must_match_the_folders(tmp_path):
    cases = {f"case{c}": labelled_case(seed=c) for c in range(2)}
    root = write_root(tmp_path / "m", cases, table="case,site\ncase0,A\nghost,B\n")
    with pytest.raises(
        DataError,
        match=r"cases\.csv.*have no files in images/ and masks/: ghost.*have no row in the "
        r"table: case1",
    ):
        open_source(spec_of(root))
    (root / "cases.csv").write_text("name,site\ncase0,A\n")
    with pytest.raises(DataError, match="no 'case' column"):
        open_source(spec_of(root))


def test_mask_values_give_planes_per_structure(tmp_path):
    root = write_root(tmp_path / "mv", {"a": labelled_case()})
    spec = spec_of(root, mask_values="0=,1=gland,2=gland+zone")
    source = open_source(spec)
    assert source.class_names == ("gland", "zone") and source.masks.shape == (6, 2, 8, 8)
    gland, zone = source.masks[2]
    assert gland.sum() == 16 and zone.sum() == 4 and (zone <= gland).all()
    assert describe_source(spec) == (2, ["gland", "zone"])
    with pytest.raises(DataError, match=r"mask value\(s\) \{2\} are not in run-config mask-values"):
        open_source(spec_of(root, mask_values="0=,1=gland"))


def test_a_volumes_spec_loads_through_load_client_data(tmp_path):
    cases = {f"case{c}": labelled_case(seed=c) for c in range(4)}
    root = write_root(tmp_path / "l", cases)
    client = load_client_data(spec_of(root, img_size=16), 1, 2)
    assert client.task == "segmentation" and client.class_names == ["class-1", "class-2"] and client.num_classes == 2
    image, mask = client.train[0]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8 and mask.shape == (16, 16)
    other = load_client_data(spec_of(root, img_size=16), 0, 2)
    sizes = [sum(len(d) for d in (c.train, c.val, c.test)) for c in (client, other)]
    assert sum(sizes) == 24 and min(sizes) > 0  # 4 cases x 6 slices over the two sites


def test_a_dicom_series_case_with_a_nifti_mask(tmp_path):
    root = tmp_path / "dcm"
    volume = (np.arange(6 * 6 * 4) * 10).astype(np.uint16).reshape(6, 6, 4)
    write_series(root / "images" / "patient1", volume, names=[f"{n}.dcm" for n in "dbca"])
    labels = np.zeros((6, 6, 4), np.uint8)
    labels[1:4, 2:5, 2] = 1
    save_nifti(root / "masks" / "patient1.nii.gz", labels)
    source = open_source(spec_of(root, img_size=6, intensity="minmax", empty_slices="drop"))
    assert len(source) == 1 and source.slice_index.tolist() == [2] and source.class_names == ("foreground",)
    expected = np.rint(volume[:, :, 2] / volume.max() * 255).astype(np.uint8)
    assert np.array_equal(source.gray[0], expected)
    assert np.array_equal(source.masks[0], labels[:, :, 2])
    assert (root / "images" / "patient1" / "a.dcm") in list_files(root)
