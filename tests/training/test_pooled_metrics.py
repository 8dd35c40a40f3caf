"""Pooled metrics: classification sites send their test confusion counts, the server sums the valid ones into
balanced accuracy on the union of the test splits (SiFT's metric), writes it to the round record and summary.json,
and the experiment runner uses it as a column and as a target; malformed counts are left out, the run goes on."""

import json
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, balanced_accuracy_score

import medflower.strategies.fedavg as fedavg_module
from medflower.config import ExperimentConfig, defaults
from medflower.contract import FederatedStrategy, Reply
from medflower.experiments import main
from medflower.inprocess import run_inprocess
from medflower.results import RunRecorder
from medflower.training.metrics import CONFUSION, check_confusion, confusion_counts, pooled_metrics

C = 4  # class 3 is predicted but never true: it has no support and is left out of the balanced accuracy


def site_predictions(seed: int, balance: list[float], hit: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels drawn with ``balance`` over classes 0-2; a prediction is right with probability ``hit``."""
    rng = np.random.default_rng(seed)
    y = rng.choice(3, size=n, p=balance)
    pred = np.where(rng.random(n) < hit, y, rng.integers(0, C, size=n))
    return y, pred


# A small balanced site that predicts well, a large class-0 site that predicts badly, a class-2 site in between.
SITES = [
    site_predictions(0, [1 / 3, 1 / 3, 1 / 3], 0.95, 60),
    site_predictions(1, [0.9, 0.05, 0.05], 0.2, 400),
    site_predictions(2, [0.1, 0.1, 0.8], 0.6, 100),
]


def reply(i: int, metrics: dict) -> Reply:
    return Reply(node_id=i + 1, client=f"site-{i}", arrays=OrderedDict(), metrics=metrics, config={})


def site_metrics(y: np.ndarray, pred: np.ndarray) -> dict:
    return {
        "balanced_accuracy": balanced_accuracy_score(y, pred),
        "n": float(len(y)),
        CONFUSION: confusion_counts(y, pred, C),
    }


@pytest.fixture
def strategy(tiny, tmp_path):
    """The shared server half over a C-class model, with its recorder."""
    cfg = ExperimentConfig.from_run_config({**defaults(), **tiny()})
    return FederatedStrategy(cfg, RunRecorder(tmp_path / "run"), {}, num_classes=C)


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_the_pooled_balanced_accuracy_is_sklearns_on_the_concatenated_predictions(strategy):
    pooled = strategy.record_evaluation(1, [reply(i, site_metrics(y, pred)) for i, (y, pred) in enumerate(SITES)])
    y_all, pred_all = np.concatenate([y for y, _ in SITES]), np.concatenate([p for _, p in SITES])
    assert pooled["pooled_balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y_all, pred_all), abs=1e-12)
    assert pooled["pooled_accuracy"] == pytest.approx(accuracy_score(y_all, pred_all), abs=1e-12)
    assert pooled["pooled_n"] == len(y_all) and pooled["pooled_sites"] == 3 and strategy.stats.rejected == []
    site_mean = np.mean([balanced_accuracy_score(y, pred) for y, pred in SITES])
    assert abs(pooled["pooled_balanced_accuracy"] - site_mean) > 0.05  # not the mean over sites
    logged = strategy.recorder.records("eval")
    assert [r["client"] for r in logged] == ["site-0", "site-1", "site-2"] and all(CONFUSION in r for r in logged)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (list(range(C * C - 1)), "15 confusion counts, expected 4×4 = 16"),
        ([-1] + [0] * (C * C - 1), "non-negative finite integers"),
        ([math.nan] + [0.0] * (C * C - 1), "non-negative finite integers"),
        ([math.inf] + [0.0] * (C * C - 1), "non-negative finite integers"),
        ([0.5] + [0.0] * (C * C - 1), "non-negative finite integers"),
        ([1e300] + [0.0] * (C * C - 1), "non-negative finite integers"),
        (7.0, "a float, not a list"),
        (["7"] * (C * C), "not numbers"),
        ([1] * (C * C), "add up to 16, but the site reports n = 60.0"),
    ],
    ids=["length", "negative", "nan", "inf", "fraction", "huge", "scalar", "text", "total"],
)
@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_malformed_counts_are_left_out_with_their_reason_and_the_round_goes_on(strategy, bad, reason):
    good = [site_metrics(*SITES[1]), site_metrics(*SITES[2])]
    pooled = strategy.record_evaluation(
        1, [reply(0, {**site_metrics(*SITES[0]), CONFUSION: bad}), reply(1, good[0]), reply(2, good[1])]
    )
    assert len(strategy.stats.rejected) == 1 and strategy.stats.rejected[0].startswith("site-0: ")
    assert reason in strategy.stats.rejected[0]
    expected = pooled_metrics(sum(np.reshape(m[CONFUSION], (C, C)) for m in good))
    assert {k: pooled[k] for k in expected} == expected and pooled["pooled_sites"] == 2
    logged = strategy.recorder.records("eval")
    assert len(logged) == 3 and CONFUSION not in logged[0] and logged[0]["balanced_accuracy"] > 0  # metrics kept
    assert check_confusion(bad, C, 60.0)[0] is None


def test_no_counts_no_pooled_metrics(strategy):
    pooled = strategy.record_evaluation(1, [reply(0, {"dice": 0.8, "n": 4.0})])  # a segmentation site: no counts
    assert pooled == {} and strategy.stats.rejected == []


def pooled_from_records(evals: list[dict], classes: int = 8) -> dict:
    """The pooled metrics from the counts the sites' eval records carry (``synthetic`` has 8 classes)."""
    return pooled_metrics(sum(np.reshape(r[CONFUSION], (classes, classes)) for r in evals))


def test_a_run_and_its_experiment_table_report_the_pooled_balanced_accuracy(tmp_path):
    base = {
        "synthetic-size": 160,
        "img-size": 16,
        "patch-size": 8,
        "backbone-weights": "none",
        "num-rounds": 2,
        "partition": "dirichlet",
        "dirichlet-alpha": 0.5,
    }
    plan = {
        "name": "pooled",
        "num-supernodes": 3,
        "seeds": [0],
        "per-client": True,
        "metrics": ["pooled_balanced_accuracy", "balanced_accuracy"],
        "targets": {"metric": "pooled_balanced_accuracy", "values": [0.0, 1.01]},
        "base": base,
        "runs": [{"name": "fedavg", "strategy": "fedavg"}],
    }
    path = tmp_path / "pooled.yaml"
    path.write_text(json.dumps(plan))  # JSON is YAML
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--engine", "inprocess"]) == 0
    out = tmp_path / "out" / "pooled"
    run_dir = out / "fedavg-seed0"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    for r in evals:  # each site's counts are its own predictions: they give its own (balanced) accuracy
        own = pooled_from_records([r])
        assert (
            own["pooled_n"] == r["n"] and len(r[CONFUSION]) == 8 * 8 and all(isinstance(v, int) for v in r[CONFUSION])
        )
        assert own["pooled_balanced_accuracy"] == pytest.approx(r["balanced_accuracy"], abs=1e-12)
        assert own["pooled_accuracy"] == pytest.approx(r["accuracy"], abs=1e-12)
    server = [r for r in records if r["kind"] == "server"]
    for s in server:
        expected = pooled_from_records([r for r in evals if r["round"] == s["round"]])
        assert {k: s[k] for k in expected} == expected and s["pooled_sites"] == 3 and s["num_rejected"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary["final"]
    assert final["pooled_balanced_accuracy"] == server[-1]["pooled_balanced_accuracy"]
    assert final["pooled_accuracy"] == server[-1]["pooled_accuracy"] and CONFUSION not in final
    site_mean = np.mean([r["balanced_accuracy"] for r in evals if r["round"] == 2])
    assert final["balanced_accuracy"] == pytest.approx(site_mean)
    assert abs(final["balanced_accuracy"] - final["pooled_balanced_accuracy"]) > 1e-6  # two different metrics
    markdown = (run_dir / "summary.md").read_text()
    assert "| **pooled** (all test rows) |" in markdown and CONFUSION not in markdown
    result = json.loads((out / "comparison.json").read_text())
    row = result["table"]["fedavg"]
    assert row["pooled_balanced_accuracy"]["values"] == [final["pooled_balanced_accuracy"]]
    assert row["rounds_to_0.0"]["values"] == [1] and row["rounds_to_1.01"]["values"] == [None]
    table = (out / "comparison.md").read_text()
    assert "| run | pooled_balanced_accuracy | balanced_accuracy |" in table
    assert "whose pooled_balanced_accuracy reaches x" in table
    assert "balanced_accuracy per site" in table and "pooled_balanced_accuracy per site" not in table


def test_bad_counts_from_sites_do_not_stop_a_run(tiny, monkeypatch):
    original = fedavg_module.FedAvgClient.evaluate
    bad = {0: list(range(8 * 8 - 1)), 1: [-1] * (8 * 8), 2: [math.nan] * (8 * 8)}  # wrong length, negative, NaN

    def tampered(self, message):
        content = original(self, message)
        if self.rt.partition_id in bad:
            content["metrics"][CONFUSION] = bad[self.rt.partition_id]
        return content

    monkeypatch.setattr(fedavg_module.FedAvgClient, "evaluate", tampered)
    config = tiny(**{"run-name": "bad-counts", "num-rounds": 1, "synthetic-size": 160})
    summary, _ = run_inprocess(config, num_nodes=4)
    run_dir = Path(config["output-dir"]) / "bad-counts"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    server = [r for r in records if r["kind"] == "server"]
    assert len(server) == 1 and server[0]["num_rejected"] == 3 and server[0]["pooled_sites"] == 1
    assert any("63 confusion counts" in r for r in server[0]["rejected"])
    honest = [r for r in records if r["kind"] == "eval" and CONFUSION in r]
    assert (
        len(honest) == 1
        and summary["final"]["pooled_balanced_accuracy"] == pooled_from_records(honest)["pooled_balanced_accuracy"]
    )
    # wrong length and negative counts drop the counts only; a NaN rejects the whole reply at the checking step
    assert any("metric confusion has a value that is not a finite number" in r for r in server[0]["rejected"])
    assert summary["communication"]["rejected_replies"] == 3 and len(summary["per_client"]) == 3
