"""Hospitals' own medical data (node-config data-path) in one federation: a NIfTI volume folder, a DICOM series
folder and a DICOM segmentation folder train together; a site with bad data answers with an error naming the file
and what is wrong, and the others go on (docs/data.md#medical-image-formats, #volumes, #masks)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_readers import write_dicom, write_series
from test_volumes import labelled_case, save_nifti

from medflower.inprocess import run_inprocess

ZONES = "0=,1=outer,2=inner"


def volume_site(root: Path, cases: int = 4, seed: int = 0) -> Path:
    for c in range(cases):
        image, labels = labelled_case(shape=(16, 16, 6), foreground=(1, 2, 3, 4), seed=seed + c)
        save_nifti(root / "images" / f"case{c}.nii.gz", image)
        save_nifti(root / "masks" / f"case{c}.nii.gz", labels)
    return root


def series_site(root: Path, cases: int = 4, seed: int = 10) -> Path:
    for c in range(cases):
        image, labels = labelled_case(shape=(16, 16, 6), foreground=(1, 2, 3, 4), seed=seed + c)
        write_series(root / "images" / f"case{c}", image.astype(np.uint16))
        save_nifti(root / "masks" / f"case{c}.nii.gz", labels)
    return root


def dicom_folder_site(root: Path, images: int = 12, seed: int = 20) -> Path:
    """A segmentation folder of 16-bit DICOM images with 0/1/2 PNG masks and a patient per pair of images."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rows = ["stem,group"]
    for i in range(images):
        mask = np.zeros((16, 16), np.uint8)
        mask[4:12, 4:12] = 1
        mask[6:10, 6:10] = 2
        pixels = (rng.integers(0, 300, (16, 16)) + 1500 * (mask > 0)).astype(np.uint16)
        write_dicom(root / "images" / f"im{i}.dcm", pixels)
        Image.fromarray(mask).save(root / "masks" / f"im{i}.png")
        rows.append(f"im{i},patient-{i // 2}")
    (root / "groups.csv").write_text("\n".join(rows) + "\n")
    return root


def break_site(kind: str, root: Path) -> tuple[Path, str]:
    """A site whose data has one of a hospital's bad inputs; (its data-path, what its error must say)."""
    if kind == "no-pixel-data":
        site = dicom_folder_site(root)
        write_dicom(site / "images" / "im3.dcm", None)
        return site, r"im3\.dcm.*no pixel data"
    if kind == "label-shape":
        site = volume_site(root)
        save_nifti(site / "masks" / "case2.nii.gz", np.zeros((16, 16, 5), np.uint8))
        return site, r"case2\.nii\.gz.*shape"
    if kind == "mixed-series":
        site = series_site(root)
        write_dicom(
            site / "images" / "case1" / "slice002.dcm",
            np.zeros((8, 8), np.uint16),
            ImageOrientationPatient=[1, 0, 0, 0, 1, 0],
            ImagePositionPatient=[0, 0, 5.0],
            InstanceNumber=3,
        )
        return site, r"case1.*(size|rows|columns)"
    if kind == "value-outside-map":
        site = dicom_folder_site(root)
        mask = np.zeros((16, 16), np.uint8)
        mask[2:5, 2:5] = 7
        Image.fromarray(mask).save(site / "masks" / "im5.png")
        return site, r"im5\.png.*7"
    if kind == "group-missing":
        site = dicom_folder_site(root)
        lines = (site / "groups.csv").read_text().splitlines()
        (site / "groups.csv").write_text("\n".join(lines[:-2]) + "\n")  # the last two images have no group
        return site, r"no row in groups\.csv.*im10.*im11"
    raise ValueError(kind)


def run_sites(tmp_path: Path, sites: dict[str, Path], name: str) -> tuple[dict, list[dict]]:
    node_configs = [
        {"data-path": str(path), "site-name": site, "share-error-detail": True} for site, path in sites.items()
    ]
    config = {
        "dataset": "site",
        "task": "segmentation",
        "mask-values": ZONES,
        "class-names": "outer,inner",
        "strategy": "fedavg",
        "adapter": "bottleneck",
        "img-size": 16,
        "patch-size": 8,
        "backbone-weights": "none",
        "num-rounds": 1,
        "val-fraction": 0.0,
        "test-fraction": 0.25,
        "output-dir": str(tmp_path / "out"),
        "run-name": name,
    }
    summary, _ = run_inprocess(config, num_nodes=len(sites), node_configs=node_configs)
    lines = (tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines if '"server"' in line]


def test_volume_series_and_dicom_folder_sites_train_together(tmp_path):
    sites = {
        "nifti-volumes": volume_site(tmp_path / "a"),
        "dicom-series": series_site(tmp_path / "b"),
        "dicom-images": dicom_folder_site(tmp_path / "c"),
    }
    summary, server = run_sites(tmp_path, sites, "ok")
    assert sorted(summary["per_client"]) == sorted(sites)
    assert server[-1]["num_failed"] == 0
    for metrics in summary["per_client"].values():  # one output per structure, scored each
        assert {"dice_outer", "dice_inner", "iou_outer", "iou_inner"} <= set(metrics)
        assert all(np.isfinite(v) for v in metrics.values() if isinstance(v, float))


@pytest.mark.parametrize("kind", ["no-pixel-data", "label-shape", "mixed-series", "value-outside-map", "group-missing"])
def test_a_site_with_bad_medical_data_is_named_and_the_others_go_on(tmp_path, kind):
    bad, says = break_site(kind, tmp_path / "bad")
    sites = {"good": volume_site(tmp_path / "good"), "broken": bad}
    summary, server = run_sites(tmp_path, sites, kind)
    assert sorted(summary["per_client"]) == ["good"]
    assert server[0]["num_failed"] >= 1  # its train (and evaluate) replies are errors
    failure = " ".join(server[0]["failed"])
    assert "broken" in failure or "DataError" in failure
    assert any(re.search(says, f, flags=re.S) for f in server[0]["failed"]), failure
