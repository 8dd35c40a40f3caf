"""The YAML experiment runner: validation, runs, comparison table and overlaid curves."""

import json

import pytest

from medflower.experiments import ExperimentFileError, load_plan, main

TINY_BASE = {"synthetic-size": 240, "img-size": 16, "patch-size": 8, "backbone-weights": "none",
             "num-rounds": 2, "partition": "iid"}


def write_yaml(path, plan):
    import yaml

    path.write_text(yaml.safe_dump(plan))
    return path


def test_bad_files_name_the_run_and_key(tmp_path):
    with pytest.raises(ExperimentFileError, match="does not exist"):
        load_plan(tmp_path / "none.yaml")
    with pytest.raises(ExperimentFileError, match="non-empty 'runs'"):
        load_plan(write_yaml(tmp_path / "a.yaml", {"name": "x"}))
    bad = {"runs": [{"name": "good", "strategy": "fedavg"}, {"name": "typo", "strategy": "fedavgg"}]}
    with pytest.raises(ExperimentFileError, match="run 'typo': run-config 'strategy' = 'fedavgg'"):
        load_plan(write_yaml(tmp_path / "b.yaml", bad))
    with pytest.raises(ExperimentFileError, match="appears twice"):
        load_plan(write_yaml(tmp_path / "c.yaml", {"runs": [{"name": "a"}, {"name": "a"}]}))


def test_runs_compare_and_plot_in_process(tmp_path, capsys):
    plan = {"name": "mini", "num-supernodes": 2, "seeds": [0, 1], "metrics": ["auc", "accuracy"], "per-client": True,
            "base": TINY_BASE, "runs": [{"name": "fedavg", "strategy": "fedavg"}, {"name": "local", "strategy": "local"}]}
    path = write_yaml(tmp_path / "mini.yaml", plan)
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--engine", "inprocess"]) == 0
    out = tmp_path / "out" / "mini"
    result = json.loads((out / "comparison.json").read_text())
    assert set(result["table"]) == {"fedavg", "local"}
    for run in ("fedavg", "local"):
        for seed in (0, 1):
            assert (out / f"{run}-seed{seed}" / "summary.json").is_file()
    finals = [json.loads((out / f"fedavg-seed{s}" / "summary.json").read_text())["final"]["auc"] for s in (0, 1)]
    assert result["table"]["fedavg"]["auc"]["mean"] == pytest.approx(sum(finals) / 2)
    assert result["table"]["local"]["bytes_per_round"]["mean"] == 0
    table = (out / "comparison.md").read_text()
    assert "| fedavg |" in table and "±" in table
    # per-client tables: one per metric, each site's value averaged over seeds
    site_auc = [json.loads((out / f"local-seed{s}" / "summary.json").read_text())["per_client"]["site-1"]["auc"]
                for s in (0, 1)]
    assert result["per_client"]["local"]["auc"]["site-1"] == pytest.approx(sum(site_auc) / 2)
    assert "auc per site" in table and "| run | site-0 | site-1 | mean |" in table
    assert (out / "curves.png").stat().st_size > 1000
    assert "comparison.md" in capsys.readouterr().out
