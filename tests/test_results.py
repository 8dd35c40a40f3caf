"""Run outputs: summary from metrics.jsonl, truncation on resume, tables and plots."""

import json
import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from medflower.results import RunRecorder, RunReport, summary_markdown
from medflower.training import auc_score, classification_metrics


def test_summary_uses_each_clients_last_evaluation(tmp_path):
    rec = RunRecorder(tmp_path / "run")
    rec.log_client(1, "a", "eval", {"auc": 0.6, "accuracy": 0.5})
    rec.log_client(1, "b", "eval", {"auc": 0.8, "accuracy": 0.7})
    rec.log_client(2, "a", "eval", {"auc": 0.9, "accuracy": 0.8})
    rec.log_server(1, bytes_up=10, bytes_down=20, num_failed=0, num_rejected=0)
    rec.log_server(2, bytes_up=10, bytes_down=20, num_failed=1, num_rejected=0)
    summary = rec.finish("fedavg", "synthetic", 1.0)
    assert summary["rounds"] == 2
    assert summary["per_client"]["a"]["auc"] == 0.9 and summary["per_client"]["b"]["auc"] == 0.8
    assert math.isclose(summary["final"]["auc"], 0.85)
    assert summary["communication"] == {"bytes_up": 20, "bytes_down": 40, "failed_replies": 1, "rejected_replies": 0}
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert "| **mean** | 0.8500" in summary_markdown(summary)
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


def test_without_run_figures_a_run_has_no_pictures_and_a_resumed_one_drops_its_old_ones(tmp_path):
    rec = RunRecorder(tmp_path / "run")
    for rnd in (1, 2):
        rec.log_client(rnd, "a", "eval", {"auc": 0.5 + 0.1 * rnd, "accuracy": 0.5})
        rec.log_server(rnd, bytes_up=10, bytes_down=20, num_failed=0, num_rejected=0)
    rec.finish("fedavg", "synthetic", 1.0)
    assert (tmp_path / "run" / "curves.png").is_file() and (tmp_path / "run" / "sites.png").is_file()
    rec.finish("fedavg", "synthetic", 1.0, figures=False)  # the same folder finished again (an extended run)
    assert not (tmp_path / "run" / "curves.png").exists() and not (tmp_path / "run" / "sites.png").exists()
    markdown = (tmp_path / "run" / "summary.md").read_text()
    assert "| **mean** |" in markdown and ".png" not in markdown


def test_a_strategys_report_lays_out_summary_md_and_curves_png(tmp_path):
    """The recorder asks the strategy's report (FederatedStrategy.report) for the title, the method's sections,
    the per-client columns and the plot; summary.json does not depend on it."""
    plotted = []

    class Report(RunReport):
        unit = "tasks"

        def title(self, summary):
            return f"{summary['strategy']} (variant X)"

        def sections(self, summary):
            return ["method table", ""]

        def columns(self, summary):
            return ["lca"]

        def plot(self, evals, path, title):
            plotted.append((len(evals), path.name, title))

    rec = RunRecorder(tmp_path / "run")
    rec.log_client(1, "a", "eval", {"auc": 0.6, "lca": 0.5})
    rec.log_server(1, bytes_up=10, bytes_down=20, num_failed=0, num_rejected=0)
    summary = rec.finish("fedkei", "synthetic", 1.0, report=Report())
    markdown = (tmp_path / "run" / "summary.md").read_text()
    assert markdown.startswith(
        "# fedkei (variant X) on synthetic\n\n1 tasks, 1.0 s.\n\nmethod table\n\n| client | lca |"
    )
    assert plotted == [(1, "curves.png", "fedkei (variant X) on synthetic")]
    assert not (tmp_path / "run" / "curves.png").exists()
    assert summary == RunRecorder(tmp_path / "run").summary("fedkei", "synthetic", 1.0)
    assert summary_markdown(summary).startswith("# fedkei on synthetic\n\n1 rounds")  # the default report


def test_truncate_after_drops_later_rounds_and_nan_is_null(tmp_path):
    rec = RunRecorder(tmp_path)
    for rnd in (1, 2, 3):
        rec.log_client(rnd, "a", "eval", {"auc": float("nan") if rnd == 1 else 0.5})
    rec.truncate_after(2)
    rounds = [r["round"] for r in rec.records()]
    assert rounds == [1, 2]
    assert rec.records()[0]["auc"] is None


def test_auc_binary_multiclass_and_missing_classes():
    y = np.array([0, 0, 1, 1])
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
    assert auc_score(y, probs) == 1.0
    # 3-class scores, class 2 absent from y: macro OvR over present classes only.
    y3 = np.array([0, 0, 1, 1])
    p3 = np.array([[0.8, 0.1, 0.1], [0.5, 0.3, 0.2], [0.2, 0.7, 0.1], [0.1, 0.6, 0.3]])
    assert auc_score(y3, p3) == 1.0
    assert math.isnan(auc_score(np.array([1, 1]), probs[:2]))
    m = classification_metrics(y, probs)
    assert m["accuracy"] == 1.0 and m["balanced_accuracy"] == 1.0


def test_multiclass_auc_is_the_mean_of_the_present_classes_one_vs_rest_scores():
    """Not a perfect split: each present class's score against the rest, by sklearn one class at a time, averaged."""
    rng = np.random.default_rng(3)
    y = rng.choice([0, 1, 3, 4], size=40)  # classes 2 and 5 absent
    probs = rng.dirichlet(np.ones(6), size=40)
    expected = np.mean([roc_auc_score(y == c, probs[:, c]) for c in (0, 1, 3, 4)])
    assert 0.3 < expected < 0.7
    assert auc_score(y, probs) == pytest.approx(expected, abs=1e-12)


def test_a_torn_last_line_is_left_out_and_resume_rewrites_the_file(tmp_path):
    """The process died while appending a record: the run can still be summarised and resumed."""
    rec = RunRecorder(tmp_path)
    for rnd in (1, 2):
        rec.log_client(rnd, "a", "eval", {"auc": 0.5 + rnd / 10})
    with rec.metrics_path.open("a") as f:
        f.write('{"kind": "eval", "round": 3, "cli')
    assert [r["round"] for r in rec.records()] == [1, 2]
    rec.truncate_after(2)
    assert rec.metrics_path.read_text().endswith('"auc": 0.7}\n')
    with rec.metrics_path.open("a") as f:
        f.write("not json\n" + json.dumps({"kind": "eval", "round": 3, "client": "a"}) + "\n")
    with pytest.raises(ValueError, match="line 3 is not a JSON record"):
        rec.records()
