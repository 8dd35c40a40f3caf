"""Per-site data in a deployment: each SuperNode's node-config data-path names its own data."""

import json
from pathlib import Path

import numpy as np
import pytest

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.data import DataError, DataSpec, site_data_spec
from medflower.inprocess import run_inprocess


def write_site_npz(path: Path, n=(60, 12, 24), shift=0) -> Path:
    rng = np.random.default_rng(shift)
    arrays = {}
    for split, size in zip(("train", "val", "test"), n):
        labels = np.arange(size) % 2
        images = rng.integers(0, 60, (size, 28, 28)).astype(np.uint8)
        images[labels == 1, 8:20, 8:20] = 220  # a bright square means "pneumonia"
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels.reshape(-1, 1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


def test_site_data_spec_accepts_file_folder_and_manifest(tmp_path):
    npz = write_site_npz(tmp_path / "a" / "pneumoniamnist.npz")
    assert site_data_spec(DataSpec(), str(npz)).dataset == "medmnist:pneumoniamnist"
    assert site_data_spec(DataSpec(), str(tmp_path / "a")).data_dir == str(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.csv").write_text("path,label\n")
    assert site_data_spec(DataSpec(), str(tmp_path / "b")).dataset == f"csv:{tmp_path / 'b' / 'manifest.csv'}"


def test_site_data_spec_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="data-path .*nowhere does not exist"):
        site_data_spec(DataSpec(), str(tmp_path / "nowhere"))
    write_site_npz(tmp_path / "two" / "x.npz")
    write_site_npz(tmp_path / "two" / "y.npz")
    with pytest.raises(DataError, match="found x.npz, y.npz"):
        site_data_spec(DataSpec(), str(tmp_path / "two"))


def test_site_dataset_needs_num_classes():
    with pytest.raises(ConfigError, match="'num-classes' = 0 .*dataset='site'"):
        ExperimentConfig.from_run_config({**defaults(), "dataset": "site"})


def test_sites_with_own_data_train_and_a_broken_site_is_skipped(tmp_path):
    sites = [write_site_npz(tmp_path / f"site-{i}" / "pneumoniamnist.npz", shift=i) for i in range(2)]
    node_configs = [
        {"data-path": str(sites[0].parent), "site-name": "hospital-a"},
        {"data-path": str(sites[1]), "site-name": "hospital-b"},
        {"data-path": str(tmp_path / "missing"), "site-name": "hospital-c"},
    ]
    config = {
        "dataset": "site",
        "num-classes": 2,
        "img-size": 16,
        "patch-size": 8,
        "backbone-weights": "none",
        "num-rounds": 2,
        "lr": 0.01,
        "output-dir": str(tmp_path / "out"),
        "run-name": "sites",
    }
    summary, _ = run_inprocess(config, num_nodes=3, node_configs=node_configs)
    assert sorted(summary["per_client"]) == ["hospital-a", "hospital-b"]
    assert summary["final"]["auc"] > 0.6
    server = [
        json.loads(line)
        for line in (tmp_path / "out" / "sites" / "metrics.jsonl").read_text().splitlines()
        if '"server"' in line
    ]
    assert all(r["num_failed"] == 1 for r in server)
    assert "missing does not exist" in server[0]["failed"][0]


def test_site_with_more_classes_than_the_model_is_refused(tmp_path):
    site = write_site_npz(tmp_path / "s" / "pneumoniamnist.npz")
    config = {
        "dataset": "site",
        "num-classes": 1,
        "img-size": 16,
        "patch-size": 8,
        "backbone-weights": "none",
        "num-rounds": 1,
        "output-dir": str(tmp_path / "out"),
        "run-name": "x",
    }
    with pytest.raises(RuntimeError, match="no node answered"):
        run_inprocess(config, num_nodes=1, node_configs=[{"data-path": str(site)}])


def test_segmentation_sites_with_own_folders_run_sgca(tmp_path):
    """A deployed hospital points its node-config data-path at its own images/ + masks/ folder."""
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "data", {"hospital-a": 0, "hospital-b": 1}, per_site=40, size=32, seed=0)
    node_configs = [{"data-path": str(root / name), "site-name": name} for name in ("hospital-a", "hospital-b")]
    config = {
        "dataset": "site",
        "task": "segmentation",
        "num-classes": 2,
        "strategy": "sgca",
        "sgca-solver": "closed-form",
        "adapter": "bottleneck",
        "img-size": 32,
        "patch-size": 8,
        "backbone-weights": "none",
        "num-rounds": 1,
        "output-dir": str(tmp_path / "out"),
        "run-name": "seg",
    }
    summary, _ = run_inprocess(config, num_nodes=2, node_configs=node_configs)
    assert sorted(summary["per_client"]) == ["hospital-a", "hospital-b"]
    for v in summary["per_client"].values():  # the mean Dice is the mean of the two classes' Dice
        assert v["dice"] == pytest.approx((v["dice_class-1"] + v["dice_class-2"]) / 2)


def test_a_classification_site_in_a_segmentation_run_is_refused(tmp_path):
    from flwr.app import Context, RecordDict

    from medflower.strategies.base import ClientRuntime

    site = write_site_npz(tmp_path / "s" / "pneumoniamnist.npz")
    cfg = ExperimentConfig.from_run_config({**defaults(), "dataset": "site", "task": "segmentation", "num-classes": 2})
    context = Context(run_id=1, node_id=1, node_config={"data-path": str(site)}, state=RecordDict(), run_config={})
    runtime = ClientRuntime(cfg, context, {"num-classes": 2}, 0, 1, str(site))
    with pytest.raises(DataError, match="holds classification data but the run trains a segmentation model"):
        _ = runtime.data
