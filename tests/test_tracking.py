"""Experiment tracking (run config tracking='tensorboard'|'mlflow') and the experiment runner's progress: what a run
logs, read back from real local stores (TensorBoard's event files, an MLflow SQLite store)."""

import io
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import TINY, records, run_dir_of

from medflower.experiments import main, run_config
from medflower.inprocess import run_inprocess
from medflower.progress import Job, Progress
from medflower.results import RunRecorder
from medflower.tracking import RunTracking, open_tracking

SMALL = {**TINY, "synthetic-size": 160, "run-figures": True}  # curves.png is one of the files tracked
SUMMARY_FILES = ["config.json", "curves.png", "metrics.jsonl", "summary.json", "summary.md"]


def medflower_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "[medflower]" in r.getMessage()]


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> Path:
    """One local MLflow store (a SQLite file) for the module: creating its tables takes seconds."""
    return tmp_path_factory.mktemp("mlflow")


def mlflow_client(store: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")


def test_tensorboard_holds_the_config_every_rounds_metrics_and_the_summary(tiny):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny(**{**SMALL, "run-name": "tb", "num-rounds": 2, "tracking": "tensorboard"})
    run_inprocess(config, num_nodes=2)
    run_dir = run_dir_of(config)
    events = EventAccumulator(str(run_dir.parent / "tensorboard" / "tb"), size_guidance={"tensors": 0, "images": 0})
    events.Reload()

    def scalars(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    evals = records(run_dir, "eval")
    assert {r["client"] for r in evals} == {"site-0", "site-1"}
    for rnd in (1, 2):
        aucs = [r["auc"] for r in evals if r["round"] == rnd]
        assert scalars("global/auc")[rnd] == pytest.approx(sum(aucs) / len(aucs), rel=1e-6)
    site = {r["round"]: r["accuracy"] for r in evals if r["client"] == "site-1"}
    assert scalars("sites/site-1/accuracy") == pytest.approx(site, rel=1e-6)
    trained = {r["round"]: r["train_loss"] for r in records(run_dir, "train") if r["client"] == "site-0"}
    assert scalars("sites/site-0/train_loss") == pytest.approx(trained, rel=1e-6)
    server = records(run_dir, "server")
    assert scalars("server/bytes_up") == {r["round"]: r["bytes_up"] for r in server}
    assert set(scalars("server/round_s")) == {1, 2}

    def text(tag):
        return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()

    assert "| strategy | fedavg |" in text("config") and "| resolved.rounds | 2 |" in text("config")
    assert text("summary") == (run_dir / "summary.md").read_text()
    assert events.Images("curves")


def test_an_experiment_files_runs_share_one_mlflow_experiment_and_each_gets_a_result_line(
    tmp_path, capsys, mlflow_store
):
    plan = {
        "name": "tracked",
        "num-supernodes": 2,
        "metrics": ["auc", "accuracy"],
        "base": {**SMALL, "num-rounds": 1, "tracking": "mlflow", "tracking-uri": str(mlflow_store)},
        "runs": [{"name": "fedavg", "strategy": "fedavg"}, {"name": "local", "strategy": "local"}],
    }
    path = tmp_path / "tracked.yaml"
    path.write_text(yaml.safe_dump(plan))
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--engine", "inprocess"]) == 0
    out = capsys.readouterr().out
    client = mlflow_client(mlflow_store)
    experiment = client.get_experiment_by_name("tracked")  # named after the file
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"fedavg-seed0", "local-seed0"}
    for name, run in runs.items():
        summary = json.loads((tmp_path / "out" / "tracked" / name / "summary.json").read_text())
        assert run.info.status == "FINISHED"
        assert run.data.params["strategy"] == name.split("-")[0] and run.data.params["num-rounds"] == "1"
        [auc] = client.get_metric_history(run.info.run_id, "global/auc")
        assert auc.step == 1 and auc.value == pytest.approx(summary["final"]["auc"])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "server/round_s")] == [1]
        assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == SUMMARY_FILES
        # the runner's one line per finished run, with the file's metrics
        assert f"{name.split('-')[0]} seed 0 done in" in out and f"auc={summary['final']['auc']:.4f}" in out
    bytes_up = client.get_metric_history(runs["fedavg-seed0"].info.run_id, "server/bytes_up")
    assert bytes_up[0].value > 0
    assert "run 1/2 fedavg seed 0: round 0/1" in out  # the progress line before the first round ends


def test_a_resumed_run_continues_its_mlflow_run(tmp_path, mlflow_store):
    """A resumed run logs into the MLflow run its folder started; the parameters a resume changes (resume-from,
    num-rounds) keep their first value instead of stopping the tracking."""
    cfg = SimpleNamespace(tracking="mlflow", tracking_uri=str(mlflow_store), tracking_experiment="resumed")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = open_tracking(SimpleNamespace(**vars(cfg), resume_from=""), run_dir)
    first.config({"num-rounds": 1, "resume-from": ""})
    first.client(1, "site-0", "eval", {"auc": 0.5})
    first.server(1, {"bytes_up": 10})
    first.close(failed=True)  # the process stopped
    again = open_tracking(SimpleNamespace(**vars(cfg), resume_from=str(run_dir)), run_dir, completed_rounds=1)
    again.config({"num-rounds": 2, "resume-from": str(run_dir)})
    again.client(2, "site-0", "eval", {"auc": 0.75})
    again.server(2, {"bytes_up": 10})
    assert again.active
    again.close()
    client = mlflow_client(mlflow_store)
    [run] = client.search_runs([client.get_experiment_by_name("resumed").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["num-rounds"] == "1"
    history = client.get_metric_history(run.info.run_id, "global/auc")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.75)]


class Recording:
    """A tracker that keeps what it is told; ``fail`` names the call that raises."""

    def __init__(self, fail: str = ""):
        self.fail, self.metrics, self.params, self.files, self.closed = fail, {}, {}, [], []

    def _maybe_fail(self, call):
        if call == self.fail:
            raise OSError("disk full")

    def log_params(self, params):
        self._maybe_fail("log_params")
        self.params.update(params)

    def log_metrics(self, metrics, step):
        self._maybe_fail("log_metrics")
        for key, value in metrics.items():
            self.metrics.setdefault(key, {})[step] = value

    def log_files(self, paths):
        self.files += [p.name for p in paths]

    def close(self, failed=False):
        self.closed.append(failed)


def test_records_become_round_means_site_and_server_metrics_and_files(tmp_path):
    """Round means are over the sites that computed a metric; a round evaluated in the next round's replies
    (evaluate-in-train) gets its mean at that round's server record; lists and texts are no metrics."""
    tracker = Recording()
    rec = RunRecorder(tmp_path / "run")
    rec.tracking = RunTracking(tracker, "recording")
    rec.write_config({"strategy": "fedavg", "resolved": {"rounds": 2}, "site-datasets": ""})
    rec.log_client(1, "site a", "train", {"train_loss": 1.5, "num-examples": 20})
    rec.log_server(1, bytes_up=10, bytes_down=20, failed=[], num_failed=0, num_rejected=0, round_failed="why")
    rec.log_client(1, "site a", "eval", {"auc": 0.5, "val_auc": 0.25, "confusion": [1, 0, 0, 1]})
    rec.log_client(1, "b", "eval", {"auc": 0.7})
    rec.log_server(1, evaluated_in=2, pooled_accuracy=0.6, pooled_sites=2)
    rec.log_client(2, "b", "eval", {"auc": 0.9})
    rec.log_server(2, bytes_up=10, bytes_down=20, num_failed=0, num_rejected=0)
    rec.finish("fedavg", "synthetic", 1.0)
    assert tracker.params == {"strategy": "fedavg", "resolved.rounds": "2", "site-datasets": ""}
    assert tracker.metrics["global/auc"] == {1: pytest.approx(0.6), 2: 0.9}
    assert tracker.metrics["global/val_auc"] == {1: 0.25}
    assert tracker.metrics["sites/site-a/train_loss"] == {1: 1.5}
    assert tracker.metrics["sites/site-a/train_num-examples"] == {1: 20}
    assert tracker.metrics["server/bytes_up"] == {1: 10, 2: 10}
    assert tracker.metrics["server/pooled_accuracy"] == {1: 0.6}
    assert tracker.metrics["server/num_failed"] == {1: 0, 2: 0}
    skipped = ("sites/site-a/confusion", "server/failed", "server/round_failed", "server/evaluated_in", "server/time")
    assert not set(skipped) & set(tracker.metrics)
    assert sorted(tracker.files) == SUMMARY_FILES


def test_a_failing_tracker_is_said_once_and_the_run_goes_on(tmp_path, caplog):
    tracker = Recording(fail="log_metrics")
    rec = RunRecorder(tmp_path / "run")
    rec.tracking = tracking = RunTracking(tracker, "recording")
    rec.write_config({"strategy": "fedavg"})
    for rnd in (1, 2):
        rec.log_client(rnd, "a", "eval", {"auc": 0.5})
        rec.log_server(rnd, bytes_up=1, bytes_down=1, num_failed=0, num_rejected=0)
    summary = rec.finish("fedavg", "synthetic", 1.0)
    assert summary["rounds"] == 2 and len(records(tmp_path / "run", "eval")) == 2
    assert medflower_warnings(caplog) == [
        "[medflower] tracking (recording) failed and is off for the rest of this run: OSError: disk full"
    ]
    assert tracker.closed == [True] and not tracking.active and tracker.files == []


def test_a_tracker_that_cannot_start_leaves_the_run_untracked(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = SimpleNamespace(tracking="tensorboard", tracking_uri=str(blocker), tracking_experiment="", resume_from="")
    assert open_tracking(cfg, tmp_path / "run") is None
    [warning] = medflower_warnings(caplog)
    assert "tracking (tensorboard) could not start; the run goes on without it" in warning


def test_the_runner_groups_a_files_runs_and_takes_a_tracking_folder_from_where_it_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = {"name": "grid", "base": {"tracking": "mlflow", "tracking-uri": "stores/mlflow"}}
    config = run_config(plan, {"name": "fedavg"}, 0, tmp_path / "out")
    assert config["tracking-experiment"] == "grid"
    assert config["tracking-uri"] == str(tmp_path / "stores" / "mlflow")
    own = {"name": "grid", "base": {"tracking-experiment": "mine", "tracking-uri": "http://host:5000"}}
    config = run_config(own, {"name": "fedavg"}, 0, tmp_path / "out")
    assert config["tracking-experiment"] == "mine" and config["tracking-uri"] == "http://host:5000"


def test_progress_shows_the_run_its_round_and_an_eta_then_one_line_per_run(tmp_path):
    folders = [tmp_path / "a-seed0", tmp_path / "b-seed0"]
    out = io.StringIO()
    progress = Progress([Job("a seed 0", folders[0], 4), Job("b seed 0", folders[1], 4)], out=out, interval=60)
    progress.start(0)
    assert "run 1/2 a seed 0: round 0/4" in out.getvalue() and "ETA ?" in out.getvalue()
    folders[0].mkdir()
    (folders[0] / "config.json").write_text(json.dumps({"resolved": {"rounds": 2}}))  # the strategy's own count
    with (folders[0] / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"kind": "eval", "round": 1, "client": "x", "auc": 0.5}) + "\n")
        f.write(json.dumps({"kind": "server", "round": 1}) + "\n")
        f.write('{"kind": "server", "rou')  # being written: not read yet
    progress._poll()
    line = progress.line()
    assert "run 1/2 a seed 0: round 1/2" in line and "ETA ?" not in line
    assert line.startswith("[" + "#" * 3 + "." * 17 + "]")  # 1 of 6 rounds
    text = progress.finish(0, {"rounds": 2, "final": {"auc": 0.625, "dice": 0.5}}, ["auc", "accuracy"])
    assert text.startswith("[1/2] a seed 0 done in ") and text.endswith(": 2 rounds, auc=0.6250")
    progress.start(1)
    assert progress.finish(1, None, ["auc"]).endswith("no summary.json (see the log above)")
    progress.close()
    assert out.getvalue().count("done in") == 2


def _rounds(folder: Path, rounds: range, total: int) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"resolved": {"rounds": total}}))
    with (folder / "metrics.jsonl").open("a") as f:
        for rnd in rounds:
            f.write(json.dumps({"kind": "server", "round": rnd}) + "\n")


def test_progress_ignores_an_earlier_run_in_the_folder_and_counts_a_continued_runs_rounds_as_earlier(tmp_path):
    redo, cont = tmp_path / "redo", tmp_path / "cont"
    _rounds(redo, range(1, 5), total=4)  # a finished run of 4 rounds, which the run started now deletes
    _rounds(cont, range(1, 4), total=6)  # a run stopped after round 3 of 6, continued from its checkpoint
    out = io.StringIO()
    progress = Progress([Job("redo", redo, 2), Job("cont", cont, 6, continued=True)], out=out, interval=60)
    progress.start(0)
    progress.start(1)
    progress._poll()
    line = progress.line()
    assert "redo round 0/2" in line and "cont round 3/6" in line
    assert line.startswith("[" + "#" * 7 + "." * 13 + "]") and "ETA ?" in line  # 3 of 8 rounds, none run here
    (redo / "metrics.jsonl").unlink()  # overwrite=true: the old run's files go, the new run writes its own
    (redo / "config.json").unlink()
    _rounds(redo, range(1, 2), total=2)
    progress._poll()
    line = progress.line()
    assert "redo round 1/2" in line and "cont round 3/6" in line
    # one round run here: the ETA is the elapsed time per round times the 4 rounds left, not the 4 of 8 the bar shows
    elapsed = time.monotonic() - progress.started
    assert elapsed * 4 - 1 <= progress.eta(1) <= (time.monotonic() - progress.started) * 4 + 1
    _rounds(cont, range(4, 7), total=6)
    progress._poll()
    assert progress.finish(1, {"rounds": 6, "final": {}}, []).endswith("6 rounds, no metric of the table")
    assert progress.rounds_done == 3 and progress.rounds_before == 3
    progress.close()
