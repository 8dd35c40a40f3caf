"""ServerApp: run config -> ExperimentConfig -> strategy -> rounds -> outputs."""

from __future__ import annotations

import time
from datetime import datetime
from logging import ERROR, INFO, WARNING
from pathlib import Path

import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from . import run_folder
from .config import ConfigError, ExperimentConfig
from .contract.checkpoint import Checkpointer, resolve_checkpoint_dir, run_folder_of
from .data import describe_source
from .data.partition import check_partition_supported
from .models import build_model
from .privacy import check_dp_sgd_model
from .privacy.ledger import check_client_dp_model
from .results import RunRecorder, safe_name
from .tracking import open_tracking

app = ServerApp()


def run_folder_path(cfg: ExperimentConfig) -> Path:
    """The run's folder: resume-from's run folder, else <output-dir>/<run-name>."""
    if cfg.resume_from:
        return run_folder_of(resolve_checkpoint_dir(cfg.resume_from))
    name = cfg.run_name or f"{cfg.strategy}-{safe_name(cfg.dataset)}-{datetime.now():%Y%m%d-%H%M%S}"
    return Path(cfg.output_dir).expanduser() / safe_name(name)


def prepare_run_folder(cfg: ExperimentConfig, run_dir: Path) -> None:
    """A new run (no resume-from) starts in an absent or empty folder; a folder that already holds a run is
    refused, unless overwrite=true, which deletes that run's outputs (docs/deployment.md, "Faults")."""
    if cfg.resume_from:
        return
    held = run_folder.held_outputs(run_dir)
    if not held:
        return
    if not cfg.overwrite:
        raise ConfigError(
            f"run folder {run_dir.resolve()} already holds a run ({', '.join(held)}): set run-config "
            f"'resume-from' to it to continue that run, or 'overwrite=true' to delete it and start over "
            f"(or choose another 'run-name' / 'output-dir')"
        )
    log(WARNING, "[medflower] %s holds a run: overwrite=true, deleting it and starting over", run_dir.resolve())
    run_folder.delete_outputs(run_dir)


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


def run_experiment(grid: Grid, run_config: dict) -> dict:
    """Validate, build, run and write outputs; returns summary.json's content."""
    started = time.monotonic()
    cfg = ExperimentConfig.from_run_config(run_config)
    num_classes = cfg.declared_num_classes or describe_source(cfg.data_spec())[0]
    for dataset in cfg.split_datasets:  # what every site would refuse at its first message, refused once here
        check_partition_supported(cfg.data_spec(dataset=dataset))
    run_dir = run_folder_path(cfg)
    prepare_run_folder(cfg, run_dir)
    recorder = RunRecorder(run_dir)
    method = cfg.strategy_class
    model_spec = cfg.model_spec(cfg.server_class_names(num_classes))
    model = build_model(model_spec, method.model_classes(num_classes))
    check_dp_sgd_model(cfg, model)  # before round 1: every trainable layer needs Opacus's per-sample gradients
    check_client_dp_model(cfg, model)  # before round 1: no noise on BatchNorm running statistics
    initial = model.get_trainable()
    strategy = method(cfg, recorder, initial, num_classes)
    if cfg.resume_from:
        strategy.restore(resolve_checkpoint_dir(cfg.resume_from))
        # later rounds (a chosen earlier round, or newer ones refused as corrupt) are redone: drop them
        Checkpointer(run_dir / run_folder.CHECKPOINT).discard_after(strategy.completed_rounds)
        done = strategy.completed_rounds
        # evaluate-in-train: the checkpoint's round was evaluated in the next round's replies, which are redone
        recorder.truncate_after(done, done - 1 if cfg.evaluate_in_train and done < strategy.total_rounds() else done)
    size = sum(v.size for v in initial.values())
    if size == 0:
        raise ConfigError(
            f"nothing trains: strategy {cfg.strategy!r} with backbone {cfg.backbone!r} and adapter "
            f"{model_spec.adapter!r} has no trainable parameter (a frozen head and no adapter); choose an adapter "
            f"(lora, bottleneck, ...) or a trainable head"
        )
    recorder.training_plan = (cfg.batch_size, cfg.local_epochs)  # a small site's training records say so once
    recorder.tracking = tracking = open_tracking(cfg, run_dir, strategy.completed_rounds)
    recorder.write_config(
        {**cfg.to_dict(), "resolved": {**resolved_model(cfg, model), "rounds": strategy.total_rounds()}}
    )
    log(
        INFO,
        "[medflower] %s on %s: %s + %s, %d trainable parameters in %d arrays, %d classes; outputs in %s",
        cfg.strategy,
        cfg.dataset,
        cfg.backbone,
        model_spec.adapter,
        size,
        len(initial),
        num_classes,
        run_dir.resolve(),
    )
    elapsed_before = strategy.elapsed_s
    try:
        strategy.run(grid)
        wall = elapsed_before + (time.monotonic() - started)
        extra = {**strategy.summary_extra(), **(strategy.privacy.summary() if strategy.privacy else {})}
        if cfg.cross_site_evaluation:  # after the last round: the site x model matrix of the final models
            extra["cross_site"] = strategy.cross_site_evaluation(grid)
        summary = recorder.finish(cfg.strategy, cfg.dataset, wall, extra=extra, report=strategy.report())
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
        run_dir.resolve(),
    )
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run_experiment(grid, dict(context.run_config))
    except (ConfigError, FileNotFoundError, ValueError) as err:
        log(ERROR, "[medflower] %s", err)
        raise
