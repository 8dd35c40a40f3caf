"""Two small trained runs for the predict and export tests, and their models assembled by hand.

A classifier trained by FedAvg (one global model) and a segmenter trained by FedSA (each site keeps its own LoRA B
matrices and head: the global arrays plus the site's state), two sites each, on a 2-block test ViT. Each run is made
once per test session: a later test module finds it in the session's temporary folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, RecordDict
from helpers import TINY
from safetensors.numpy import load_file

SMALL = {**TINY, "backbone": "test_vit", "synthetic-size": 96, "num-rounds": 2, "batch-size": 8, "lr": 0.03}
RUNS = {
    "classifier": {"strategy": "fedavg"},
    "segmenter": {"strategy": "fedsa", "dataset": "synthetic-seg"},
}


def trained_run(tmp_path_factory, kind: str) -> Path:
    """The run folder of ``kind`` (RUNS), trained on first use in this session."""
    from medflower.inprocess import run_inprocess

    base = tmp_path_factory.getbasetemp() / "trained-runs"
    folder = base / kind
    if not (folder / "summary.json").is_file():
        run_inprocess({**SMALL, **RUNS[kind], "output-dir": str(base), "run-name": kind}, num_nodes=2)
    return folder


def run_config(folder: Path):
    from medflower.config import ExperimentConfig

    config = json.loads((folder / "config.json").read_text())
    config.pop("resolved")
    return ExperimentConfig.from_run_config(config, check_paths=False)


def last_round(folder: Path) -> Path:
    return sorted((folder / "checkpoint").glob("round-*"))[-1]


def hand_model(folder: Path, partition: int | None = None) -> torch.nn.Module:
    """The run's model from its files, by hand: the checkpoint's arrays (FedAvg: the whole model); with a partition,
    that site's own saved arrays with the global (shared) ones in their place (FedSA's site model)."""
    from medflower.data import describe_source
    from medflower.models import build_model

    cfg = run_config(folder)
    names = describe_source(cfg.data_spec())[1]
    model = build_model(cfg.model_spec(names), len(names))
    arrays = load_file(str(last_round(folder) / "arrays.safetensors"))
    if partition is not None:
        (own,) = (folder / "client-state" / f"partition-{partition}").iterdir()
        rnd = int(last_round(folder).name.split("-")[1])
        model.set_trainable(load_file(str(own / f"round-{rnd}.safetensors")))
        model.set_trainable(arrays, strict=False)
    else:
        model.set_trainable(arrays)
    return model.eval()


def site_test_split(folder: Path, partition: int):
    """(images, targets) of a site's test split: uint8 (S, S, 3) images and class labels or class-index masks."""
    from medflower.contract.client import ClientRuntime

    node = {"partition-id": partition, "num-partitions": 2}
    context = Context(run_id=0, node_id=partition + 1, node_config=node, state=RecordDict(), run_config={})
    test = ClientRuntime(run_config(folder), context, {}, partition, 2).raw_data.test
    images, targets = zip(*(test[i] for i in range(len(test))))
    return [np.asarray(x) for x in images], list(targets)


def last_evaluation(folder: Path, site: str) -> dict:
    """The site's record of the run's last evaluation (metrics.jsonl)."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval" and r["client"] == site][-1]


def model_outputs(model: torch.nn.Module, images: list[np.ndarray]) -> torch.Tensor:
    """The model's logits for uint8 images as the loaders feed them (resized, ImageNet-normalised)."""
    from medflower.data.transforms import images_to_tensor

    with torch.no_grad():
        return model(images_to_tensor(images, model.spec.img_size)).float()
