"""Tests of volume folders (medflower/data/volumes.py, dataset 'volumes:<root>'): slicing along each axis, pairing,
label checks, empty-slice policy, case groups, cases.csv sites and splits, mask value maps, DICOM series cases, and
the decoded rows kept in the site's cache folder."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from test_readers import write_series

from medflower.data import DataError, DataSpec, describe_source, load_client_data
from medflower.data import volumes as volumes_module
from medflower.data.partition import partition_rows
from medflower.data.sources import open_source, open_source_by_key, source_key
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


def count_volume_reads(monkeypatch, refuse: bool = False) -> list:
    """Replace the volume reader of volumes.py: every call is counted (and, with ``refuse``, fails the test)."""
    calls = []
    read = volumes_module.load_volume

    def counted(path, *args, **kwargs):
        if refuse:
            raise AssertionError(f"a volume was read: {path}")
        calls.append(path)
        return read(path, *args, **kwargs)

    monkeypatch.setattr(volumes_module, "load_volume", counted)
    return calls


def same_rows(a: VolumeSource, b: VolumeSource) -> bool:
    arrays = ("gray", "masks", "labels", "cases", "slice_index", "groups", "splits")
    return (
        all(np.array_equal(getattr(a, name), getattr(b, name)) for name in arrays)
        and np.array_equal(a.sites(2), b.sites(2))
        and a.class_names == b.class_names
        and a.planes == b.planes
        and a.num_classes == b.num_classes
    )


def cached_root(tmp_path: Path) -> Path:
    cases = {f"case{c}": labelled_case(shape=(8, 8, 6), seed=c) for c in range(3)}
    table = "case,site,split\ncase0,A,train\ncase1,A,test\ncase2,B,\n"
    return write_root(tmp_path / "vol", cases, table=table)


@pytest.mark.parametrize("mask_values", ["", "0=,1=gland,2=gland+zone"])
def test_a_second_open_reads_the_cache_not_the_volumes(tmp_path, monkeypatch, mask_values):
    root, cache = cached_root(tmp_path), str(tmp_path / "cache")
    in_memory = VolumeSource(root, 8, empty_slices="keep:0.5", mask_values=mask_values)
    first = VolumeSource(root, 8, empty_slices="keep:0.5", mask_values=mask_values, cache_dir=cache)
    assert not first.cached_on_disk and same_rows(first, in_memory)
    stored = sorted(p.name.split("-", 1)[1] for p in Path(cache).iterdir())
    assert stored == sorted(f"{name}.npy" for name in volumes_module.CACHED_ROWS)

    count_volume_reads(monkeypatch, refuse=True)  # a later process: no volume file is read
    second = VolumeSource(root, 8, empty_slices="keep:0.5", mask_values=mask_values, cache_dir=cache)
    assert second.cached_on_disk and isinstance(second.gray, np.memmap) and same_rows(second, in_memory)
    assert second.sites(2).tolist()[:1] == ["A"] and second.row_name(3) == in_memory.row_name(3)
    spec = spec_of(root, mask_values=mask_values)
    rows = np.array([5, 0, 9])
    for got, expected in zip(second.dataset(rows, 0, spec), in_memory.dataset(rows, 0, spec)):
        assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])


def test_a_changed_setting_or_file_decodes_again(tmp_path, monkeypatch):
    root, cache = cached_root(tmp_path), str(tmp_path / "cache")
    reads = count_volume_reads(monkeypatch)
    VolumeSource(root, 8, cache_dir=cache)
    assert len(reads) == 6  # 3 cases, image and mask each
    assert VolumeSource(root, 8, cache_dir=cache).cached_on_disk and len(reads) == 6

    for changed in (
        {"empty_slices": "drop"},
        {"img_size": 4},
        {"intensity": "minmax"},
        {"slice_axis": 0},
        {"seed": 3},
        {"mask_values": "0=,1=gland,2=gland"},
    ):
        assert not VolumeSource(root, **{"img_size": 8, **changed}, cache_dir=cache).cached_on_disk, changed
        assert VolumeSource(root, **{"img_size": 8, **changed}, cache_dir=cache).cached_on_disk, changed

    before = len(reads)
    os.utime(root / "masks" / "case1.nii.gz", ns=(1, 1))  # another modification time: the file may have changed
    touched = VolumeSource(root, 8, cache_dir=cache)
    assert not touched.cached_on_disk and len(reads) == before + 6

    (root / "cases.csv").write_text("case,site\ncase0,X\ncase1,Y\ncase2,Y\n")  # the table is read at every open
    retabled = VolumeSource(root, 8, cache_dir=cache)
    assert retabled.cached_on_disk and retabled.splits is None
    assert set(retabled.sites(2)[retabled.cases == "case0"]) == {"X"}


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    root, cache = cached_root(tmp_path), tmp_path / "cache"
    VolumeSource(root, 8, cache_dir=str(cache))
    expected = VolumeSource(root, 8)  # in memory: the files below are overwritten in place, under any memory map
    gray, masks, cases = (next(cache.glob(f"*-{name}.npy")) for name in ("gray", "masks", "cases"))

    gray.write_bytes(gray.read_bytes()[:-50])  # truncated
    rebuilt = VolumeSource(root, 8, cache_dir=str(cache))
    assert not rebuilt.cached_on_disk and same_rows(rebuilt, expected)
    assert VolumeSource(root, 8, cache_dir=str(cache)).cached_on_disk  # written again, whole

    cases.write_bytes(b"garbage, not an npy file")
    assert not VolumeSource(root, 8, cache_dir=str(cache)).cached_on_disk
    np.save(masks, np.zeros((18, 2, 8, 8), np.uint8))  # planes where the source has class indices
    assert not VolumeSource(root, 8, cache_dir=str(cache)).cached_on_disk
    np.save(cases, np.array(["other"] * 18))  # rows of cases this folder does not have
    assert not VolumeSource(root, 8, cache_dir=str(cache)).cached_on_disk
    np.save(next(cache.glob("*-labels.npy")), np.array(1))  # a scalar where the labels belong
    assert not VolumeSource(root, 8, cache_dir=str(cache)).cached_on_disk

    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # temporary files renamed or removed
    count_volume_reads(monkeypatch, refuse=True)
    assert same_rows(VolumeSource(root, 8, cache_dir=str(cache)), expected)


def test_without_a_cache_folder_every_open_reads_the_volumes(tmp_path, monkeypatch):
    root = cached_root(tmp_path)
    reads = count_volume_reads(monkeypatch)
    first, second = VolumeSource(root, 8), VolumeSource(root, 8, cache_dir="")
    assert not first.cached_on_disk and not second.cached_on_disk and len(reads) == 12
    assert same_rows(first, second) and not isinstance(first.gray, np.memmap)
    assert not list(tmp_path.glob("**/*.npy"))


def test_an_unwritable_cache_folder_keeps_the_rows_in_memory(tmp_path):
    root = cached_root(tmp_path)
    (tmp_path / "taken").write_text("a file where the cache folder should be")
    with pytest.warns(UserWarning, match="cache not written"):
        source = VolumeSource(root, 8, cache_dir=str(tmp_path / "taken"))
    assert not source.cached_on_disk and same_rows(source, VolumeSource(root, 8))


def test_bad_volumes_are_refused_with_a_cache_folder_and_nothing_is_stored(tmp_path):
    root = tmp_path / "frac"
    save_nifti(root / "images" / "a.nii.gz", np.zeros((4, 4, 3), np.int16))
    save_nifti(root / "masks" / "a.nii.gz", np.full((4, 4, 3), 0.5, np.float32))
    for _ in range(2):
        with pytest.raises(DataError, match="label values must be whole numbers"):
            VolumeSource(root, 8, cache_dir=str(tmp_path / "cache"))
    assert not list(tmp_path.glob("cache/*.npy"))


def test_the_site_cache_folder_reaches_the_source_through_its_key(tmp_path, monkeypatch):
    root, cache = cached_root(tmp_path), str(tmp_path / "cache")
    spec = spec_of(root, cache_dir=cache)
    assert source_key(spec)[-1] == cache and source_key(spec)[:-1] == source_key(spec_of(root))[:-1]
    assert not open_source(spec).cached_on_disk and not open_source(spec_of(root)).cached_on_disk
    assert open_source(spec) is open_source(spec)  # still one source per key in a process
    open_source_by_key.cache_clear()  # as in a fresh ClientApp process
    count_volume_reads(monkeypatch, refuse=True)
    assert open_source(spec).cached_on_disk
    client = load_client_data(spec, 0, 1)
    image, mask = client.train[0]
    assert image.shape == (8, 8, 3) and mask.shape == (8, 8) and client.class_names == ["class-1", "class-2"]
