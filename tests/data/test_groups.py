"""Splits without leakage (docs/data.md#splits-without-leakage): with groups (patients, cases, video sequences)
no group spans two partitions or two of train/val/test; without groups every partition and split is exactly as
before; the video-sequence tool finds the cuts of numbered frame folders."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflower.data import DataError, DataSpec, load_client_data
from medflower.data.client import split_rows
from medflower.data.groups import frame_differences, main, natural_key, sequence_groups, sequence_starts
from medflower.data.image_datasets import ArrayImageDataset
from medflower.data.partition import partition_rows, source_grouping, split_client_rows
from medflower.data.sources import Source, open_source

SITES = ("a-hosp", "b-hosp", "c-hosp")


def write_grouped_manifest(folder: Path, num_groups=60, num_classes=4, seed=0, rows=None) -> Path:
    """A manifest (path,label,site,group[,split]) of ``num_groups`` patients with 1-4 rows each, mostly of one
    class; each patient is at one site. All rows share one small image (partitions never read it)."""
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "img.png")
    if rows is None:
        rng = np.random.default_rng(seed)
        rows = []
        for g in range(num_groups):
            label = int(rng.integers(num_classes))
            for _ in range(int(rng.integers(1, 5))):
                row_label = label if rng.random() < 0.8 else int(rng.integers(num_classes))
                rows.append({"label": row_label, "site": SITES[g % len(SITES)], "group": f"p{g:03d}"})
    header = ["path", "label", "site", "group"] + (["split"] if any("split" in r for r in rows) else [])
    lines = [",".join(header)] + [",".join(str({"path": "img.png", **r}.get(c, "")) for c in header) for r in rows]
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def groups_of(rows: np.ndarray, groups: np.ndarray) -> set[str]:
    return set(groups[rows].tolist())


# ---------------------------------------------------------------- every partitioner, every split


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological", "qbli", "natural"])
def test_no_group_spans_partitions_or_splits(tmp_path, partition):
    manifest = write_grouped_manifest(tmp_path)
    for seed in range(3):
        spec = DataSpec(
            dataset=f"csv:{manifest}", partition=partition, seed=seed, dirichlet_alpha=1.0, pathological_k=2, img_size=8
        )
        source = open_source(spec)
        groups = source.groups
        parts = partition_rows(spec, 3).rows
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(source)))  # disjoint, covering
        part_groups = [groups_of(rows, groups) for rows in parts]
        for i in range(3):
            for j in range(i + 1, 3):
                assert not part_groups[i] & part_groups[j], (partition, seed, i, j)
        for p, rows in enumerate(parts):
            data = load_client_data(spec, p, 3)
            split_rows_ = [getattr(data, s).lines - 2 for s in ("train", "val", "test")]  # line 1 is the header
            assert sorted(np.concatenate(split_rows_).tolist()) == rows.tolist()
            train, val, test = (groups_of(r, groups) for r in split_rows_)
            assert not (train & val or train & test or val & test), (partition, seed, p)
            assert train and test
        assert partition_rows(spec, 3).rows == parts  # cached and deterministic
    if partition == "natural":  # sites of the manifest, each group at one site
        assert partition_rows(spec, 3).sites == SITES


def test_a_natural_partition_can_cut_each_site_into_alike_parts_keeping_groups_whole(tmp_path):
    """num_partitions a multiple of the sites: each site's groups cut at random into equal parts, <site>-1.."""
    spec = DataSpec(dataset=f"csv:{write_grouped_manifest(tmp_path)}", partition="natural", img_size=8)
    source = open_source(spec)
    whole = partition_rows(spec, 3)
    halves = partition_rows(spec, 6)
    assert halves.sites == ("a-hosp-1", "a-hosp-2", "b-hosp-1", "b-hosp-2", "c-hosp-1", "c-hosp-2")
    for site in range(3):  # the two halves of a site are exactly that site's rows, split by whole groups
        first, second = halves.rows[2 * site], halves.rows[2 * site + 1]
        assert sorted(np.concatenate([first, second]).tolist()) == whole.rows[site].tolist()
        assert not groups_of(first, source.groups) & groups_of(second, source.groups)
        sizes = [len(groups_of(r, source.groups)) for r in (first, second)]
        assert abs(sizes[0] - sizes[1]) <= 1  # 20 groups per site: 10 and 10
    assert [load_client_data(spec, p, 6).site for p in (0, 5)] == ["a-hosp-1", "c-hosp-2"]
    with pytest.raises(DataError, match="number of sites or a multiple of it .* num_partitions=4 and 3 site"):
        partition_rows(spec, 4)


def test_split_by_group_property_and_fractions():
    """Over seeds and random group layouts: each group in one split, every row in one split, the test and val
    shares near their fractions, stratified by the groups' labels."""
    for seed in range(8):
        rng = np.random.default_rng(seed)
        sizes = rng.integers(1, 6, size=80)
        groups = np.repeat([f"g{i}" for i in range(80)], sizes)
        labels = np.repeat(rng.integers(0, 3, size=80), sizes)
        out = split_client_rows(labels, None, 0.1, 0.2, seed, groups=groups)
        assert sorted(np.concatenate(list(out.values())).tolist()) == list(range(len(labels)))
        sets = {s: set(groups[p].tolist()) for s, p in out.items()}
        assert not (sets["train"] & sets["val"] or sets["train"] & sets["test"] or sets["val"] & sets["test"])
        assert abs(len(out["test"]) / len(labels) - 0.2) < 0.06
        assert abs(len(out["val"]) / len(labels) - 0.1) < 0.06
        for c in range(3):  # every class is in the test split
            assert (labels[out["test"]] == c).any()
        again = split_client_rows(labels, None, 0.1, 0.2, seed, groups=groups)
        assert all(np.array_equal(out[s], again[s]) for s in out)


def test_source_splits_are_kept_per_group_and_conflicts_refused(tmp_path):
    rows = [{"label": i % 2, "site": "a", "group": f"p{i // 3}", "split": ""} for i in range(30)]
    rows[0]["split"] = "test"  # p0: one row says test, so its other rows go to test too
    manifest = write_grouped_manifest(tmp_path, rows=rows)
    data = load_client_data(DataSpec(dataset=f"csv:{manifest}", partition="iid", img_size=8), 0, 1)
    source = open_source(DataSpec(dataset=f"csv:{manifest}"))
    test_lines = set(data.test.lines.tolist())
    assert {int(source.lines[r]) for r in np.flatnonzero(source.groups == "p0")} <= test_lines
    rows[4]["split"] = "train"  # p1 now has rows in train ...
    rows[5]["split"] = "val"  # ... and in val
    manifest = write_grouped_manifest(tmp_path, rows=rows)
    with pytest.raises(DataError, match=r"group 'p1' has rows in source splits train, val"):
        load_client_data(DataSpec(dataset=f"csv:{manifest}", partition="iid", img_size=8), 0, 1)
    # without the source splits the same rows are split by group
    data = load_client_data(
        DataSpec(dataset=f"csv:{manifest}", partition="iid", img_size=8, use_source_splits=False), 0, 1
    )
    assert len(data.train) + len(data.val) + len(data.test) == 30


def test_natural_partition_refuses_a_group_across_sites(tmp_path):
    rows = [{"label": i % 2, "site": SITES[(i // 3) % 3], "group": f"p{i // 3}"} for i in range(30)]
    rows[3]["group"] = "p0"  # a row of b-hosp joins p0 of a-hosp
    manifest = write_grouped_manifest(tmp_path, rows=rows)
    with pytest.raises(DataError, match=r"1 group\(s\) have rows in two or more sites.*'p0' in sites a-hosp, b-hosp"):
        partition_rows(DataSpec(dataset=f"csv:{manifest}", partition="natural"), 3)
    # other partitions ignore sites; the group stays whole
    parts = partition_rows(DataSpec(dataset=f"csv:{manifest}", partition="iid"), 3).rows
    groups = open_source(DataSpec(dataset=f"csv:{manifest}")).groups
    assert sum("p0" in groups_of(rows, groups) for rows in parts) == 1


class GroupedArraySource(Source):
    """An in-memory source with groups (one may be empty)."""

    def __init__(self, groups: list[str]) -> None:
        self.name = "grouped-array"
        self.labels = np.arange(len(groups)) % 2
        self.class_names = ("a", "b")
        self.groups = np.array(groups, dtype=str)

    def dataset(self, rows, partition_id, spec):
        return ArrayImageDataset(np.zeros((len(rows), 4, 4), np.uint8), self.labels[rows], spec.img_size)


def test_rows_without_a_group_are_refused():
    source = GroupedArraySource(["p1", "p1", "", "p2", "p3", ""])
    for call in (lambda: source_grouping(source), lambda: split_rows(source, DataSpec(), np.arange(6), 0, 1, None)):
        with pytest.raises(DataError, match=r"group column missing for some rows.* 2 row\(s\) have none: row 2, row 5"):
            call()


def test_a_site_of_one_group_cannot_be_split():
    source = GroupedArraySource(["p1"] * 8)
    with pytest.raises(
        DataError,
        match=r"partition 0 of 1: all 8 row\(s\) belong to one group \('p1'.*at least 2 "
        r"groups",
    ):
        split_rows(source, DataSpec(), np.arange(8), 0, 1, None)
    data = split_rows(GroupedArraySource(["p1"] * 4 + ["p2"] * 4), DataSpec(), np.arange(8), 0, 1, None)
    assert (len(data.train), len(data.test)) == (4, 4)  # two groups: one held out for test, none for val


# ---------------------------------------------------------------- without groups: exactly as before

# sha256 (first 16 hex digits) of the partitions' rows and of split_client_rows' positions, computed with the
# partitioning code before groups existed (synthetic pool of 240 rows, 3 partitions, dirichlet_alpha 0.3)
PINNED_PARTITIONS = {
    ("iid", 0): "66b56e2dc684b332",
    ("iid", 1): "b614ce9769d51581",
    ("dirichlet", 0): "8e261dfaf505322a",
    ("dirichlet", 1): "524ba7443ff18898",
    ("pathological", 0): "f3fa5b9a04f0da2b",
    ("pathological", 1): "d611fe9ba4037f64",
    ("qbli", 0): "0c467800cdce9be4",
    ("qbli", 1): "1081f37c22fc8006",
    ("natural", 0): "8d77ff447f15127e",
    ("natural", 1): "8d77ff447f15127e",
}
PINNED_SPLITS = {
    (0, False): "08a873cfa1f41b75",
    (0, True): "daa3f0b96ae3a636",
    (1, False): "dd16442b58902dce",
    (1, True): "6b589d19f2132067",
}


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.asarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_without_groups_partitions_and_splits_are_unchanged():
    for (partition, seed), expected in PINNED_PARTITIONS.items():
        spec = DataSpec(dataset="synthetic", synthetic_size=240, partition=partition, seed=seed, dirichlet_alpha=0.3)
        assert digest(partition_rows(spec, 3).rows) == expected, (partition, seed)
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 4, 90)
    splits = rng.choice(np.array(["", "", "train", "val", "test"]), 90)
    for (seed, with_splits), expected in PINNED_SPLITS.items():
        out = split_client_rows(labels, splits if with_splits else None, 0.1, 0.2, seed)
        assert digest([out[s] for s in ("train", "val", "test")]) == expected, (seed, with_splits)


# ---------------------------------------------------------------- video-sequence groups (CVC-ClinicDB style)


def write_frames(folder: Path, lengths=(9, 12, 8), size=48, seed=0) -> list[int]:
    """Frames 1.png.. of len(lengths) sequences: each a random smooth scene drifting slowly (a few pixels of
    shift and a little noise per frame), abrupt changes between sequences. Returns the first frame of each."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    number, starts = 1, []
    for length in lengths:
        scene = np.asarray(
            Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize(
                (size * 2, size * 2), Image.Resampling.BICUBIC
            ),
            dtype=np.float32,
        )
        starts.append(number)
        for t in range(length):
            frame = scene[t : t + size, t // 2 : t // 2 + size] + rng.normal(0, 2, (size, size, 3))
            Image.fromarray(np.clip(frame, 0, 255).astype(np.uint8)).save(folder / f"{number}.png")
            number += 1
    return starts


def test_groups_tool_finds_the_sequences(tmp_path, capsys):
    starts = write_frames(tmp_path / "images")
    out = tmp_path / "groups.csv"
    assert main([str(tmp_path / "images"), "--out", str(out)]) == 0
    assert "3 group(s) found in 29 frame(s)" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert [r["stem"] for r in rows] == [str(i) for i in range(1, 30)]  # natural order: 2 before 10
    found = [int(r["stem"]) for i, r in enumerate(rows) if i == 0 or r["group"] != rows[i - 1]["group"]]
    assert found == starts
    assert [r["group"] for r in rows][:1] == ["seq-1"]
    # consecutive frames only (window 1) find the same cuts here
    assert [g for _, g in sequence_groups(tmp_path / "images", window=1)] == [r["group"] for r in rows]


def test_sequence_starts_threshold_and_min_length():
    differences = np.array([1.0, 1, 9, 1, 1, 8, 10, 1, 1, 1])  # cuts before frames 3, 6 and 7
    assert sequence_starts(differences, threshold=4, min_length=1) == [0, 3, 6, 7]
    assert sequence_starts(differences, threshold=4, min_length=2) == [0, 3, 7]  # 7 is stronger than 6
    assert sequence_starts(differences, threshold=20, min_length=1) == [0]
    assert natural_key("10") > natural_key("2") and natural_key("a10") > natural_key("a2")
    frames = np.stack([np.zeros((2, 2)), np.full((2, 2), 10.0), np.zeros((2, 2))])
    assert frame_differences(frames).tolist() == [10.0, 10.0]
    assert frame_differences(frames, window=2).tolist() == [0.0, 0.0]  # one odd frame cuts nothing


def test_groups_tool_reports_bad_folders(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "g.csv")]) == 1
    assert "no image files" in capsys.readouterr().err
    assert not (tmp_path / "g.csv").exists()
