"""The YAML experiment runner: validation, runs, comparison table and overlaid curves."""

import json

import pytest
import torch
from helpers import TINY

from medflower.experiments import (
    ExperimentFileError,
    absolute_paths,
    delta_m,
    load_plan,
    main,
    rounds_to_targets,
    select_runs,
    select_seeds,
)

TINY_BASE = {
    "synthetic-size": 240,
    "img-size": 16,
    "patch-size": 8,
    "backbone": TINY["backbone"],  # these tests check the runner, not the model
    "backbone-weights": "none",
    "num-rounds": 2,
    "partition": "iid",
}


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
    with pytest.raises(ExperimentFileError, match="'targets' needs a metric name"):
        load_plan(write_yaml(tmp_path / "d.yaml", {"targets": [0.5], "runs": [{"name": "a"}]}))
    with pytest.raises(ExperimentFileError, match="'reference' 'locl' is not one of the runs"):
        load_plan(write_yaml(tmp_path / "e.yaml", {"reference": "locl", "runs": [{"name": "local"}]}))
    with pytest.raises(ExperimentFileError, match="appears twice"):
        load_plan(write_yaml(tmp_path / "c.yaml", {"runs": [{"name": "a"}, {"name": "a"}]}))
    with pytest.raises(ExperimentFileError, match="'threads' must be a whole number >= 1, got 0"):
        load_plan(write_yaml(tmp_path / "f.yaml", {"threads": 0, "runs": [{"name": "a"}]}))


def test_runs_compare_and_plot_in_process(tmp_path, capsys):
    plan = {
        "name": "mini",
        "num-supernodes": 2,
        "seeds": [0, 1],
        "metrics": ["auc", "accuracy"],
        "per-client": True,
        "reference": "local",
        "targets": {"metric": "auc", "values": [0.0, 1.01]},
        "threads": 1,
        "base": TINY_BASE,
        "runs": [{"name": "fedavg", "strategy": "fedavg"}, {"name": "local", "strategy": "local"}],
    }
    path = write_yaml(tmp_path / "mini.yaml", plan)
    torch.set_num_threads(2)
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--engine", "inprocess"]) == 0
    assert torch.get_num_threads() == 2  # pinned for the runs only
    out = tmp_path / "out" / "mini"
    config = json.loads((out / "fedavg-seed0" / "config.json").read_text())
    assert config["resolved"]["torch-threads"] == 1
    result = json.loads((out / "comparison.json").read_text())
    assert set(result["table"]) == {"fedavg", "local"}
    for run in ("fedavg", "local"):
        for seed in (0, 1):
            assert (out / f"{run}-seed{seed}" / "summary.json").is_file()
    finals = [json.loads((out / f"fedavg-seed{s}" / "summary.json").read_text())["final"]["auc"] for s in (0, 1)]
    assert result["table"]["fedavg"]["auc"]["mean"] == pytest.approx(sum(finals) / 2)
    assert result["table"]["local"]["bytes_per_round"]["mean"] == 0
    table = (out / "comparison.md").read_text()
    assert "| fedavg |" in table and "±" in table and "1 torch thread(s) per run" in table
    assert result["table"]["fedavg"]["rounds_to_0.0"]["values"] == [1, 1]  # every round's mean reaches 0
    assert result["table"]["fedavg"]["rounds_to_1.01"]["values"] == [None, None]
    assert "rounds to 0% | rounds to 101% |" in table and "| 1.0 | not reached |" in table
    # per-client tables: one per metric, each site's value averaged over seeds
    site_auc = [
        json.loads((out / f"local-seed{s}" / "summary.json").read_text())["per_client"]["site-1"]["auc"] for s in (0, 1)
    ]
    assert result["per_client"]["local"]["auc"]["site-1"] == pytest.approx(sum(site_auc) / 2)
    assert "auc per site" in table and "| run | site-0 | site-1 | mean | Δm vs local (points) |" in table
    fedavg, local = result["per_client"]["fedavg"]["auc"], result["per_client"]["local"]["auc"]
    assert result["delta_m"]["local"]["auc"] == 0.0
    assert result["delta_m"]["fedavg"]["auc"] == pytest.approx(50.0 * sum(fedavg[c] - local[c] for c in local))
    assert (out / "curves.png").stat().st_size > 1000
    assert "comparison.md" in capsys.readouterr().out


def test_delta_m_averages_each_sites_change_over_the_sites_both_runs_report():
    reference = {"seg-a": 0.70, "seg-b": 0.80, "cls": None}
    assert delta_m({"seg-a": 0.75, "seg-b": 0.78, "cls": None}, reference) == pytest.approx(1.5)  # (+5 − 2) / 2
    assert delta_m({"seg-a": None, "seg-b": 0.90}, reference) == pytest.approx(10.0)
    assert delta_m({"cls": 0.5}, reference) is None


def test_rounds_to_a_target_use_the_mean_over_sites_of_each_round():
    evals = [
        {"round": 1, "client": "a", "m": 0.5},
        {"round": 1, "client": "b", "m": 0.7},
        {"round": 2, "client": "a", "m": 0.6},
        {"round": 2, "client": "b", "m": 0.8},
        {"round": 3, "client": "a", "m": 0.9},
        {"round": 3, "client": "b", "m": 0.5},
    ]
    plan = {"targets": {"metric": "m", "values": [0.6, 0.7, 0.75]}}
    assert rounds_to_targets(plan, evals) == {"0.6": 1, "0.7": 2, "0.75": None}


def test_the_pretrained_encoder_stand_in_is_what_a_run_loads(tmp_path, capsys):
    from safetensors import safe_open

    from medflower.models.backbones import create_backbone
    from medflower.pretrain import main as pretrain

    out = tmp_path / "encoder.safetensors"
    assert pretrain(["--out", str(out), "--size", "80", "--epochs", "2", "--img-size", "16", "--batch-size", "16"]) == 0
    assert "dice" in capsys.readouterr().out  # per-epoch validation of the segmentation pretraining
    with safe_open(str(out), "pt") as f:
        history = json.loads(f.metadata()["pretraining"])["history"]
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert [h["epoch"] for h in history] == [1, 2] and all("dice" in h for h in history)
    model, source = create_backbone("vit_tiny_patch16_224", img_size=16, patch_size=8, weights=str(out), seed=7)
    assert source == f"file:{out}" and not any(k.startswith(("head.", "decoder.")) for k in saved)
    for name, tensor in model.state_dict().items():
        assert name in saved and bool((tensor == saved[name]).all()), name


def test_only_runs_and_compares_the_named_runs_in_the_files_order(tmp_path):
    plan = {
        "name": "part",
        "num-supernodes": 2,
        "seeds": [0],
        "metrics": ["auc"],
        "base": {**TINY_BASE, "num-rounds": 1},
        "runs": [
            {"name": "fedavg", "strategy": "fedavg"},
            {"name": "local", "strategy": "local"},
            {"name": "fedprox", "strategy": "fedprox"},
        ],
    }
    path = write_yaml(tmp_path / "part.yaml", plan)
    assert [r["name"] for r in select_runs(load_plan(path), "fedprox, fedavg")["runs"]] == ["fedavg", "fedprox"]
    assert select_runs(load_plan(path), "")["runs"] == load_plan(path)["runs"]
    with pytest.raises(ExperimentFileError, match="--only names fedavgg, which the file does not list"):
        select_runs(load_plan(path), "fedavgg")
    with pytest.raises(ExperimentFileError, match="must include the reference run 'local'"):
        select_runs({**load_plan(path), "reference": "local"}, "fedavg")
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--engine", "inprocess", "--only", "local"]) == 0
    out = tmp_path / "out" / "part"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["local-seed0"]
    assert set(json.loads((out / "comparison.json").read_text())["table"]) == {"local"}


def test_data_paths_of_every_kind_are_taken_from_where_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = absolute_paths(
        {
            "dataset": "volumes:data/prostate",
            "site-datasets": "segfolder:data/polyp, csv:ph2/manifest.csv,synthetic,medmnist:pneumoniamnist",
            "data-dir": "data",
        }
    )
    assert config["dataset"] == f"volumes:{tmp_path}/data/prostate"
    assert config["site-datasets"].split(",") == [
        f"segfolder:{tmp_path}/data/polyp",
        f"csv:{tmp_path}/ph2/manifest.csv",
        "synthetic",
        "medmnist:pneumoniamnist",
    ]
    assert config["data-dir"] == str(tmp_path / "data")


def test_a_file_extends_another_inheriting_all_but_its_name_and_merging_base_key_by_key(tmp_path):
    parent = {
        "name": "two-sites",
        "num-supernodes": 2,
        "seeds": [0, 1, 2],
        "metrics": ["auc"],
        "base": {**TINY_BASE, "lr": 0.01, "frozen-encoder": "off"},
        "runs": [{"name": "local", "strategy": "local"}, {"name": "fedavg", "strategy": "fedavg"}],
    }
    write_yaml(tmp_path / "two-sites.yaml", parent)
    (tmp_path / "sub").mkdir()
    child = {"extends": "../two-sites.yaml", "num-supernodes": 4, "base": {"lr": 0.1, "frozen-encoder": None}}
    plan = load_plan(write_yaml(tmp_path / "sub" / "four-sites.yaml", child))
    assert plan["name"] == "four-sites"  # its own file's stem, not the parent's name: outputs never collide
    assert plan["num-supernodes"] == 4 and plan["seeds"] == [0, 1, 2] and plan["runs"] == parent["runs"]
    assert plan["base"] == {**TINY_BASE, "lr": 0.1}  # lr replaced, frozen-encoder dropped to its default
    # a chain of three: the middle file's runs replace the first's, the last inherits them
    write_yaml(tmp_path / "sub" / "more.yaml", {"extends": "four-sites.yaml", "seeds": [0]})
    assert load_plan(tmp_path / "sub" / "more.yaml")["num-supernodes"] == 4
    only = {"extends": "../two-sites.yaml", "runs": [{"name": "pooled", "strategy": "pooled"}]}
    assert [r["name"] for r in load_plan(write_yaml(tmp_path / "sub" / "p.yaml", only))["runs"]] == ["pooled"]
    # every run of the merged file is validated like a file of its own
    bad = {"extends": "../two-sites.yaml", "base": {"strategy": "fedavgg"}}
    with pytest.raises(ExperimentFileError, match="run-config 'strategy' = 'fedavgg'"):
        load_plan(write_yaml(tmp_path / "sub" / "bad.yaml", {**bad, "runs": [{"name": "a"}]}))


def test_a_bad_extends_names_the_file(tmp_path):
    with pytest.raises(ExperimentFileError, match=r"missing\.yaml does not exist"):
        load_plan(write_yaml(tmp_path / "a.yaml", {"extends": "missing.yaml", "runs": [{"name": "a"}]}))
    write_yaml(tmp_path / "x.yaml", {"extends": "y.yaml"})
    write_yaml(tmp_path / "y.yaml", {"extends": "x.yaml", "runs": [{"name": "a"}]})
    with pytest.raises(ExperimentFileError, match="'extends' loops back"):
        load_plan(tmp_path / "x.yaml")
    with pytest.raises(ExperimentFileError, match="'extends' names one experiment file, got"):
        load_plan(write_yaml(tmp_path / "b.yaml", {"extends": ["x.yaml"], "runs": [{"name": "a"}]}))
    with pytest.raises(ExperimentFileError, match="'base' maps run-config keys"):
        load_plan(write_yaml(tmp_path / "c.yaml", {"base": ["lr", 1], "runs": [{"name": "a"}]}))
    (tmp_path / "d.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ExperimentFileError, match="needs a mapping of entries"):
        load_plan(tmp_path / "d.yaml")


def test_seeds_runs_a_subset_and_compare_only_joins_them_with_earlier_seeds(tmp_path, capsys):
    plan = {
        "name": "more",
        "num-supernodes": 2,
        "seeds": [0, 1],
        "metrics": ["auc"],
        "base": {**TINY_BASE, "num-rounds": 1},
        "runs": [{"name": "local", "strategy": "local"}],
    }
    path = write_yaml(tmp_path / "more.yaml", plan)
    assert select_seeds(load_plan(path), " 1 ")["seeds"] == [1]
    assert select_seeds(load_plan(path), "")["seeds"] == [0, 1]
    with pytest.raises(ExperimentFileError, match="--seeds names 2, which the file does not list"):
        select_seeds(load_plan(path), "1,2")
    with pytest.raises(ExperimentFileError, match="comma-separated integers, got one"):
        select_seeds(load_plan(path), "one")
    out_args = ["--output-dir", str(tmp_path / "out"), "--engine", "inprocess"]
    assert main([str(path), *out_args, "--seeds", "1"]) == 0
    out = tmp_path / "out" / "more"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["local-seed1"]
    assert json.loads((out / "comparison.json").read_text())["seeds"] == [1]
    assert main([str(path), *out_args, "--compare-only", "--seeds", "1"]) == 0
    assert main([str(path), *out_args, "--compare-only"]) == 2  # seed 0 has not run: a message, no traceback
    assert "1 run(s) have not finished" in (err := capsys.readouterr().err) and "(local seed 0)" in err
    assert main([str(path), *out_args, "--seeds", "0"]) == 0
    assert main([str(path), *out_args, "--compare-only"]) == 0
    table = json.loads((out / "comparison.json").read_text())["table"]["local"]
    assert len(table["auc"]["values"]) == 2


def test_a_pretrain_entry_builds_the_stand_in_once_before_the_runs_that_load_it(tmp_path, capsys):
    from medflower.experiments import build_stand_ins

    out = tmp_path / "weights" / "stand-in.safetensors"
    plan = {
        "name": "stand-in",
        "pretrain": {str(out): "--dataset synthetic-seg --size 80 --epochs 1 --img-size 16 --batch-size 16"},
        "base": TINY_BASE,
        "runs": [{"name": "pretrained", "backbone": "vit-tiny", "backbone-weights": str(out)}],  # the stand-in's
    }
    loaded = load_plan(write_yaml(tmp_path / "s.yaml", plan))  # the file does not exist yet: it will be built
    build_stand_ins(loaded)
    assert out.is_file() and "stand-in " + str(out) + ": python -m medflower.pretrain" in capsys.readouterr().out
    built = out.stat().st_mtime_ns
    build_stand_ins(load_plan(write_yaml(tmp_path / "s.yaml", plan)))
    assert out.stat().st_mtime_ns == built and "exists, reused" in capsys.readouterr().out
    plan["runs"] = [{"name": "other", "backbone-weights": str(tmp_path / "missing.safetensors")}]
    with pytest.raises(ExperimentFileError, match="run 'other': .*backbone-weights"):
        load_plan(write_yaml(tmp_path / "t.yaml", plan))  # only a pretrain entry's own file may be missing


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("--objective mim", "'pretrain' maps a weights file to the arguments"),
        ({"w.safetensors": "--out x.safetensors"}, "the key is the output file; drop --out"),
        ({"w.safetensors": "--objective masked"}, "argument --objective: invalid choice: 'masked'"),
        ({"w.safetensors": ["--dataset", "synthetic", "--dataset", "csv:m.csv"]}, "trains one dataset's own task"),
    ],
)
def test_a_bad_pretrain_entry_is_refused_before_anything_runs(tmp_path, block, message):
    plan = {"pretrain": block, "base": TINY_BASE, "runs": [{"name": "a"}]}
    with pytest.raises(ExperimentFileError, match=message):
        load_plan(write_yaml(tmp_path / "p.yaml", plan))


def test_sgca_runs_get_their_last_rounds_mixing_weights_averaged_over_seeds(tmp_path):
    from medflower.experiments import final_mixing, mixing_markdown

    plan = {"seeds": [0, 1], "runs": [{"name": "sgca"}, {"name": "lat"}]}
    sites = ["a-1", "a-2"]
    for seed, last in ((0, [[0.7, 0.3], [0.2, 0.8]]), (1, [[0.5, 0.5], [0.4, 0.6]])):
        folder = tmp_path / f"sgca-seed{seed}"
        folder.mkdir()
        d, m = [[0.0, 1.0], [seed / 2, 0.0]], [0.6 - seed / 10, 0.4 + seed / 10]
        records = [
            {"kind": "server", "round": 1, "sgca_clients": sites, "sgca_W": [[1.0, 0.0], [0.0, 1.0]]},
            {"kind": "eval", "round": 1, "client": "a-1", "dice": 0.5},
            {"kind": "server", "round": 2, "sgca_clients": sites, "sgca_W": last, "sgca_D": d, "sgca_m": m},
        ]
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        (tmp_path / f"lat-seed{seed}").mkdir()
        (tmp_path / f"lat-seed{seed}" / "metrics.jsonl").write_text(json.dumps({"kind": "server", "round": 1}) + "\n")
    mixing = final_mixing(plan, tmp_path, plan["runs"][0])
    assert mixing["clients"] == sites and mixing["seeds"] == 2
    assert sum(mixing["W"], []) == pytest.approx([0.6, 0.4, 0.3, 0.7])  # the last round's W, mean over the two seeds
    assert final_mixing(plan, tmp_path, plan["runs"][1]) is None  # lat logs no W
    assert sum(mixing["D"], []) == pytest.approx([0.0, 1.0, 0.25, 0.0]) and mixing["m"] == pytest.approx([0.55, 0.45])
    text = mixing_markdown({"sgca": mixing})
    assert "| a-2 | 0.300 | 0.700 |" in text and "| a-2 | 0.250 | 0.000 |" in text and "a-1 0.550, a-2 0.450" in text
    # a run logged before D and m were: W alone
    for seed in (0, 1):
        path = tmp_path / f"sgca-seed{seed}" / "metrics.jsonl"
        path.write_text(path.read_text().replace('"sgca_D"', '"old_D"').replace('"sgca_m"', '"old_m"'))
    assert set(final_mixing(plan, tmp_path, plan["runs"][0])) == {"clients", "seeds", "W"}


def test_an_in_process_experiment_keeps_no_sent_message_while_tests_can_read_them(tmp_path):
    from medflower.inprocess import run_inprocess

    config = {**TINY_BASE, "dataset": "synthetic", "output-dir": str(tmp_path), "run-name": "r"}
    summary, grid = run_inprocess({**config, "run-name": "kept"}, num_nodes=2)
    assert {m.metadata.message_type for m in grid.sent} >= {"train"} and summary["rounds"] == 2
    summary, grid = run_inprocess({**config, "run-name": "dropped"}, num_nodes=2, record_sent=False)
    assert grid.sent == [] and summary["rounds"] == 2


def test_runs_with_dp_get_an_epsilon_column_and_runs_without_read_infinity():
    from medflower.experiments import comparison_markdown, privacy_epsilons

    site = {"privacy": {"delta": 1e-5, "client_level": {"epsilon": 12.34}}}
    sgd = {"privacy": {"delta": 1e-5, "dp_sgd": {"epsilon": 3.21, "epsilon_per_site": {"a": 3.21, "b": 2.0}}}}
    assert privacy_epsilons({"final": {}}) == {}
    assert privacy_epsilons(site) == {"epsilon_client": 12.34}
    assert privacy_epsilons(sgd) == {"epsilon_dp_sgd": 3.21}

    def cell(mean):
        return {"mean": mean, "std": 0.0, "values": [mean]}

    table = {
        "none": {"dice": cell(0.7), "bytes_per_round": cell(1e6)},
        "site": {"dice": cell(0.1), "epsilon_client": cell(12.34), "bytes_per_round": cell(1e6)},
        "sgd": {"dice": cell(0.5), "epsilon_dp_sgd": cell(3.21), "bytes_per_round": cell(1e6)},
    }
    lines = comparison_markdown({"metrics": ["dice"], "seeds": [0], "num-supernodes": 2}, table).splitlines()
    assert lines[2] == "| run | dice | ε client-level | ε DP-SGD (largest site) | MB per round |"
    assert lines[4] == "| none | 0.700 ± 0.000 | ∞ (no DP) | ∞ (no DP) | 1.000 |"
    assert lines[5] == "| site | 0.100 ± 0.000 | 12.3 | – | 1.000 |"
    assert lines[6] == "| sgd | 0.500 ± 0.000 | – | 3.21 | 1.000 |"
    # a plan without DP keeps its table as it was
    plain = comparison_markdown({"metrics": ["dice"], "seeds": [0], "num-supernodes": 2}, {"none": table["none"]})
    assert "ε" not in plain


def _seed_folder(out, name, seed, dice, *, failed=0, rounds=None):
    """A run folder as a finished run leaves it: summary.json (each site's last evaluation) and metrics.jsonl."""
    rounds = rounds or {"a": 2, "b": 2}
    folder = out / f"{name}-seed{seed}"
    folder.mkdir(parents=True)
    per_client = {site: {"round": rnd, "dice": value} for (site, rnd), value in zip(rounds.items(), dice)}
    summary = {
        "rounds": 2,
        "final": {"dice": sum(dice) / len(dice)},
        "per_client": per_client,
        "communication": {"bytes_up": 10, "bytes_down": 10, "failed_replies": failed, "rejected_replies": 0},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    records = [{"kind": "eval", "client": site, **values} for site, values in per_client.items()]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def test_a_seed_where_a_site_failed_or_evaluated_early_is_left_out_of_the_means_and_named(tmp_path, capsys):
    from medflower.experiments import compare

    plan = {"name": "x", "num-supernodes": 2, "seeds": [0, 1], "metrics": ["dice"], "per-client": True}
    plan["runs"] = [{"name": "good"}, {"name": "failed"}, {"name": "stale"}, {"name": "lost"}]
    _seed_folder(tmp_path, "good", 0, [0.6, 0.8])
    _seed_folder(tmp_path, "good", 1, [0.4, 0.6])
    _seed_folder(tmp_path, "failed", 0, [0.5, 0.7])
    _seed_folder(tmp_path, "failed", 1, [0.9], failed=2, rounds={"b": 2})  # site a never answered its evaluations
    _seed_folder(tmp_path, "stale", 0, [0.3, 0.5])
    _seed_folder(tmp_path, "stale", 1, [0.9, 0.9], rounds={"a": 1, "b": 2})  # a's value is from round 1
    _seed_folder(tmp_path, "lost", 0, [0.1, 0.1], failed=4)
    _seed_folder(tmp_path, "lost", 1, [0.1, 0.1], failed=4)
    result = compare(plan, tmp_path)
    table = result["table"]
    assert table["good"]["dice"]["mean"] == pytest.approx(0.6) and len(table["good"]["dice"]["values"]) == 2
    assert table["failed"]["dice"]["values"] == [pytest.approx(0.6)]  # seed 1's 0.9 from one site is not in it
    assert result["per_client"]["failed"]["dice"] == {"a": pytest.approx(0.5), "b": pytest.approx(0.7)}
    assert table["stale"]["dice"]["values"] == [pytest.approx(0.4)]
    assert table["lost"]["dice"]["mean"] is None
    assert result["left_out"] == {
        "failed": {1: "2 failed and 0 rejected site replies"},
        "stale": {1: "the last evaluation of a is older than round 2"},
        "lost": {0: "4 failed and 0 rejected site replies", 1: "4 failed and 0 rejected site replies"},
    }
    markdown = (tmp_path / "comparison.md").read_text()
    assert "| good | 0.600 ± 0.141 | 0.000 |" in markdown
    assert "| failed | 0.600 (1/2 seeds) | 0.000 |" in markdown
    assert "| lost | – | – |" in markdown
    assert "- stale seed 1: the last evaluation of a is older than round 2" in markdown
    assert "warning: failed seed 1 is left out of the comparison: 2 failed" in capsys.readouterr().err


def test_parallel_runs_equal_the_same_runs_one_by_one_and_a_failed_run_is_named_with_its_log(tmp_path, capsys):
    """--parallel 2: each run in a fresh process gives bit for bit what the runs give one after another in this
    process; a run that fails (here: its folder already holds a run and it may not overwrite it) is reported with its
    log while the others finish, and the command exits 1 without a table."""
    from medflower.contract import Checkpointer

    plan = {
        "name": "side-by-side",
        "num-supernodes": 2,
        "metrics": ["auc"],
        "base": TINY_BASE,
        "runs": [
            {"name": "fedavg", "strategy": "fedavg"},
            {"name": "refused", "strategy": "fedavg", "overwrite": False},
        ],
    }
    path = write_yaml(tmp_path / "side-by-side.yaml", plan)
    held = tmp_path / "parallel" / "side-by-side" / "refused-seed0"
    held.mkdir(parents=True)
    (held / "summary.json").write_text("{}")
    parallel = ["--output-dir", str(tmp_path / "parallel"), "--engine", "inprocess", "--parallel", "2"]
    assert main([str(path), *parallel]) == 1
    captured = capsys.readouterr()
    logs = tmp_path / "parallel" / "side-by-side" / "logs"
    assert f"1 of 2 runs failed: refused-seed0 (exit code 1, its log: {logs / 'refused-seed0.log'})" in captured.err
    assert "already holds a run" in (logs / "refused-seed0.log").read_text()
    assert "refused seed 0 done in" in captured.out and "failed: exit code 1" in captured.out
    assert "2 at a time" in captured.out and "2 of 2 runs under way: fedavg seed 0 round 0/2; refused" in captured.out
    sequential = ["--output-dir", str(tmp_path / "one-by-one"), "--engine", "inprocess", "--only", "fedavg"]
    assert main([str(path), *sequential]) == 0
    for run in ("fedavg-seed0",):
        got, want = (tmp_path / where / "side-by-side" / run for where in ("parallel", "one-by-one"))
        assert "round 2" in (logs / f"{run}.log").read_text()
        summaries = [json.loads((folder / "summary.json").read_text()) for folder in (got, want)]
        assert summaries[0]["final"] == summaries[1]["final"] and summaries[0]["final"]["auc"] > 0
        assert summaries[0]["per_client"] == summaries[1]["per_client"]
        arrays = [Checkpointer(folder / "checkpoint").load()[0] for folder in (got, want)]
        assert arrays[0].keys() == arrays[1].keys()
        assert all(torch.equal(torch.as_tensor(arrays[0][k]), torch.as_tensor(arrays[1][k])) for k in arrays[0])


def test_parallel_is_refused_through_flwr_run_and_below_one(tmp_path, capsys):
    path = write_yaml(tmp_path / "p.yaml", {"runs": [{"name": "a", "strategy": "fedavg"}]})
    for args, message in (
        (["--parallel", "2"], "--parallel needs --engine inprocess"),
        (["--parallel", "0"], "1 or more"),
    ):
        with pytest.raises(SystemExit):
            main([str(path), *args])
        assert message in capsys.readouterr().err


def test_resume_keeps_finished_runs_and_continues_a_stopped_one_to_the_uninterrupted_result(tmp_path, capsys):
    """--resume after a runner died part way through a file: the finished run is not run again, the stopped one
    continues from its checkpoint to the arrays an uninterrupted run reaches; a run whose config.json differs from
    what the file now asks (a value, the torch threads) or does not read is run from the start."""
    from medflower.contract import Checkpointer
    from medflower.contract.server import FederatedStrategy
    from medflower.experiments import earlier_run, load_plan, run_config

    plan = {
        "name": "resumed",
        "num-supernodes": 2,
        "metrics": ["auc"],
        "base": TINY_BASE,
        "runs": [{"name": "a", "strategy": "fedavg"}, {"name": "b", "strategy": "fedprox"}],
    }
    path = write_yaml(tmp_path / "resumed.yaml", plan)
    args = [str(path), "--output-dir", str(tmp_path / "out"), "--engine", "inprocess"]
    out = tmp_path / "out" / "resumed"
    original = FederatedStrategy.run_round

    class Killed(Exception):
        pass

    def dies_in_round_2(self, grid, rnd):
        if rnd == 2 and self.cfg.strategy == "fedprox":
            raise Killed  # the runner dies while b trains its second round
        return original(self, grid, rnd)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FederatedStrategy, "run_round", dies_in_round_2)
        with pytest.raises(Killed):
            main(args)
    assert (out / "a-seed0" / "summary.json").is_file() and not (out / "b-seed0" / "summary.json").exists()
    kept = (out / "a-seed0" / "summary.json").stat().st_mtime_ns
    before = (out / "b-seed0" / "metrics.jsonl").read_bytes()
    assert b'"round": 1' in before
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "--resume: 1 finished run(s) kept (a-seed0), 1 continued from their checkpoints (b-seed0), 0 from" in printed
    assert (out / "a-seed0" / "summary.json").stat().st_mtime_ns == kept, "the finished run was not run again"
    after = (out / "b-seed0" / "metrics.jsonl").read_bytes()
    assert after.startswith(before), "round 1's records (timings included) are the stopped run's: not redone"
    servers = [json.loads(line) for line in after.decode().splitlines()]
    assert [r["round"] for r in servers if r["kind"] == "server"] == [1, 2]
    whole = tmp_path / "whole"
    assert main([str(path), "--output-dir", str(whole), "--engine", "inprocess", "--only", "b"]) == 0
    got, want = (Checkpointer(folder / "b-seed0" / "checkpoint").load()[0] for folder in (out, whole / "resumed"))
    assert got.keys() == want.keys() and all(
        torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])) for k in got
    )
    # what makes a folder another run: the file's values, the thread count, a config.json that does not read
    loaded = load_plan(path)
    config = run_config(loaded, loaded["runs"][0], 0, out)
    assert earlier_run(config, 1) == "finished"
    assert earlier_run({**config, "lr": 0.5}, 1) == "" and earlier_run(config, 2) == ""
    (out / "a-seed0" / "config.json").write_text("{not json")
    assert earlier_run(config, 1) == ""
    # a stopped run whose checkpoints all fail their digest check starts over rather than failing the file
    b = run_config(loaded, loaded["runs"][1], 0, out)
    (out / "b-seed0" / "summary.json").unlink()
    assert earlier_run(b, 1) == "stopped"
    for arrays in (out / "b-seed0" / "checkpoint").glob("round-*/arrays.safetensors"):
        data = bytearray(arrays.read_bytes())
        data[-5] ^= 0xFF
        arrays.write_bytes(bytes(data))
    assert earlier_run(b, 1) == ""
