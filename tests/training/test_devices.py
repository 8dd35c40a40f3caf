"""Device choice per site and mixed precision (medflower/training/loops.py): a device a site lacks is refused with the
devices it has and the node named, the other sites go on; bf16 autocast (and its float32 fallback) on the CPU.

These run on the CPU; where a GPU is present the refusal tests that need its absence are skipped.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers import TINY, records, run_dir_of

from medflower.config import ExperimentConfig, defaults
from medflower.data import load_client_data, make_loader
from medflower.inprocess import run_inprocess
from medflower.models import build_model
from medflower.training import DeviceError, OptimizerSpec, autocast, evaluate, pick_device, train_epochs

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_auto_and_cpu_are_always_there():
    assert pick_device("cpu") == torch.device("cpu") == pick_device(" CPU ")
    assert pick_device("auto").type in ("cuda", "mps", "cpu")


@no_gpu
@pytest.mark.parametrize("name", ["cuda", "cuda:1", "tpu", "gpu0"])
def test_a_device_this_site_lacks_is_refused_with_the_devices_it_has(name, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError) as err:
        pick_device(name)
    assert str(err.value) == f"device {name!r} does not exist here; this site has cpu (CUDA_VISIBLE_DEVICES='')"


@no_gpu
def test_a_site_without_the_device_fails_alone(tmp_path):
    """node-config device=cuda on one SuperNode: that site's replies are errors naming it, the others train."""
    config = {**TINY, "num-rounds": 2, "output-dir": str(tmp_path), "run-name": "r", "min-nodes": 1}
    run_inprocess(config, num_nodes=3, node_configs=[{}, {"device": "cuda"}, {}])
    server = records(run_dir_of(config), "server")
    for rec in server:
        assert len(rec["failed"]) == 2  # train and evaluate of the one site
        assert all(
            "node 2 (partition 1): device 'cuda' does not exist here; this site has cpu" in f for f in rec["failed"]
        )
    trained = {r["client"] for r in records(run_dir_of(config), "train")}
    assert trained == {"site-0", "site-2"}


@pytest.fixture(scope="module")
def tiny_setup():
    cfg = ExperimentConfig.from_run_config({**defaults(), **TINY, "synthetic-size": 256}, check_paths=False)
    data = load_client_data(cfg.data_spec(cache_dir=""), 0, 1)
    return cfg, data


def trained(tiny_setup, precision: str) -> tuple[dict[str, float], dict[str, np.ndarray], dict]:
    """Two epochs from the same seeded start, then the test metrics, under ``precision``."""
    cfg, data = tiny_setup
    torch.manual_seed(0)
    model = build_model(cfg.model_spec(data.class_names), data.num_classes)
    torch.manual_seed(1)
    cpu = torch.device("cpu")
    loss = train_epochs(
        model,
        make_loader(data.train, 32, True, 3),
        epochs=2,
        optimizer=OptimizerSpec("sgd", 0.05),  # linear in the gradients: their bf16 error shows in the update
        device=cpu,
        precision=precision,
    )
    metrics = evaluate(model, make_loader(data.test, 64, False, 0), cpu, data.class_names, precision=precision)
    return loss, {k: v.copy() for k, v in model.get_trainable().items()}, metrics


def test_auto_on_the_cpu_is_float32_exactly(tiny_setup):
    assert isinstance(autocast(torch.device("cpu")), contextlib.nullcontext)
    auto, fp32 = trained(tiny_setup, "auto"), trained(tiny_setup, "fp32")
    assert auto[0] == fp32[0] and auto[2] == fp32[2]
    for name, value in fp32[1].items():
        np.testing.assert_array_equal(auto[1][name], value)


def test_bf16_autocast_on_the_cpu_matches_float32_within_its_rounding(tiny_setup):
    """bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4 %): after two epochs of SGD the losses, the test
    metrics and each array's update (its change from the common start) stay within a few per cent of float32's,
    while the computation did change."""
    cfg, data = tiny_setup
    torch.manual_seed(0)
    start = build_model(cfg.model_spec(data.class_names), data.num_classes).get_trainable()
    bf16, fp32 = trained(tiny_setup, "bf16"), trained(tiny_setup, "fp32")
    assert bf16[0]["train_loss"] == pytest.approx(fp32[0]["train_loss"], rel=0.01)
    assert bf16[2]["loss"] == pytest.approx(fp32[2]["loss"], rel=0.01)
    assert abs(bf16[2]["accuracy"] - fp32[2]["accuracy"]) <= 0.05
    for name, value in fp32[1].items():
        update = value - start[name]
        error = np.linalg.norm(bf16[1][name] - value) / max(np.linalg.norm(update), 1e-12)
        assert 0 < error <= 0.05, f"{name}: the bf16 update differs by {error:.1%} from float32's"


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision 'fp16'"):
        autocast(torch.device("cpu"), "fp16")
