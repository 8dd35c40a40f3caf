"""Small sites: a metric undefined on a site's data is left out of its reply (a non-finite one is still refused), the
summary counts the sites each metric was computed on and shows steps per round, and a site whose training split
gives fewer than a handful of optimizer steps per epoch is told once."""

import json
import logging
import math
import threading
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from helpers import TINY, records, run_dir_of

from medflower.contract.client import ClientHalf
from medflower.contract.replies import RejectedReply, check_reply
from medflower.inprocess import run_inprocess
from medflower.results import FEW_STEPS, RunRecorder, few_steps_message, loader_steps

# 2 sites of 62 training samples (2 steps per epoch at batch-size 32); site-1's 2 validation samples are of one class
SMALL = {**TINY, "synthetic-size": 160, "val-fraction": 0.02, "num-rounds": 2}


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One run of the small federation and the warnings it logged."""
    config = {**SMALL, "output-dir": str(tmp_path_factory.mktemp("small") / "outputs"), "run-name": "small"}
    handler = Collect()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        run_inprocess(config, num_nodes=2)
    finally:
        logger.removeHandler(handler)
    return run_dir_of(config), handler.lines


def test_a_site_lacking_a_class_in_validation_keeps_its_test_metrics(small_run):
    run_dir, _ = small_run
    evals = {(r["client"], r["round"]): r for r in records(run_dir, "eval")}
    assert set(evals) == {(site, rnd) for site in ("site-0", "site-1") for rnd in (1, 2)}
    for rnd in (1, 2):
        assert "val_auc" in evals["site-0", rnd]  # two classes in its validation split
        assert "val_auc" not in evals["site-1", rnd]  # one class: AUC is undefined, left out
        assert {"auc", "accuracy", "loss", "val_accuracy"} <= set(evals["site-1", rnd])
    assert all(r["num_rejected"] == 0 for r in records(run_dir, "server") if "num_rejected" in r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["computed_on"]["val_auc"] == 1 and summary["computed_on"]["auc"] == 2
    assert summary["final"]["val_auc"] == summary["per_client"]["site-0"]["val_auc"]
    assert "val_auc on 1 of 2 sites" in (run_dir / "summary.md").read_text()


def test_a_small_site_is_told_once_with_a_batch_size_that_gives_more_steps(small_run):
    run_dir, warnings = small_run
    trained = records(run_dir, "train")
    assert len(trained) == 4
    for site in ("site-0", "site-1"):
        n = next(int(r["num-examples"]) for r in trained if r["client"] == site)
        steps = loader_steps(n, 32)
        assert steps < FEW_STEPS
        message = few_steps_message(n, steps, 32)
        assert f"batch-size {max(b for b in range(1, n) if loader_steps(n, b) >= FEW_STEPS)} or less" in message
        assert warnings.count(f"[medflower] small site {site}: {message}") == 1  # the server's, over 2 rounds
        assert warnings.count(f"[medflower] this site ({site}) is small: {message}") == 1  # the site's own
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_per_round"] == {"site-0": 2.0, "site-1": 2.0}
    assert "| steps/round |" in (run_dir / "summary.md").read_text()


def test_enough_steps_say_nothing_and_a_tiny_site_is_told_what_batch_size_cannot_do():
    assert few_steps_message(200, 7, 32) is None
    assert few_steps_message(17, 1, 32) == (
        "17 training samples give 1 optimizer step(s) per epoch at batch-size 32; batch-size 3 or less gives 6 or more"
    )
    assert loader_steps(17, 4) == 4  # not 5: the training loader drops a last batch of one sample
    assert few_steps_message(3, 1, 32).endswith("even batch-size 1 gives only 3 (more local-epochs train it longer)")


def test_the_suggested_batch_size_is_the_largest_that_gives_enough_steps_even_for_a_declared_billion():
    for n in range(FEW_STEPS, 1500):
        brute = max(b for b in range(1, n + 1) if loader_steps(n, b) >= FEW_STEPS)
        assert few_steps_message(n, 1, 2 * n).endswith(
            f"batch-size {brute} or less gives {loader_steps(n, brute)} or more"
        )
    # The server says this of every site's training reply, whose num-examples a hostile site chooses. The search
    # once tried every batch size up to n: 10^9 held a run for minutes, 10^15 would hold it for years.
    found = []
    worker = threading.Thread(target=lambda: found.append(few_steps_message(10**15, 1, 32)), daemon=True)
    worker.start()
    worker.join(60)
    assert found and found[0].endswith("batch-size 249999999999999 or less gives 5 or more")


def test_an_honest_site_leaves_an_undefined_metric_out_and_a_hostile_nan_is_still_rejected():
    half = ClientHalf(SimpleNamespace(partition_id=0, client="site-0"))
    honest = half.reply(metrics={"val_auc": math.nan, "auc": 0.75, "curve": [0.5, math.inf], "n": 4})
    assert dict(honest["metrics"]) == {"auc": 0.75, "n": 4.0}
    _, metrics, _ = check_reply(honest, None, 1e6)
    assert metrics == {"auc": 0.75, "n": 4.0}
    hostile = RecordDict(
        {
            "metrics": MetricRecord({"val_auc": math.nan, "auc": 0.75}),
            "info": ConfigRecord({"partition-id": 0, "client": "site-0"}),
        }
    )
    with pytest.raises(RejectedReply, match="metric val_auc is not a finite number"):
        check_reply(hostile, None, 1e6)


def test_the_summary_counts_the_sites_each_metric_was_computed_on(tmp_path):
    rec = RunRecorder(tmp_path / "run")
    rec.log_client(1, "a", "train", {"train_loss": 1.0, "train_steps": 3.0})
    rec.log_client(1, "a", "eval", {"auc": 0.6, "val_auc": 0.5, "accuracy": 0.5})
    rec.log_client(1, "b", "eval", {"accuracy": 0.7})
    rec.log_client(1, "c", "eval", {"accuracy": 0.9, "auc": 0.8})
    rec.log_server(1, bytes_up=1, bytes_down=1, num_failed=0, num_rejected=0)
    summary = rec.finish("fedavg", "synthetic", 1.0)
    assert summary["computed_on"] == {"accuracy": 3, "auc": 2, "val_auc": 1}
    assert summary["final"]["auc"] == pytest.approx(0.7)
    markdown = (tmp_path / "run" / "summary.md").read_text()
    assert "means over those sites: auc on 2 of 3 sites, val_auc on 1 of 3 sites." in markdown
    assert "| a | 0.6000 | 0.5000 | 3 |" in markdown and "| b | – | 0.7000 | – |" in markdown
