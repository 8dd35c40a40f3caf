"""Pictures of a run: each site draws its model's predictions on a few of its own test images into its own folder
(the run folder's sites/<site>/ in simulation, node-config figures-dir on a SuperNode, nothing without it),
summary.md shows the per-site bars beside the curves and links the sites' pictures, and the experiment runner draws
its per-site table."""

import json
import logging

import pytest
from flwr.app import Context, RecordDict
from helpers import TINY, run_dir_of
from PIL import Image

from medflower.config import ExperimentConfig, defaults
from medflower.contract.client import ClientRuntime
from medflower.inprocess import run_inprocess
from medflower.results import RunRecorder

SEG = {"dataset": "synthetic-seg", "synthetic-size": 96, "site-figures": 4, "run-figures": True}


def pictures(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))


def test_a_segmentation_run_leaves_each_sites_pictures_of_the_first_and_last_round_in_its_folder(tiny):
    config = tiny(**SEG, **{"run-name": "seg", "num-rounds": 3})
    summary, _ = run_inprocess(config, num_nodes=2)
    run_dir = run_dir_of(config)
    sites = sorted(summary["per_client"])
    assert len(sites) == 2
    expected = [f"sites/{site}/predictions-round-{r:03d}.png" for site in sites for r in (1, 3)]
    # the server draws only the curves and the bars; every other picture is a site's, in its own folder
    assert pictures(run_dir) == sorted(["curves.png", "sites.png", *expected])
    for name in expected:
        with Image.open(run_dir / name) as image:
            assert image.width > 2 * image.height  # four test images side by side
    markdown = (run_dir / "summary.md").read_text()
    assert "![test metrics per round](curves.png) ![final test metrics per site](sites.png)" in markdown
    for site in sites:
        first, last = (f"sites/{site}/predictions-round-{r:03d}.png" for r in (1, 3))
        assert f"| {site} | [round 1]({first}), [round 3]({last}) |" in markdown
    assert (run_dir / "sites.png").stat().st_size > 1000


def site(tmp_path, node: dict, rnd: int, **run_config) -> ClientRuntime:
    """Partition 0 of 2 as a SuperNode runs it (no simulation engine on the stack), told round ``rnd`` by a server
    that suggests its run folder's client-state/ as every simulation's server does."""
    cfg = ExperimentConfig.from_run_config({**defaults(), **TINY, **SEG, "num-rounds": 3, **run_config})
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 2, **node},
        state=RecordDict(),
        run_config={},
    )
    server = {"state-dir": str(tmp_path / "server" / "run" / "client-state"), "run-name": "run", "run-uid": "u1"}
    return ClientRuntime(cfg, context, {"round": rnd, **server}, 0, 2)


def test_without_run_figures_the_server_draws_neither_the_curves_nor_the_bars(tiny):
    config = tiny(**{"run-name": "plain", "num-rounds": 1, "run-figures": False, "site-figures": 0})
    run_inprocess(config, num_nodes=2)
    run_dir = run_dir_of(config)
    assert pictures(run_dir) == []
    assert "| **mean** |" in (run_dir / "summary.md").read_text()
    assert ".png" not in (run_dir / "summary.md").read_text()


def test_a_supernode_draws_only_into_its_own_figures_dir_and_nowhere_without_one(tmp_path):
    metrics = site(tmp_path, {}, 1).evaluate_splits()
    assert "dice" in metrics
    assert pictures(tmp_path) == []  # never where the server says
    own = tmp_path / "hospital"
    for rnd in (1, 2, 3):
        site(tmp_path, {"figures-dir": str(own), "site-name": "hospital-a"}, rnd).evaluate_splits()
    assert pictures(tmp_path) == [
        f"hospital/run-u1/hospital-a/predictions-round-{r:03d}.png" for r in (1, 3)
    ]  # the first and the last round, in a folder per run and site
    site(tmp_path, {"figures-dir": "", "site-name": "hospital-b"}, 1).evaluate_splits()
    site(tmp_path, {"figures-dir": str(own), "site-name": "hospital-c"}, 1, **{"site-figures": 0}).evaluate_splits()
    assert len(pictures(tmp_path)) == 2


def test_a_picture_that_cannot_be_drawn_is_said_and_the_evaluation_goes_on(tmp_path, monkeypatch, caplog):
    import medflower.figures

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(medflower.figures, "plot_segmentation_samples", broken)
    runtime = site(tmp_path, {"figures-dir": str(tmp_path / "own")}, 1)
    with caplog.at_level(logging.WARNING):
        metrics = runtime.evaluate_splits()
    assert "dice" in metrics and pictures(tmp_path) == []
    assert any("no picture of round 1 (RuntimeError: no display)" in r.getMessage() for r in caplog.records)


def test_summary_md_shows_the_per_site_bars_beside_the_curves_and_links_the_sites_pictures(tmp_path):
    run_dir = tmp_path / "run"
    rec = RunRecorder(run_dir)
    rec.log_client(1, "site-a", "eval", {"dice": 0.5, "iou": 0.4, "loss": 0.3})
    rec.log_client(1, "site-b", "eval", {"dice": 0.7, "iou": 0.6, "loss": 0.2})
    rec.log_server(1, bytes_up=1, bytes_down=1, num_failed=0, num_rejected=0)
    (run_dir / "sites" / "site-a").mkdir(parents=True)
    (run_dir / "sites" / "site-a" / "predictions-round-001.png").write_bytes(b"")
    rec.finish("fedavg", "synthetic-seg", 1.0)
    markdown = (run_dir / "summary.md").read_text()
    assert "![final test metrics per site](sites.png)" in markdown
    assert "| site-a | [round 1](sites/site-a/predictions-round-001.png) |" in markdown
    assert "| site-b |" not in markdown.split("drawn by the site")[1]  # a site without pictures is not linked
    assert (run_dir / "sites.png").stat().st_size > 1000
    assert "sites" not in json.loads((run_dir / "summary.json").read_text())


def test_the_experiment_comparison_draws_its_per_site_table(tmp_path):
    from medflower.experiments import PER_SITE, compare

    plan = {
        "name": "pictures",
        "seeds": [0],
        "num-supernodes": 3,
        "metrics": ["dice", "pooled_accuracy"],
        "runs": [{"name": "fedavg"}, {"name": "local"}],
    }
    for run, base in (("fedavg", 0.6), ("local", 0.4)):
        folder = tmp_path / f"{run}-seed0"
        folder.mkdir()
        per_client = {f"site-{i}": {"dice": base + 0.1 * i} for i in range(3)}
        summary = {
            "final": {"dice": base + 0.1},
            "per_client": per_client,
            "rounds": 2,
            "communication": {"bytes_up": 0, "bytes_down": 0},
        }
        (folder / "summary.json").write_text(json.dumps(summary))
        evals = [{"kind": "eval", "round": 1, "client": c, **v} for c, v in per_client.items()]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    result = compare(plan, tmp_path)
    assert result["per_client"]["local"]["dice"]["site-2"] == pytest.approx(0.6)
    assert (tmp_path / PER_SITE).stat().st_size > 1000
    assert f"![per site]({PER_SITE})" in (tmp_path / "comparison.md").read_text()
