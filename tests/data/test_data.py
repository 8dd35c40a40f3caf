"""Tests of medflower.data: sources, partitions, per-client splits, batches and error messages."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from medflower.data import (
    PARTITIONS,
    SOURCE_KINDS,
    ClientData,
    DataError,
    DataSpec,
    describe_source,
    load_client_data,
    make_loader,
)
from medflower.data.partition import partition_rows
from medflower.data.transforms import IMAGENET_MEAN, IMAGENET_STD, images_to_tensor

SMALL = DataSpec(synthetic_size=480, seed=3)
MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def all_clients(spec: DataSpec, num_partitions: int) -> list[ClientData]:
    return [load_client_data(spec, p, num_partitions) for p in range(num_partitions)]


def client_labels(client: ClientData) -> np.ndarray:
    return np.concatenate([client.train.labels, client.val.labels, client.test.labels])


def write_npz(path: Path, sizes=(40, 10, 20), num_classes=3, rgb=False, **overrides) -> Path:
    """MedMNIST-style npz; every pixel of a split's images holds that split's marker (1, 2, 3)."""
    rng = np.random.default_rng(0)
    arrays = {}
    for marker, (split, n) in enumerate(zip(("train", "val", "test"), sizes), start=1):
        shape = (n, 28, 28, 3) if rgb else (n, 28, 28)
        arrays[f"{split}_images"] = np.full(shape, marker, dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % num_classes).reshape(n, 1).astype(np.uint8)
        rng.shuffle(arrays[f"{split}_labels"])
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return path


def write_csv(folder: Path, rows: list[dict], header=("path", "label", "site", "split"), make_images=True) -> Path:
    """Manifest plus small png images for the rows' paths."""
    lines = [",".join(header)]
    for i, row in enumerate(rows):
        lines.append(",".join(str(row.get(col, "")) for col in header))
        if make_images and row.get("path"):
            image_path = folder / row["path"]
            image_path.parent.mkdir(parents=True, exist_ok=True)
            if not image_path.exists():
                Image.fromarray(np.full((20, 24, 3), 10 * (i % 20), np.uint8)).save(image_path)
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def site_rows(sites=("b-hosp", "a-hosp", "c-hosp"), per_site=12, num_classes=2) -> list[dict]:
    return [
        {"path": f"img/{s}_{i}.png", "label": ["cat", "dog"][i % num_classes], "site": s}
        for s in sites
        for i in range(per_site)
    ]


# ---------------------------------------------------------------- public constants, batches


def test_public_constants():
    assert SOURCE_KINDS == ("synthetic", "medmnist", "csv", "synthetic-seg", "segfolder", "volumes")
    assert PARTITIONS == ("natural", "iid", "dirichlet", "pathological", "qbli")
    with pytest.raises(DataError, match="partition"):
        DataSpec(partition="random")
    with pytest.raises(DataError, match="dataset"):
        DataSpec(dataset="imagenet")


def test_batch_shape_dtype_and_range():
    client = load_client_data(DataSpec(synthetic_size=480, img_size=48), 0, 2)
    x, y = next(iter(make_loader(client.train, batch_size=16, shuffle=True, seed=0)))
    assert x.shape == (16, 3, 48, 48) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.int64
    pixels = x * STD + MEAN
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert int(y.min()) >= 0 and int(y.max()) < client.num_classes


def test_images_to_tensor_normalises_grayscale_and_resizes():
    white = np.full((10, 10), 255, np.uint8)
    black = np.zeros((10, 10), np.uint8)
    x = images_to_tensor([white, black], img_size=16)
    assert x.shape == (2, 3, 16, 16)
    assert torch.allclose(x[0], ((1 - MEAN) / STD)[0].expand(3, 16, 16), atol=1e-5)
    assert torch.allclose(x[1], (-MEAN / STD)[0].expand(3, 16, 16), atol=1e-5)
    rgb = torch.from_numpy(np.full((2, 8, 8, 3), 128, np.uint8))
    assert images_to_tensor(list(rgb), img_size=8).shape == (2, 3, 8, 8)


# ---------------------------------------------------------------- determinism, partitions


def test_same_spec_same_partitions_and_first_batch():
    first = load_client_data(SMALL, 1, 3)
    again = load_client_data(SMALL, 1, 3)
    assert np.array_equal(first.train.labels, again.train.labels)
    x1, y1 = next(iter(make_loader(first.train, 8, shuffle=True, seed=5)))
    x2, y2 = next(iter(make_loader(again.train, 8, shuffle=True, seed=5)))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    _, y3 = next(iter(make_loader(first.train, 32, shuffle=True, seed=6)))
    _, y4 = next(iter(make_loader(first.train, 32, shuffle=True, seed=5)))
    assert not torch.equal(y3, y4)


def test_different_seed_different_partitions():
    rows = partition_rows(SMALL, 3).rows
    other = partition_rows(DataSpec(synthetic_size=480, seed=4), 3).rows
    assert any(not np.array_equal(a, b) for a, b in zip(rows, other))


def test_partitioning_is_cached():
    assert partition_rows(SMALL, 3) is partition_rows(SMALL, 3)


@pytest.mark.filterwarnings("ignore:Classes")  # pathological: 4 partitions x 2 classes leave some unused
@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological", "natural"])
def test_partitions_are_disjoint_and_cover_the_pool(partition):
    spec = DataSpec(synthetic_size=480, partition=partition)
    rows = partition_rows(spec, 4).rows
    pooled = np.concatenate(rows)
    assert len(pooled) == len(np.unique(pooled))
    if partition != "pathological":  # pathological may leave classes unused
        assert np.array_equal(np.sort(pooled), np.arange(480))


def test_dirichlet_skews_labels_and_iid_does_not():
    def label_shares(partition):
        spec = DataSpec(synthetic_size=800, partition=partition, dirichlet_alpha=0.3)
        histograms = [np.bincount(client_labels(c), minlength=8) for c in all_clients(spec, 4)]
        return np.stack([h / h.sum() for h in histograms])

    skewed, uniform = label_shares("dirichlet"), label_shares("iid")
    assert np.abs(skewed - skewed.mean(0)).max() > 0.1
    assert np.abs(uniform - 1 / 8).max() < 0.06


def test_pathological_gives_at_most_k_classes():
    spec = DataSpec(synthetic_size=480, partition="pathological", pathological_k=2)
    for client in all_clients(spec, 4):
        assert len(np.unique(client_labels(client))) <= 2


def test_natural_partition_of_synthetic_by_row_site():
    spec = DataSpec(synthetic_size=480, partition="natural")
    partitioning = partition_rows(spec, 3)
    for pid, rows in enumerate(partitioning.rows):
        assert np.all(rows % 3 == pid)
    assert load_client_data(spec, 2, 3).site == "site-2"


def test_per_client_split_fractions():
    client = load_client_data(DataSpec(synthetic_size=1000, partition="iid", val_fraction=0.1, test_fraction=0.2), 0, 2)
    total = len(client.train) + len(client.val) + len(client.test)
    assert total == 500
    assert len(client.test) == 100 and len(client.val) == 50


def test_synthetic_sites_differ_in_style():
    spec = DataSpec(synthetic_size=800, partition="iid")
    means = []
    for client in all_clients(spec, 4):
        images = client.train.images[client.train.labels == 0]
        means.append(images.reshape(len(images), -1).mean())
    assert max(means) - min(means) > 5


def test_synthetic_describe_and_class_names():
    assert describe_source(DataSpec()) == (8, [f"class-{c}" for c in range(8)])
    client = load_client_data(SMALL, 0, 2)
    assert client.num_classes == 8 and client.class_names[0] == "class-0"
    assert client.train[0][0].dtype == np.uint8 and client.train[0][0].shape == (32, 32, 3)


# ---------------------------------------------------------------- medmnist


def test_medmnist_keeps_source_splits(tmp_path):
    write_npz(tmp_path / "pneumoniamnist.npz", sizes=(60, 20, 30), num_classes=2)
    spec = DataSpec(dataset="medmnist:pneumoniamnist", data_dir=str(tmp_path), partition="iid")
    assert describe_source(spec) == (2, ["normal", "pneumonia"])
    clients = all_clients(spec, 2)
    for client in clients:
        for split, marker in (("train", 1), ("val", 2), ("test", 3)):
            assert np.all(getattr(client, split).images == marker)
    assert sum(len(c.test) for c in clients) == 30
    x, _ = next(iter(make_loader(clients[0].train, 4, shuffle=False, seed=0)))
    assert x.shape == (4, 3, 32, 32)
    assert torch.allclose(x[:, 0], x[:, 0, :1, :1].expand_as(x[:, 0]))  # constant image stays constant


@pytest.mark.parametrize("partition", ["dirichlet", "pathological", "iid"])
def test_every_partition_gets_rows_of_every_source_split(tmp_path, partition):
    """Rows are shuffled before partitioning: no site ends up with only official train rows."""
    write_npz(tmp_path / "pneumoniamnist.npz", sizes=(300, 60, 90), num_classes=2)
    spec = DataSpec(
        dataset="medmnist:pneumoniamnist",
        data_dir=str(tmp_path),
        partition=partition,
        dirichlet_alpha=0.5,
        pathological_k=2,
    )
    for client in all_clients(spec, 3):
        assert len(client.train) and len(client.val) and len(client.test), (partition, client.partition_id)


def test_medmnist_without_source_splits_resplits(tmp_path):
    write_npz(tmp_path / "foomnist.npz", sizes=(60, 20, 30), rgb=True)
    spec = DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path), partition="iid", use_source_splits=False)
    client = load_client_data(spec, 0, 1)
    assert client.class_names == ["class-0", "class-1", "class-2"]
    assert set(np.unique(client.test.images)) > {1}


def test_medmnist_sized_file_name(tmp_path):
    write_npz(tmp_path / "foomnist_64.npz")
    spec = DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path))
    assert describe_source(spec)[0] == 3


def test_medmnist_missing_file(tmp_path):
    spec = DataSpec(dataset="medmnist:pathmnist", data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(DataError) as err:
        describe_source(spec)
    assert "pathmnist.npz" in str(err.value) and "nowhere" in str(err.value)
    assert "medmnist:pathmnist" in str(err.value)


def test_medmnist_missing_keys(tmp_path):
    write_npz(tmp_path / "foomnist.npz", val_images=None, test_labels=None)
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path)))
    message = str(err.value)
    assert "foomnist.npz" in message and "val_images" in message and "test_labels" in message
    assert "found keys: test_images, train_images, train_labels, val_labels" in message


@pytest.mark.parametrize(
    "labels, expected",
    [
        (np.array([[0], [1], [-1], [0]]), "negative"),
        (np.array([0.0, 1.5, 1.0, 0.0]), r"1 label\(s\) are non-integer, e.g. \[1.5\] \(rows 1\)"),
        (np.array([0.0, np.inf, 1.0, 0.0]), r"1 label\(s\) are non-finite \(inf or NaN\), e.g. \[inf\]"),
        (
            np.array([[np.nan], [1.0], [-np.inf], [0.0]]),
            r"2 label\(s\) are non-finite \(inf or NaN\), e.g. \[nan, -inf\]",
        ),
        (np.array(["0", "1", "1", "0"]), "must hold integer class indices, got dtype <U1"),
        (np.array([0.0, 1e19, 1.0, 0.0]), r"too large to be class indices \(at most 99999\), e.g. 1e\+19"),
        (np.array([[0, 1], [1, 0], [1, 1], [0, 0]]), "multi-label"),
    ],
)
def test_medmnist_bad_labels(tmp_path, labels, expected):
    write_npz(tmp_path / "foomnist.npz", val_images=np.zeros((4, 28, 28), np.uint8), val_labels=labels)
    with pytest.raises(DataError, match=expected) as err:
        describe_source(DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path)))
    assert "foomnist.npz" in str(err.value) and "val_labels" in str(err.value)


def test_medmnist_label_out_of_range_for_known_flag(tmp_path):
    write_npz(tmp_path / "pneumoniamnist.npz", num_classes=3)
    with pytest.raises(DataError, match="out of range") as err:
        describe_source(DataSpec(dataset="medmnist:pneumoniamnist", data_dir=str(tmp_path)))
    assert "pneumoniamnist.npz" in str(err.value)


def test_medmnist_length_mismatch(tmp_path):
    write_npz(tmp_path / "foomnist.npz", test_images=np.zeros((5, 28, 28), np.uint8))
    spec = DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path), partition="iid")
    with pytest.raises(DataError) as err:
        load_client_data(spec, 0, 1)
    assert "foomnist.npz" in str(err.value) and "test_images has 5 images" in str(err.value)


def test_natural_partition_needs_sites(tmp_path):
    write_npz(tmp_path / "foomnist.npz")
    spec = DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path), partition="natural")
    with pytest.raises(
        DataError, match="has no site per row, which partition 'natural' needs; valid choices are iid, dirichlet"
    ):
        load_client_data(spec, 0, 2)


def test_empty_test_split_names_the_partition(tmp_path):
    write_npz(tmp_path / "foomnist.npz", sizes=(40, 10, 1))
    spec = DataSpec(dataset="medmnist:foomnist", data_dir=str(tmp_path), partition="iid")
    with pytest.raises(DataError) as err:
        all_clients(spec, 2)
    assert re.search(r"partition [01] of 2 has an empty test split", str(err.value))
    assert "fewer partitions, a larger test_fraction or use_source_splits=False" in str(err.value)


# ---------------------------------------------------------------- csv


def test_csv_natural_partition_by_sorted_site(tmp_path):
    manifest = write_csv(tmp_path, site_rows())
    spec = DataSpec(dataset=f"csv:{manifest}", partition="natural", img_size=16)
    assert describe_source(spec) == (2, ["cat", "dog"])
    clients = all_clients(spec, 3)
    assert [c.site for c in clients] == ["a-hosp", "b-hosp", "c-hosp"]
    assert all(all(p.startswith(f"{c.site}_") for p in (Path(s).name for s in c.train.paths)) for c in clients)
    image, label = clients[0].train[0]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8 and label in (0, 1)
    with pytest.raises(DataError, match="a-hosp, b-hosp, c-hosp"):
        load_client_data(spec, 0, 2)


def test_csv_integer_labels_and_source_split(tmp_path):
    rows = [{"path": f"x{i}.png", "label": i % 3, "split": "test" if i < 6 else ""} for i in range(30)]
    spec = DataSpec(dataset=f"csv:{write_csv(tmp_path, rows)}", partition="iid", test_fraction=0.1)
    client = load_client_data(spec, 0, 1)
    assert client.class_names == ["class-0", "class-1", "class-2"]
    test_names = {Path(p).name for p in client.test.paths}
    assert test_names > {f"x{i}.png" for i in range(6)}  # marked rows stay in test ...
    assert len(test_names) == 6 + 3  # ... and 10% of the 24 unmarked rows join them


def test_csv_missing_manifest(tmp_path):
    with pytest.raises(DataError, match="nope.csv"):
        describe_source(DataSpec(dataset=f"csv:{tmp_path / 'nope.csv'}"))


def test_csv_missing_columns(tmp_path):
    manifest = write_csv(tmp_path, [{"path": "a.png"}], header=("path", "site"))
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset=f"csv:{manifest}"))
    message = str(err.value)
    assert "manifest.csv" in message and "label" in message and "found columns: path, site" in message


@pytest.mark.parametrize("content", ["", "path,label\n"])
def test_csv_empty_manifest(tmp_path, content):
    manifest = tmp_path / "manifest.csv"
    manifest.write_text(content)
    with pytest.raises(DataError, match="manifest.csv.*(empty|no rows)"):
        describe_source(DataSpec(dataset=f"csv:{manifest}"))


def test_csv_bad_split_values(tmp_path):
    rows = [{"path": f"x{i}.png", "label": 0, "split": ["train", "validation", "test", "dev"][i % 4]} for i in range(8)]
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset=f"csv:{write_csv(tmp_path, rows)}"))
    message = str(err.value)
    assert "manifest.csv" in message and "4 row(s)" in message
    assert "line 3 ('validation')" in message and "line 5 ('dev')" in message


@pytest.mark.parametrize("marker", ["", "NaN", "NA", "nan", "None", "null", "N/A", "<NA>"])
def test_csv_missing_labels_are_refused_not_classes(tmp_path, marker):
    """pandas' default NA strings are missing labels, never a class of their own."""
    rows = [{"path": f"x{i}.png", "label": marker if i in (2, 5) else "cat"} for i in range(8)]
    manifest = write_csv(tmp_path, rows)
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset=f"csv:{manifest}"))
    assert str(err.value) == (
        f"{manifest}: missing label in 2 row(s) (empty, or a missing-value marker such as NaN, NA, None, null): "
        f"line 4 ({marker!r}), line 7 ({marker!r}); give every row its class (a class cannot be named like a "
        "missing value)"
    )


@pytest.mark.parametrize("path", ["/etc/hostname", "../outside.png", "img/../../outside.png", "~/outside.png"])
def test_csv_paths_must_stay_in_the_manifest_folder(tmp_path, path):
    (tmp_path / "outside.png").write_bytes(b"not read")
    folder = tmp_path / "site"
    manifest = write_csv(folder, [{"path": f"x{i}.png", "label": i % 2} for i in range(6)])
    manifest.write_text(manifest.read_text() + f"{path},0,,\n")
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset=f"csv:{manifest}"))
    assert str(err.value) == (
        f"{manifest}: 1 image path(s) leave the manifest's folder (absolute paths and '..' climbing out of it are "
        f"refused; write paths relative to {folder}): line 8 ({path!r})"
    )


def test_csv_integer_labels_too_large_for_classes(tmp_path):
    manifest = write_csv(tmp_path, [{"path": f"x{i}.png", "label": [0, 1234567][i % 2]} for i in range(4)])
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset=f"csv:{manifest}"))
    assert str(err.value) == f"{manifest}: label(s) too large to be class indices (at most 99999), e.g. 1234567"


def test_csv_paths_inside_the_folder_may_use_dots(tmp_path):
    rows = [{"path": f"img/../x{i}.png", "label": i % 2} for i in range(6)]
    manifest = write_csv(tmp_path, rows)
    assert describe_source(DataSpec(dataset=f"csv:{manifest}")) == (2, ["class-0", "class-1"])


def test_csv_missing_image_files_listed_once(tmp_path):
    rows = [{"path": f"x{i}.png", "label": 0} for i in range(15)]
    manifest = write_csv(tmp_path, rows)
    for i in range(12):
        (tmp_path / f"x{i}.png").unlink()
    with pytest.raises(DataError) as err:
        describe_source(DataSpec(dataset=f"csv:{manifest}"))
    message = str(err.value)
    assert "12 image file(s) not found" in message
    assert "line 2 ('x0.png')" in message and "+2 more" in message


def test_csv_unreadable_image_raises_when_loaded(tmp_path):
    rows = [{"path": f"x{i}.png", "label": i % 2} for i in range(10)]
    manifest = write_csv(tmp_path, rows)
    (tmp_path / "x3.png").write_bytes(b"not a png")
    spec = DataSpec(dataset=f"csv:{manifest}", partition="iid", use_source_splits=False, test_fraction=0.1)
    client = load_client_data(spec, 0, 1)
    splits = (client.train, client.val, client.test)
    dataset = next(d for d in splits if any(p.endswith("x3.png") for p in d.paths))
    with pytest.raises(DataError) as err:
        list(make_loader(dataset, 4, shuffle=False, seed=0))
    assert "line 5" in str(err.value) and "x3.png" in str(err.value)
