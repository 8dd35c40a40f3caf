"""ServerApp: run config -> ExperimentConfig -> strategy -> rounds -> outputs."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from logging import ERROR, INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from . import run_folder
from .config import ConfigError, ExperimentConfig
from .contract.checkpoint import Checkpointer, resolve_checkpoint_dir, run_folder_of
from .contract.server import FederatedStrategy
from .data import describe_source
from .data.partition import check_partition_supported
from .models import AdaptedModel, ModelSpec, build_model
from .privacy import check_dp_sgd_model
from .privacy.ledger import check_client_dp_model
from .results import RunRecorder, safe_name
from .tracking import open_tracking

app = ServerApp()


def run_experiment(grid: Grid, run_config: dict) -> dict:
    """Validate, build, run and write outputs; returns summary.json's content."""
    started = time.monotonic()
    cfg = ExperimentConfig.from_run_config(run_config)
    num_classes = num_classes_of(cfg)
    recorder = RunRecorder(open_run_folder(cfg))
    server_model = ServerModel.build(cfg, num_classes)
    strategy = build_or_resume_strategy(cfg, recorder, server_model, num_classes)
    start_recording(cfg, recorder, strategy, server_model, num_classes)
    return run_and_finish(grid, cfg, recorder, strategy, started)


def num_classes_of(cfg: ExperimentConfig) -> int:
    """The run's number of classes: run-config num-classes, else its data source's. What every site would refuse at
    its first message (a partition its dataset cannot take) is refused once here first."""
    num_classes = cfg.declared_num_classes or describe_source(cfg.data_spec())[0]
    for dataset in cfg.split_datasets:
        check_partition_supported(cfg.data_spec(dataset=dataset))
    return num_classes


def open_run_folder(cfg: ExperimentConfig) -> Path:
    """The run's folder: resume-from's run folder, else <output-dir>/<run-name>, readied for a new run
    (``run_folder.prepare_new``: a folder that already holds a run is refused unless overwrite=true)."""
    if cfg.resume_from:
        return run_folder_of(resolve_checkpoint_dir(cfg.resume_from))
    name = cfg.run_name or f"{cfg.strategy}-{safe_name(cfg.dataset)}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(cfg.output_dir).expanduser() / safe_name(name)
    run_folder.prepare_new(run_dir, cfg.overwrite)
    return run_dir


@dataclass(frozen=True)
class ServerModel:
    """The server's build of the run's model: its spec, the model and its initial trainable arrays."""

    spec: ModelSpec
    model: AdaptedModel
    initial: OrderedDict[str, np.ndarray]

    @classmethod
    def build(cls, cfg: ExperimentConfig, num_classes: int) -> ServerModel:
        """The model as the strategy sizes it, refused before round 1 where the run's privacy cannot apply to it."""
        spec = cfg.model_spec(cfg.server_class_names(num_classes))
        model = build_model(spec, cfg.strategy_class.model_classes(num_classes))
        check_dp_sgd_model(cfg, model)  # before round 1: every trainable layer needs Opacus's per-sample gradients
        check_client_dp_model(cfg, model)  # before round 1: no noise on BatchNorm running statistics
        return cls(spec, model, model.get_trainable())

    @property
    def size(self) -> int:
        """Its trainable parameters."""
        return sum(v.size for v in self.initial.values())


def build_or_resume_strategy(
    cfg: ExperimentConfig, recorder: RunRecorder, server_model: ServerModel, num_classes: int
) -> FederatedStrategy:
    """The run's strategy on the model's initial arrays, restored from resume-from's checkpoint (the rounds after
    it are dropped, to be redone); a model with nothing to train is refused."""
    strategy = cfg.strategy_class(cfg, recorder, server_model.initial, num_classes)
    if cfg.resume_from:
        strategy.restore(resolve_checkpoint_dir(cfg.resume_from))
        # later rounds (a chosen earlier round, or newer ones refused as corrupt) are redone: drop them
        Checkpointer(recorder.run_dir / run_folder.CHECKPOINT).discard_after(strategy.completed_rounds)
        done = strategy.completed_rounds
        # evaluate-in-train: the checkpoint's round was evaluated in the next round's replies, which are redone
        recorder.truncate_after(done, done - 1 if cfg.evaluate_in_train and done < strategy.total_rounds() else done)
    if server_model.size == 0:
        raise ConfigError(
            f"nothing trains: strategy {cfg.strategy!r} with backbone {cfg.backbone!r} and adapter "
            f"{server_model.spec.adapter!r} has no trainable parameter (a frozen head and no adapter); choose an "
            f"adapter (lora, bottleneck, ...) or a trainable head"
        )
    return strategy


def start_recording(
    cfg: ExperimentConfig,
    recorder: RunRecorder,
    strategy: FederatedStrategy,
    server_model: ServerModel,
    num_classes: int,
) -> None:
    """Before round 1: the recorder's training plan and experiment tracking, config.json (with what the 'auto'
    settings became) and the run's line in the log."""
    recorder.training_plan = (cfg.batch_size, cfg.local_epochs)  # a small site's training records say so once
    recorder.tracking = open_tracking(cfg, recorder.run_dir, strategy.completed_rounds)
    recorder.write_config(
        {**cfg.to_dict(), "resolved": {**resolved_model(cfg, server_model.model), "rounds": strategy.total_rounds()}}
    )
    log(
        INFO,
        "[medflower] %s on %s: %s + %s, %d trainable parameters in %d arrays, %d classes; outputs in %s",
        cfg.strategy,
        cfg.dataset,
        cfg.backbone,
        server_model.spec.adapter,
        server_model.size,
        len(server_model.initial),
        num_classes,
        recorder.run_dir.resolve(),
    )


def resolved_model(cfg: ExperimentConfig, model) -> dict:
    """What the run config's 'auto' settings became, recorded in config.json and said once in the log: the weights
    (file and SHA-256 for LiteMedSAM), the input normalisation and the frozen-encoder mode (docs/models.md)."""
    problem = cfg.frozen_encoder_problem(model.spec.adapter)
    resolved = {
        "weights-source": model.weights_source,
        "input-norm": model.input_norm_name,
        "frozen-encoder": "on" if problem is None else "off",
        "frozen-encoder-reason": problem or "nothing inside the encoder trains: each site encodes its images once",
        "torch-threads": torch.get_num_threads(),
    }
    log(
        INFO,
        "[medflower] weights %s, input normalisation %s; frozen-encoder mode %s (%s)",
        resolved["weights-source"],
        resolved["input-norm"],
        resolved["frozen-encoder"],
        resolved["frozen-encoder-reason"],
    )
    return resolved


def run_and_finish(
    grid: Grid, cfg: ExperimentConfig, recorder: RunRecorder, strategy: FederatedStrategy, started: float
) -> dict:
    """The rounds, then run-config cross-site-evaluation and the run's summary (summary.json's content, returned);
    the experiment tracking is closed either way (as failed if anything raised)."""
    tracking = recorder.tracking
    elapsed_before = strategy.elapsed_s
    try:
        strategy.run(grid)
        wall = elapsed_before + (time.monotonic() - started)
        extra = {**strategy.summary_extra(), **(strategy.privacy.summary() if strategy.privacy else {})}
        if cfg.cross_site_evaluation:  # after the last round: the site x model matrix of the final models
            extra["cross_site"] = strategy.cross_site_evaluation(grid)
        summary = recorder.finish(
            cfg.strategy, cfg.dataset, wall, extra=extra, report=strategy.report(), figures=cfg.run_figures
        )
    except BaseException:
        if tracking is not None:
            tracking.close(failed=True)
        raise
    if tracking is not None:
        tracking.close()
    final = ", ".join(
        f"{k}={v:.4f}"
        for k, v in summary["final"].items()
        if k in ("auc", "lca", "accuracy", "dice", "iou") and v is not None
    )
    log(
        INFO,
        "[medflower] finished %d %ss: %s; summary in %s",
        summary["rounds"],
        strategy.round_label,
        final,
        recorder.run_dir.resolve(),
    )
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run_experiment(grid, dict(context.run_config))
    except (ConfigError, FileNotFoundError, ValueError) as err:
        log(ERROR, "[medflower] %s", err)
        raise
