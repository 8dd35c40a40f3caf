"""A site reads run-config paths only below its node-config data-roots (docs/data.md#data-roots)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from PIL import Image

from medflower.config import ExperimentConfig, defaults
from medflower.contract.client import ClientRuntime
from medflower.data import DataError, DataSpec, check_data_roots, data_roots
from medflower.data.roots import in_simulation

NOT_SIMULATED = "names files on this site, but this SuperNode sets no node-config data-roots"


def write_manifest(folder: Path, n: int = 10) -> Path:
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(np.full((12, 12, 3), 20 * i % 256, np.uint8)).save(folder / "img" / f"{i}.png")
    manifest = folder / "manifest.csv"
    manifest.write_text("path,label\n" + "".join(f"img/{i}.png,{i % 2}\n" for i in range(n)))
    return manifest


def write_npz(path: Path, n: int = 12) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split in ("train", "val", "test"):
        arrays[f"{split}_images"] = np.zeros((n, 8, 8), np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 2).reshape(-1, 1)
    np.savez(path, **arrays)
    return path


def partition_runtime(node_config: dict, **run_config) -> ClientRuntime:
    """Site 0 of 2 in a partition-mode run (the run config names the data), called outside any simulation."""
    cfg = ExperimentConfig.from_run_config(
        {**defaults(), "partition": "iid", "img-size": 16, **run_config}, check_paths=False
    )
    node = {"partition-id": 0, "num-partitions": 2, **node_config}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    return ClientRuntime(cfg, context, {}, 0, 2)


def refused(spec: DataSpec, roots: Path | str) -> str:
    with pytest.raises(DataError) as err:
        check_data_roots(spec, {"data-roots": str(roots)})
    return str(err.value)


def test_proc_self_environ_is_refused_without_reading_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDFLOWER_TEST_SECRET", "hunter2")
    runtime = partition_runtime({"data-roots": str(tmp_path)}, dataset="csv:/proc/self/environ")
    with pytest.raises(DataError) as err:
        _ = runtime.data
    assert str(err.value) == (
        "run-config dataset 'csv:/proc/self/environ' resolves (symlinks followed) outside this site's node-config "
        "data-roots; the site operator allows a folder by adding it to data-roots"
    )
    assert "hunter2" not in str(err.value)


def test_without_data_roots_a_deployed_site_refuses_run_config_paths(tmp_path, monkeypatch):
    monkeypatch.delenv("MEDFLOWER_DATA_ROOTS", raising=False)
    manifest = write_manifest(tmp_path / "shared")
    for dataset in (f"csv:{manifest}", f"segfolder:{tmp_path}", "medmnist:pneumoniamnist"):
        with pytest.raises(DataError) as err:
            _ = partition_runtime({}, dataset=dataset).data
        assert str(err.value) == (
            f"run-config dataset {dataset!r} {NOT_SIMULATED}: a site reads run-config paths only below the folders "
            "its operator lists, e.g. flower-supernode ... --node-config \"data-roots='/data/shared'\" (or the "
            "environment variable MEDFLOWER_DATA_ROOTS); see docs/data.md#data-roots"
        )
    assert len(partition_runtime({}, dataset="synthetic", **{"synthetic-size": 120}).data.train) > 0  # no path


def test_an_allowed_path_is_read(tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "shared" / "isic")
    link = tmp_path / "link-to-shared"  # a root given through a symlink is its real folder
    link.symlink_to(tmp_path / "shared")
    for roots in (f"{tmp_path / 'elsewhere'}, {tmp_path / 'shared'}", str(link)):
        data = partition_runtime({"data-roots": roots}, dataset=f"csv:{manifest}").data
        assert len(data.train) + len(data.val) + len(data.test) == 5
    monkeypatch.setenv("MEDFLOWER_DATA_ROOTS", str(tmp_path / "shared"))  # the environment when node-config is silent
    assert data_roots({}) == (str(tmp_path / "shared"),)
    assert len(partition_runtime({}, dataset=f"csv:{manifest}").data.train) > 0
    assert data_roots({"data-roots": "/srv/a,/srv/b/"}) == ("/srv/a", "/srv/b")  # node-config wins


def test_symlinks_out_of_the_roots_are_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    manifest = write_manifest(outside / "site")
    root.mkdir()
    (root / "manifest.csv").symlink_to(manifest)
    spec = DataSpec(dataset=f"csv:{root / 'manifest.csv'}")
    assert refused(spec, root) == (
        f"run-config dataset 'csv:{root / 'manifest.csv'}' resolves (symlinks followed) outside this site's "
        "node-config data-roots; the site operator allows a folder by adding it to data-roots"
    )
    # The manifest is inside, its images folder a symlink out: the images are refused before any is read.
    (root / "site").mkdir()
    (root / "site" / "manifest.csv").write_text(manifest.read_text())
    (root / "site" / "img").symlink_to(outside / "site" / "img")
    spec = DataSpec(dataset=f"csv:{root / 'site' / 'manifest.csv'}")
    assert refused(spec, root) == (
        f"run-config dataset 'csv:{root / 'site' / 'manifest.csv'}': 10 file(s) it reads resolve (symlinks followed) "
        f"outside this site's node-config data-roots: line 2 ({root / 'site' / 'img' / '0.png'}), "
        f"line 3 ({root / 'site' / 'img' / '1.png'}), line 4 ({root / 'site' / 'img' / '2.png'}), "
        f"line 5 ({root / 'site' / 'img' / '3.png'}), line 6 ({root / 'site' / 'img' / '4.png'}) ... "
        "(+5 more, 10 in total)"
    )


def test_a_segfolder_mask_linked_out_of_the_roots_is_refused_before_it_is_read(tmp_path):
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "root" / "fed", {"a": 0}, per_site=3, size=16, seed=0)
    spec = DataSpec(dataset=f"segfolder:{root}", partition="iid")
    check_data_roots(spec, {"data-roots": str(tmp_path / "root")})
    secret = tmp_path / "secret.png"
    secret.write_text("not a mask: reading it would fail differently")
    mask = next((root / "a" / "masks").iterdir())
    mask.unlink()
    mask.symlink_to(secret)
    assert refused(spec, tmp_path / "root") == (
        f"run-config dataset 'segfolder:{root}': 1 file(s) it reads resolve (symlinks followed) outside this "
        f"site's node-config data-roots: {mask}"
    )


def test_medmnist_data_dir_and_flag_stay_below_the_roots(tmp_path):
    write_npz(tmp_path / "root" / "data" / "pneumoniamnist.npz")
    write_npz(tmp_path / "other" / "pneumoniamnist.npz")
    inside = DataSpec(dataset="medmnist:pneumoniamnist", data_dir=str(tmp_path / "root" / "data"))
    check_data_roots(inside, {"data-roots": str(tmp_path / "root")})
    outside = DataSpec(dataset="medmnist:pneumoniamnist", data_dir=str(tmp_path / "other"))
    assert refused(outside, tmp_path / "root") == (
        f"run-config data-dir {str(tmp_path / 'other')!r} resolves (symlinks followed) outside this site's "
        "node-config data-roots; the site operator allows a folder by adding it to data-roots"
    )
    climbing = DataSpec(dataset="medmnist:../../other/pneumoniamnist", data_dir=str(tmp_path / "root" / "data"))
    assert refused(climbing, tmp_path / "root").startswith(
        "run-config dataset 'medmnist:../../other/pneumoniamnist' resolves (symlinks followed) outside"
    )


def test_a_site_s_own_data_path_needs_no_data_roots(tmp_path):
    """node-config data-path is the operator's own choice: read wherever it is."""
    write_manifest(tmp_path / "site")
    cfg = ExperimentConfig.from_run_config({**defaults(), "dataset": "site", "num-classes": 2, "img-size": 16})
    node = {"data-path": str(tmp_path / "site"), "data-roots": str(tmp_path / "elsewhere")}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    runtime = ClientRuntime(cfg, context, {"num-classes": 2}, 0, 1, str(tmp_path / "site"))
    assert len(runtime.data.train) > 0


def test_simulated_sites_are_told_apart_from_deployed_ones():
    """Flower's simulation engine and medflower's in-process grid are on the stack of a simulated site's call."""
    from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor

    from medflower.inprocess import InProcessGrid

    seen = []

    def app(message, context):
        seen.append(in_simulation())
        return Message(RecordDict(), reply_to=message)

    assert not in_simulation()
    grid = InProcessGrid(app, 1, {})
    grid.send_and_receive([grid.create_message(RecordDict(), "query", 1, "1")])
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    VirtualClientEngineActor.run(None, lambda: app, grid.sent[0], "0", context)
    assert seen == [True, True]


def test_in_process_runs_read_run_config_paths_without_data_roots(tmp_path, monkeypatch):
    from medflower.inprocess import run_inprocess

    monkeypatch.delenv("MEDFLOWER_DATA_ROOTS", raising=False)

    manifest = write_manifest(tmp_path / "shared", n=24)
    config = {
        "dataset": f"csv:{manifest}",
        "partition": "iid",
        "img-size": 16,
        "patch-size": 8,
        "backbone-weights": "none",
        "num-rounds": 1,
        "output-dir": str(tmp_path / "out"),
        "run-name": "csv",
    }
    summary, _ = run_inprocess(config, num_nodes=2)
    assert len(summary["per_client"]) == 2


# ----------------------------------------------------------------------------- model files and open-time checks
def test_model_files_named_by_the_run_config_are_confined_too(tmp_path):
    from medflower.data.roots import check_model_paths
    from medflower.models.spec import ModelSpec

    roots, outside = tmp_path / "roots", tmp_path / "outside"
    roots.mkdir()
    outside.mkdir()
    np.save(outside / "emb.npy", np.zeros((2, 4), np.float32))
    (outside / "w.safetensors").write_bytes(b"x")
    node = {"data-roots": str(roots)}
    runtime = partition_runtime(node, **{"backbone-weights": str(outside / "w.safetensors")})
    with pytest.raises(DataError, match="run-config backbone-weights .* outside this site's node-config data-roots"):
        _ = runtime.model  # before the site builds its model
    with pytest.raises(DataError, match="run-config class-embeddings .* outside this site's node-config data-roots"):
        check_model_paths(ModelSpec(head="text", class_embeddings=str(outside / "emb.npy")), node)
    encoder = roots / "encoder"
    encoder.mkdir()
    (encoder / "config.json").symlink_to(outside / "emb.npy")  # a folder inside, a file of it linked out
    with pytest.raises(DataError, match="run-config text-encoder .* 1 file"):
        check_model_paths(ModelSpec(text_encoder=str(encoder)), node)
    for weights in ("auto", "none"):  # no path: 'auto' for litemedsam reads the installed package's own file
        check_model_paths(ModelSpec(backbone="litemedsam", weights=weights), node)
    with pytest.raises(DataError, match=NOT_SIMULATED.replace("names files", "names a file")):
        check_model_paths(ModelSpec(weights=str(roots / "w.pt")), {})


def test_a_file_swapped_for_a_symlink_after_the_roots_check_is_refused_when_opened(tmp_path):
    from medflower.data.roots import site_reads

    roots, outside = tmp_path / "roots", tmp_path / "outside"
    manifest = write_manifest(roots, n=10)
    outside.mkdir()
    Image.fromarray(np.full((12, 12, 3), 7, np.uint8)).save(outside / "secret.png")
    node = {"data-roots": str(roots)}
    runtime = partition_runtime(node, dataset=f"csv:{manifest}")
    data = runtime.data  # the listing check passes (and is cached)
    for png in (roots / "img").glob("*.png"):
        png.unlink()
        png.symlink_to(outside / "secret.png")
    check_data_roots(DataSpec(dataset=f"csv:{manifest}"), node)  # cached: still passes
    with site_reads(node), pytest.raises(DataError, match="outside this site's node-config data-roots when opened"):
        data.train[0]
