"""Per-site data in a deployment: each SuperNode's node-config data-path names its own data."""

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from PIL import Image

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract.client import ClientRuntime
from medflower.data import DataError, DataSpec, SiteClasses, load_site_data, site_data_spec
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


def write_site_csv(folder: Path, labels: list, shade: int = 0) -> Path:
    """A site folder with manifest.csv (path,label) and one small png per row."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = ["path,label"]
    for i, label in enumerate(labels):
        Image.fromarray(np.full((12, 12, 3), (shade + 40 * i) % 256, np.uint8)).save(folder / "img" / f"{i}.png")
        lines.append(f"img/{i}.png,{label}")
    (folder / "manifest.csv").write_text("\n".join(lines) + "\n")
    return folder / "manifest.csv"


def site_runtime(data_path: Path, **run_config) -> ClientRuntime:
    """The runtime of a site whose node-config data-path is ``data_path``, in a run with ``run_config``."""
    cfg = ExperimentConfig.from_run_config({**defaults(), "dataset": "site", "img-size": 16, **run_config})
    node = {"data-path": str(data_path)}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    return ClientRuntime(cfg, context, {"num-classes": cfg.declared_num_classes}, 0, 1, str(data_path))


def site_labels(runtime: ClientRuntime) -> dict[str, int]:
    """The class index of each image file of a site (by file name), over its three splits."""
    data = runtime.data
    return {
        Path(path).name: int(label)
        for split in (data.train, data.val, data.test)
        for path, label in zip(split.paths, split.labels)
    }


# ---------------------------------------------------------------- class-names: one numbering for every site


def test_class_names_give_the_same_index_on_sites_with_different_labels(tmp_path):
    """A site that saw only 'malignant' trains it as index 1, like a site that saw both (it used to be its 0)."""
    only = write_site_csv(tmp_path / "a", ["malignant"] * 10)
    both = write_site_csv(tmp_path / "b", ["benign", "malignant"] * 5)
    names = {"class-names": "benign,malignant"}
    a, b = site_runtime(only.parent, **names), site_runtime(both, **names)
    assert set(site_labels(a).values()) == {1}
    assert site_labels(b) == {f"{i}.png": i % 2 for i in range(10)}
    assert a.data.class_names == b.data.class_names == ["benign", "malignant"]
    assert a.data.num_classes == b.data.num_classes == 2


def test_a_label_outside_class_names_is_refused(tmp_path):
    site = write_site_csv(tmp_path / "s", ["benign", "melanoma", "nevus", "melanoma", "benign", "nevus"])
    with pytest.raises(DataError) as err:
        _ = site_runtime(site, **{"class-names": "benign,malignant"}).data
    assert str(err.value) == (
        f"csv:{site}: 2 label(s) in 4 row(s) are not in run-config class-names: 'melanoma', 'nevus' "
        "(class-names: 'benign', 'malignant')"
    )


def test_label_names_without_class_names_are_refused(tmp_path):
    site = write_site_csv(tmp_path / "s", ["malignant", "benign"] * 4)
    with pytest.raises(DataError) as err:
        _ = site_runtime(site, **{"num-classes": 2}).data
    assert str(err.value) == (
        f"csv:{site}: the labels are class names (2 distinct: 'benign', 'malignant') but run-config class-names "
        "is unset; a site does not number its own label names (another site would give the same index to another "
        "class): set run-config class-names (comma-separated, in index order) or write the labels as class "
        "indices 0..1"
    )


def test_integer_labels_are_the_run_s_class_indices(tmp_path):
    site = write_site_csv(tmp_path / "s", [1, 0, 2] * 3)
    assert sorted(set(site_labels(site_runtime(site, **{"num-classes": 3})).values())) == [0, 1, 2]
    assert site_runtime(site, **{"num-classes": 4}).data.class_names == ["0", "1", "2", "3"]  # as the server names them
    with pytest.raises(DataError) as err:
        _ = site_runtime(site, **{"num-classes": 2}).data
    assert str(err.value) == (
        f"csv:{site}: 3 row(s) have class indices outside 0..1 (the run has 2 classes, run-config num-classes): 2"
    )
    # with class-names, integer labels are indices into them ...
    assert site_runtime(site, **{"class-names": "a,b,c"}).data.class_names == ["a", "b", "c"]
    # ... unless the names are integers themselves: then labels match them as text (grade 2 is index 1 here)
    graded = write_site_csv(tmp_path / "g", [2, 3] * 4)
    assert set(site_labels(site_runtime(graded, **{"class-names": "1,2,3"})).values()) == {1, 2}


def test_npz_sites_take_the_run_s_class_names(tmp_path):
    site = write_site_npz(tmp_path / "s" / "pneumoniamnist.npz")
    data = site_runtime(site, **{"class-names": "healthy,sick"}).data
    assert data.class_names == ["healthy", "sick"] and set(data.train.labels.tolist()) == {0, 1}
    arrays = dict(np.load(write_site_npz(tmp_path / "t" / "x.npz")))
    arrays["val_labels"][:2] = [[2], [7]]
    np.savez(tmp_path / "t" / "x.npz", **arrays)
    with pytest.raises(DataError, match=r"x.npz\): 2 row\(s\) have class indices outside 0..1 .*num-classes\): 2, 7"):
        _ = site_runtime(tmp_path / "t", **{"num-classes": 2}).data


def test_segmentation_sites_name_the_run_s_foreground_classes(tmp_path):
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "data", {"a": 0}, per_site=8, size=16, seed=0) / "a"
    base = DataSpec(img_size=16)
    named = load_site_data(base, str(root), SiteClasses(2, ("organ", "lesion")), "segmentation")
    assert named.class_names == ["organ", "lesion"]
    assert load_site_data(base, str(root), SiteClasses(3), "segmentation").class_names == [
        "class-1",
        "class-2",
        "class-3",
    ]
    with pytest.raises(DataError, match="masks hold foreground classes up to 2 but the run has 1"):
        load_site_data(base, str(root), SiteClasses(1), "segmentation")


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
        # share-error-detail: the server sees the reason, not only the error's kind
        {"data-path": str(tmp_path / "missing"), "site-name": "hospital-c", "share-error-detail": True},
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

    from medflower.contract import ClientRuntime

    site = write_site_npz(tmp_path / "s" / "pneumoniamnist.npz")
    cfg = ExperimentConfig.from_run_config({**defaults(), "dataset": "site", "task": "segmentation", "num-classes": 2})
    context = Context(run_id=1, node_id=1, node_config={"data-path": str(site)}, state=RecordDict(), run_config={})
    runtime = ClientRuntime(cfg, context, {"num-classes": 2}, 0, 1, str(site))
    with pytest.raises(DataError, match="holds classification data but the run trains a segmentation model"):
        _ = runtime.data
