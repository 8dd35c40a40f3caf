"""Tests of the segmentation sources: synthetic-seg, segfolder:<root>, mask batches, partitions, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from medflower.data import (
    SOURCE_KINDS,
    DataError,
    DataSpec,
    describe_source,
    load_client_data,
    make_loader,
    site_data_spec,
    source_task,
)
from medflower.data.partition import partition_rows
from medflower.data.sources import open_source
from medflower.data.synthetic_seg import render_site, seg_look, write_segfolder

SEG = DataSpec(dataset="synthetic-seg", synthetic_size=240, partition="iid", img_size=32, seed=5)


def write_pair(folder: Path, stem: str, mask: np.ndarray, image_ext=".png", mask_name=None) -> None:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "masks").mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full(mask.shape + (3,), 90, np.uint8)).save(folder / "images" / f"{stem}{image_ext}")
    Image.fromarray(mask.astype(np.uint8)).save(folder / "masks" / (mask_name or f"{stem}.png"))


def square_mask(value=255, size=20) -> np.ndarray:
    mask = np.zeros((size, size), np.uint8)
    mask[5:12, 6:14] = value
    return mask


# ---------------------------------------------------------------- spec, task


def test_kinds_and_tasks():
    assert {"synthetic-seg", "segfolder"} <= set(SOURCE_KINDS)
    assert SEG.source_kind == "synthetic-seg" and SEG.source_arg == ""
    assert DataSpec(dataset="segfolder:/x").source_kind == "segfolder"
    for bad in ("synthetic-seg:3", "segfolder", "segfolder:"):
        with pytest.raises(DataError, match="dataset"):
            DataSpec(dataset=bad)
    assert source_task(SEG) == "segmentation"
    assert source_task(DataSpec(dataset="segfolder:/nowhere")) == "segmentation"
    for spec in (DataSpec(), DataSpec(dataset="medmnist:x"), DataSpec(dataset="csv:m.csv")):
        assert source_task(spec) == "classification"


def test_classification_sources_report_classification():
    spec = DataSpec(synthetic_size=120, partition="iid")
    client = load_client_data(spec, 0, 2)
    assert open_source(spec).task == "classification"
    assert client.task == "classification" and client.train.task == "classification"


# ---------------------------------------------------------------- synthetic-seg


def test_synthetic_seg_is_deterministic_with_both_classes():
    a, b = load_client_data(SEG, 1, 3), load_client_data(SEG, 1, 3)
    assert a.task == "segmentation" and a.train.task == "segmentation"
    assert (a.num_classes, a.class_names) == (2, ["ellipse", "rectangle"])
    assert describe_source(SEG) == (2, ["ellipse", "rectangle"])
    assert np.array_equal(a.train.images, b.train.images) and np.array_equal(a.train.masks, b.train.masks)
    image, mask = a.train[0]
    assert image.dtype == np.uint8 and image.shape == (32, 32, 3)
    assert mask.dtype == np.uint8 and mask.shape == (32, 32)
    masks = np.concatenate([a.train.masks, a.val.masks, a.test.masks])
    assert set(np.unique(masks).tolist()) == {0, 1, 2}
    assert 0 < (masks == 2).any(axis=(1, 2)).mean() < 1  # the rectangle is in most images, not all
    assert (masks == 1).any(axis=(1, 2)).all()
    assert a.site == "site-1"


def test_synthetic_seg_sites_differ_in_style_not_geometry():
    rows = np.arange(40)
    images, masks = zip(*(render_site(5, style, rows, 240, 32) for style in range(4)))
    assert all(np.array_equal(masks[0], m) for m in masks)  # masks depend on the scene only

    def contrast(image: np.ndarray, mask: np.ndarray) -> float:  # ellipse minus background brightness
        gray = image.mean(axis=-1)
        return gray[mask == 1].mean() - gray[mask == 0].mean()

    polarity = [np.sign(np.mean([contrast(i, m) for i, m in zip(im, masks[0])])) for im in images]
    assert polarity[0] == -polarity[1] and polarity[1] == -polarity[2]  # neighbouring styles: opposite polarity
    assert [seg_look(5, s).polarity for s in range(3)] == polarity[:3]
    same, other = render_site(5, 0, rows, 240, 32)[0], render_site(5, 2, rows, 240, 32)[0]
    assert np.array_equal(same, images[0]) and not np.array_equal(other, images[0])


def test_seg_loader_shapes_and_nearest_resize():
    client = load_client_data(
        DataSpec(dataset="synthetic-seg", synthetic_size=240, partition="iid", img_size=80), 0, 2
    )  # rendered at 64, resized to 80 in the batch
    assert client.train[0][1].shape == (64, 64)
    x, y = next(iter(make_loader(client.train, batch_size=8, shuffle=True, seed=0)))
    assert x.shape == (8, 3, 80, 80) and x.dtype == torch.float32
    assert y.shape == (8, 80, 80) and y.dtype == torch.int64
    assert set(torch.unique(y).tolist()) <= {0, 1, 2} and int(y.max()) == 2
    small = load_client_data(SEG, 0, 2)
    x, y = next(iter(make_loader(small.train, batch_size=4, shuffle=False, seed=0)))
    assert torch.equal(y, torch.from_numpy(small.train.masks[:4]).long())  # no resize: identical


def test_segmentation_partitions():
    for partition in ("dirichlet", "pathological"):
        with pytest.raises(DataError, match="segmentation source .*; valid choices are natural, iid"):
            load_client_data(DataSpec(dataset="synthetic-seg", partition=partition), 0, 2)
    natural = DataSpec(dataset="synthetic-seg", synthetic_size=240, partition="natural")
    for pid, rows in enumerate(partition_rows(natural, 3).rows):
        assert np.all(rows % 3 == pid)
    assert load_client_data(natural, 2, 3).site == "site-2"


# ---------------------------------------------------------------- segfolder


def test_segfolder_round_trip_natural_sites(tmp_path):
    root = write_segfolder(tmp_path / "fed", {"hosp-b": 0, "hosp-a": 0, "hosp-c": 1}, per_site=10, size=32, seed=1)
    assert sorted(p.name for p in (root / "hosp-a" / "masks").iterdir())[:1] == ["hosp-a-0000.png"]
    spec = DataSpec(dataset=f"segfolder:{root}", partition="natural", img_size=24)
    assert describe_source(spec) == (2, ["class-1", "class-2"])
    clients = [load_client_data(spec, p, 3) for p in range(3)]
    assert [c.site for c in clients] == ["hosp-a", "hosp-b", "hosp-c"]
    assert all(c.task == "segmentation" and len(c.train) + len(c.val) + len(c.test) == 10 for c in clients)
    image, mask = clients[0].train[0]
    assert image.shape == (24, 24, 3) and image.dtype == np.uint8
    assert mask.shape == (24, 24) and set(np.unique(mask).tolist()) <= {0, 1, 2}
    x, y = next(iter(make_loader(clients[0].train, batch_size=4, shuffle=False, seed=0)))
    assert x.shape == (4, 3, 24, 24) and y.shape == (4, 24, 24) and y.dtype == torch.int64
    # full-size masks read back exactly as written
    stem = clients[0].train.mask_paths[0]
    written = np.asarray(Image.open(stem))
    full = load_client_data(DataSpec(dataset=f"segfolder:{root}", partition="natural", img_size=32), 0, 3)
    assert np.array_equal(full.train[0][1], written)
    with pytest.raises(DataError, match="or a multiple of it .* num_partitions=2 and 3 site.*hosp-a, hosp-b, hosp-c"):
        load_client_data(spec, 0, 2)
    iid = load_client_data(DataSpec(dataset=f"segfolder:{root}", partition="iid"), 0, 2)
    assert iid.site is None and iid.task == "segmentation"


def test_segfolder_binary_masks_pairing_and_single_site(tmp_path):
    site = tmp_path / "polyp-site"
    for i in range(6):
        write_pair(site, f"img{i}", square_mask(255), image_ext=".jpg", mask_name=f"img{i}_mask.png" if i % 2 else None)
    write_pair(site, "empty", np.zeros((20, 20), np.uint8))
    spec = DataSpec(dataset=f"segfolder:{site}", partition="natural", img_size=20, test_fraction=0.3)
    assert describe_source(spec) == (1, ["foreground"])
    client = load_client_data(spec, 0, 1)
    assert client.site == "polyp-site"
    masks = [client.train[i][1] for i in range(len(client.train))]
    assert all(set(np.unique(m).tolist()) <= {0, 1} for m in masks)
    assert any(m.max() == 1 for m in masks)
    assert sorted(open_source(spec).labels.tolist()) == [0] + [1] * 6  # 1 = has foreground


def test_segfolder_01_and_class_index_masks(tmp_path):
    write_pair(tmp_path / "r" / "s1", "a", square_mask(1))
    write_pair(tmp_path / "r" / "s1", "b", square_mask(3))
    assert describe_source(DataSpec(dataset=f"segfolder:{tmp_path / 'r'}")) == (3, ["class-1", "class-2", "class-3"])


def test_segfolder_unpaired_files_are_listed(tmp_path):
    site = tmp_path / "root" / "site-x"
    write_pair(site, "ok", square_mask())
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(site / "images" / "lonely.png")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(site / "masks" / "stray.png")
    with pytest.raises(
        DataError,
        match=r"site-x: unpaired files \(1 image\(s\) without a mask in masks/: "
        r"lonely.png; 1 mask\(s\) without an image in images/: stray.png\)",
    ):
        describe_source(DataSpec(dataset=f"segfolder:{tmp_path / 'root'}"))


def test_segfolder_bad_mask_values_name_the_file(tmp_path):
    mask = square_mask(255)
    mask[0, 0] = 128
    write_pair(tmp_path / "site", "good", square_mask(255))
    write_pair(tmp_path / "site", "bad", mask)
    with pytest.raises(DataError, match=r"1 mask\(s\) with bad values: masks/bad.png \(values \{0, 128, 255\}\)"):
        describe_source(DataSpec(dataset=f"segfolder:{tmp_path / 'site'}"))


def test_segfolder_layout_errors(tmp_path):
    with pytest.raises(DataError, match="segfolder root not found"):
        describe_source(DataSpec(dataset=f"segfolder:{tmp_path / 'missing'}"))
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    with pytest.raises(DataError, match="expected images/ and masks/ folders"):
        describe_source(DataSpec(dataset=f"segfolder:{tmp_path / 'empty'}"))
    (tmp_path / "half" / "images").mkdir(parents=True)
    with pytest.raises(DataError, match="half: has images/ but no masks/ folder"):
        describe_source(DataSpec(dataset=f"segfolder:{tmp_path / 'half'}"))


def test_segfolder_source_key_sees_new_files(tmp_path):
    root = write_segfolder(tmp_path / "fed", {"a": 0}, per_site=4, size=16, seed=0)
    spec = DataSpec(dataset=f"segfolder:{root}", partition="iid")
    assert len(open_source(spec)) == 4
    write_pair(root / "a", "extra", square_mask(1, size=16))
    assert len(open_source(spec)) == 5


def test_site_data_spec_on_seg_folders(tmp_path):
    one = write_segfolder(tmp_path / "one", {"s": 0}, per_site=4, size=16, seed=0) / "s"
    spec = site_data_spec(DataSpec(), str(one))
    assert (spec.dataset, spec.partition) == (f"segfolder:{one}", "iid")
    many = write_segfolder(tmp_path / "many", {"a": 0, "b": 1}, per_site=4, size=16, seed=0)
    spec = site_data_spec(DataSpec(), str(many))
    assert spec.dataset == f"segfolder:{many}"
    client = load_client_data(spec, 0, 1)
    assert client.task == "segmentation" and len(client.train) + len(client.val) + len(client.test) == 8
