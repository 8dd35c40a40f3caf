"""Config validation: every bad value stops the run with key, value and valid choices."""

import tomllib
from pathlib import Path

import pytest

from medflower.config import OPTIONS, ConfigError, ExperimentConfig, defaults, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def cfg(**overrides):
    return ExperimentConfig.from_run_config({**defaults(), **overrides})


def test_defaults_validate_and_match_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == defaults()
    c = cfg()
    assert c.strategy == "fedavg" and c.num_rounds >= 1


def test_dataclass_fields_match_options():
    fields = set(ExperimentConfig.__dataclass_fields__)
    assert fields == {o.attr for o in OPTIONS}


def test_every_key_is_documented_in_readme():
    readme = (ROOT / "README.md").read_text()
    for option in OPTIONS:
        assert f"| `{option.key}` |" in readme, f"{option.key} missing from the README's run-config table"
    assert markdown_table() in readme, "README table is stale: paste `python -m medflower.config`"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("strategy", "fedsomething", ["'strategy'", "'fedsomething'", "fedavg", "fedprox", "local"]),
        ("dataset", "imagenet", ["'dataset'", "'imagenet'", "synthetic", "medmnist:<flag>", "csv:"]),
        ("adapter", "prefix", ["'adapter'", "'prefix'", "lora", "ia3", "bottleneck"]),
        ("backbone", "vit-huge-xl", ["'backbone'", "'vit-huge-xl'", "vit-b16", "resnet18", "timm"]),
        ("partition", "random", ["'partition'", "dirichlet", "iid", "natural", "pathological"]),
        ("lr", -0.1, ["'lr'", "-0.1", "> 0"]),
        ("num-rounds", 0, ["'num-rounds'", "0", "> 0"]),
        ("dirichlet-alpha", 0.0, ["'dirichlet-alpha'", "> 0"]),
        ("fraction-train", 1.5, ["'fraction-train'", "(0, 1]"]),
        ("num-rounds", "three", ["'num-rounds'", "integer"]),
        ("backbone-weights", "/no/such/file.safetensors", ["'backbone-weights'", "none", "auto"]),
    ],
)
def test_bad_values_name_key_value_and_choices(key, value, expected):
    with pytest.raises(ConfigError) as err:
        cfg(**{key: value})
    for fragment in expected:
        assert fragment in str(err.value)


def test_missing_data_path_names_the_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        cfg(dataset="medmnist:pneumoniamnist", **{"data-dir": str(tmp_path)})
    assert "pneumoniamnist.npz" in str(err.value) and "data-dir" in str(err.value)
    with pytest.raises(ConfigError, match="manifest .*missing.csv"):
        cfg(dataset=f"csv:{tmp_path}/missing.csv")


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="'num-round' is unknown: did you mean num-rounds"):
        ExperimentConfig.from_run_config({**defaults(), "num-round": 3})


def test_fractions_must_leave_training_data():
    with pytest.raises(ConfigError, match="val-fraction \\+ test-fraction"):
        cfg(**{"val-fraction": 0.5, "test-fraction": 0.5})


def test_views_for_layers():
    c = cfg(**{"adapter-targets": "qkv, proj", "img-size": 48})
    assert c.model_spec().adapter_targets == ("qkv", "proj")
    assert c.data_spec().img_size == 48 and c.model_spec().img_size == 48
