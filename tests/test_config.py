"""Config validation: every bad value stops the run with key, value and valid choices."""

import tomllib
from pathlib import Path

import pytest

from medflower.config import ConfigError, ExperimentConfig, all_options, defaults
from medflower.options import Option, bad, positive
from medflower.strategies import STRATEGIES, FederatedStrategy, register_strategy
from medflower.strategies.fedavg import FedAvgClient

ROOT = Path(__file__).resolve().parents[1]


def cfg(**overrides):
    return ExperimentConfig.from_run_config({**defaults(), **overrides})


def test_defaults_validate_and_match_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == defaults()
    c = cfg()
    assert c.strategy == "fedavg" and c.num_rounds >= 1


def test_every_key_is_declared_once_and_readable_as_an_attribute():
    options = all_options()
    assert len({o.key for o in options}) == len(options)
    c = cfg()
    for o in options:
        assert getattr(c, o.attr) == o.default, o.key
    with pytest.raises(AttributeError, match="no option 'no-such-key'"):
        _ = c.no_such_key
    with pytest.raises(AttributeError, match="read-only"):
        c.lr = 1.0


@pytest.fixture
def scratch_registry():
    """The registry as it is; strategies a test registers are gone afterwards."""
    before = dict(STRATEGIES)
    yield STRATEGIES
    STRATEGIES.clear()
    STRATEGIES.update(before)


def test_the_registry_refuses_a_taken_name_a_missing_client_half_and_a_key_declared_twice(scratch_registry):
    with pytest.raises(ValueError, match="strategy name 'fedavg' is taken by medflower.strategies.fedavg.FedAvg"):
        register_strategy(type("Copy", (FederatedStrategy,), {"name": "fedavg", "client_half": FedAvgClient}))
    with pytest.raises(TypeError, match="names no client half"):
        register_strategy(type("Headless", (FederatedStrategy,), {"name": "headless"}))
    with pytest.raises(TypeError, match="has no strategy name"):
        register_strategy(type("Nameless", (FederatedStrategy,), {"client_half": FedAvgClient}))
    twice = Option("sgca-alpha", 0.5, "another alpha", positive, "x")
    with pytest.raises(ValueError, match="declares run-config key 'sgca-alpha'.*differently"):
        register_strategy(
            type("Twice", (FederatedStrategy,), {"name": "twice", "client_half": FedAvgClient, "options": (twice,)})
        )
    assert set(scratch_registry) == set(STRATEGIES) and "twice" not in STRATEGIES
    register_strategy(
        type(
            "Generic",
            (FederatedStrategy,),
            {"name": "generic", "client_half": FedAvgClient, "options": (Option("lr", 1.0, "another lr"),)},
        )
    )
    with pytest.raises(ConfigError, match="strategy 'generic' declares run-config key 'lr', a generic key"):
        defaults()


def test_a_registered_strategy_brings_its_options_facts_and_checks_to_the_run_config(scratch_registry):
    class Toy(FederatedStrategy):
        """Leaves a site: nothing (a test strategy)."""

        name = "toy"
        client_half = FedAvgClient
        options = (Option("toy-weight", 0.5, "toy: a weight", positive, "toy"),)
        tasks = ("segmentation",)

        @classmethod
        def check_config(cls, c, check_paths):
            if c.toy_weight > 1:
                raise bad("toy-weight", c.toy_weight, "must be <= 1 with this toy")

    register_strategy(Toy)
    c = ExperimentConfig.from_run_config(
        {**defaults(), "strategy": "toy", "dataset": "synthetic-seg", "partition": "iid", "toy-weight": 0.25}
    )
    assert c.toy_weight == 0.25 and c.strategy_class is Toy
    with pytest.raises(ConfigError, match="'toy-weight' = 2.0 is invalid: must be <= 1 with this toy"):
        ExperimentConfig.from_run_config(
            {**defaults(), "strategy": "toy", "dataset": "synthetic-seg", "partition": "iid", "toy-weight": 2.0}
        )
    with pytest.raises(ConfigError, match="'toy-weight' = -1.0 is invalid: must be > 0"):
        ExperimentConfig.from_run_config({**defaults(), "toy-weight": -1.0})
    with pytest.raises(ConfigError, match="'strategy' = 'toy' is invalid: it trains segmentation models only"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "toy"})


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
        ("lr", float("inf"), ["'lr'", "inf", "finite number"]),
        ("node-wait-timeout", float("inf"), ["'node-wait-timeout'", "finite number"]),
        ("sgca-alpha", float("nan"), ["'sgca-alpha'", "finite number"]),
        ("num-rounds", float("inf"), ["'num-rounds'", "integer"]),
        ("lat-layers", float("inf"), ["'lat-layers'", "integer >= 1 or 'all'"]),
        ("seed", 2**32, ["'seed'", "4294967296", "[0, 2**32)"]),
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


@pytest.mark.parametrize(
    "overrides, dataset, valid",
    [
        ({"strategy": "sgca", "dataset": "synthetic-seg"}, "synthetic-seg", "natural, iid"),
        ({"dataset": "segfolder:/data/polyp", "partition": "pathological"}, "segfolder:/data/polyp", "natural, iid"),
        (
            {"dataset": "medmnist:pneumoniamnist", "partition": "natural"},
            "medmnist:pneumoniamnist",
            "iid, dirichlet, pathological, qbli",
        ),
        (
            {
                "strategy": "fedbkd",
                "dataset": "synthetic-seg",
                "partition": "qbli",
                "site-datasets": "synthetic,synthetic-seg",
            },
            "synthetic-seg",
            "natural, iid",
        ),
    ],
)
def test_a_partition_every_site_would_refuse_is_refused_up_front(overrides, dataset, valid):
    """A new user's `strategy='sgca' dataset='synthetic-seg'` used to start, then fail on every site."""
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_run_config({**defaults(), **overrides}, check_paths=False)
    message = str(err.value)
    assert message.startswith(f"run-config 'partition' = {overrides.get('partition', 'dirichlet')!r} is invalid")
    assert repr(dataset) in message and message.endswith("valid choices are " + valid)


def test_supported_partitions_pass():
    for overrides in (
        {"dataset": "synthetic-seg", "partition": "natural"},
        {"dataset": "synthetic-seg", "partition": "iid"},
        {"dataset": "synthetic", "partition": "natural"},
        {"dataset": "site", "num-classes": 2},
        {"dataset": "medmnist:pneumoniamnist", "partition": "qbli"},
    ):
        ExperimentConfig.from_run_config({**defaults(), **overrides}, check_paths=False)


def test_server_refuses_a_natural_partition_of_a_manifest_without_sites_before_round_1(tmp_path, monkeypatch):
    """Only reading the csv tells whether it has a site column: the ServerApp reads it once, before any message."""
    from PIL import Image

    from medflower import inprocess
    from medflower.data import DataError

    for i in range(4):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / f"{i}.png")
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("path,label\n" + "".join(f"{i}.png,{i % 2}\n" for i in range(4)))
    monkeypatch.setattr(
        inprocess.InProcessGrid,
        "send_and_receive",
        lambda *a, **k: pytest.fail("a message was sent before the partition was checked"),
    )
    config = {
        "dataset": f"csv:{manifest}",
        "partition": "natural",
        "backbone-weights": "none",
        "output-dir": str(tmp_path / "out"),
        "run-name": "csv",
    }
    with pytest.raises(DataError, match="partition 'natural' needs a site per row"):
        inprocess.run_inprocess(config, num_nodes=2)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("dataset", "csv:{tmp}/none.csv", "manifest {tmp}/none.csv does not exist"),
        ("dataset", "segfolder:{tmp}/none", "folder {tmp}/none does not exist"),
        ("dataset", "volumes:{tmp}/none", "folder {tmp}/none does not exist"),
        ("site-datasets", "synthetic,csv:{tmp}/none.csv", "manifest {tmp}/none.csv does not exist"),
    ],
)
def test_a_dataset_path_that_is_not_there_is_refused_with_the_key_and_the_path(tmp_path, key, value, message):
    value = value.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match=f"'{key}'.*{message.format(tmp=tmp_path)}"):
        ExperimentConfig.from_run_config({**defaults(), "partition": "iid", key: value}, check_paths=True)
