"""Run the experiments a YAML file lists, then write one comparison table and overlaid curves.

    python -m medflower.experiments experiments/baselines-synthetic.yaml

File layout::

    name: baselines-synthetic      # folder under --output-dir (default outputs/experiments)
    num-supernodes: 4              # simulated sites
    seeds: [0, 1, 2]
    metrics: [auc, accuracy]       # columns of the table (default auc, accuracy, balanced_accuracy)
    per-client: false              # true: also one table per metric with every site's value
    reference: local               # optional, with per-client: each run's Δm against this run (below)
    targets:                       # optional: rounds until the mean over sites (or a pooled metric) first
      metric: balanced_accuracy    # reaches each value
      values: [0.55, 0.65, 0.75]
    threads: 1                     # torch threads of every run (default 1): pinned, and recorded in config.json
    pretrain:                      # optional: foundation stand-ins the runs start from, built (once) when missing
      outputs/weights/vit-tiny-64-pool-mim.safetensors: --objective mim --dataset segfolder:data/ph2 --img-size 64
    base: {num-rounds: 5}          # run-config shared by every run
    extends: other.yaml            # optional: every entry of that file but its name; base merged key by key
    runs:
      - {name: fedavg, strategy: fedavg}
      - {name: local, strategy: local}

A ``pretrain`` entry maps a weights file to the arguments of ``python -m medflower.pretrain`` that make it
(docs/models.md#a-stand-in-pretrained-on-real-images); a file that exists is used as it is, so delete it to
rebuild. Each (run, seed) goes through ``flwr run`` against a SuperLink in simulation mode started for
this file alone (``--engine inprocess`` uses the in-process grid instead, for quick checks); running the
file again redoes every run in its folder (``overwrite: false`` in ``base`` refuses instead), and ``--resume`` keeps
each finished run of the same config and continues each stopped one from its checkpoint (``earlier_run``).
Outputs: one run folder per (run, seed), ``comparison.md``/``comparison.json`` (mean ± std
over seeds of the final mean-over-clients metrics, bytes per round), ``curves.png`` and ``per-site.png`` (each
run's final metrics per site as heat maps).
Metrics are summary.json's ``final`` entries: means over sites, or ``pooled_balanced_accuracy`` /
``pooled_accuracy`` (all sites' test rows together, from the server's round records; no per-site value).
Δm (FedBKD's Table 1): the mean over sites of (site's value − the reference run's value for that
site), in points (×100), per metric, over the sites that report the metric in both runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import os
import shlex
import statistics
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from . import run_folder
from .config import PATH_DATASETS, ConfigError, ExperimentConfig, defaults
from .pretrain import parse_args as parse_pretrain_args
from .progress import Job, Progress
from .results import POOLED, read_records, safe_name
from .strategies.continual.report import task_curve_layout
from .tracking import missing_package

DEFAULT_METRICS = ("auc", "accuracy", "balanced_accuracy")
PER_SITE = "per-site.png"  # the per-site table as heat maps
LOGS = "logs"  # --parallel: each run's output, <out_dir>/logs/<run-name>.log


class ExperimentFileError(ValueError):
    """The YAML file is malformed; the message names the file and the entry."""


def read_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML file as a dict, with the file its ``extends`` names merged under it.

    ``extends: other.yaml`` (relative to this file's folder) takes every top-level entry of that file but its
    ``name``; an entry here replaces the inherited one, except ``base``, which is merged key by key (a key set to
    null here drops the inherited value, so the run-config default applies). The chain may go on; a loop is an
    error. PyYAML and the YAML spec have no include mechanism (merge keys work within one document), hence this.
    """
    if not path.is_file():
        raise ExperimentFileError(f"experiment file {path} does not exist")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ExperimentFileError(f"{path}: 'extends' loops back to a file already read: {chain}")
    plan = yaml.safe_load(path.read_text()) or {}
    if not isinstance(plan, dict):
        raise ExperimentFileError(f"{path}: needs a mapping of entries (name, seeds, base, runs, ...)")
    if not isinstance(plan.get("base", {}), dict):
        raise ExperimentFileError(f"{path}: 'base' maps run-config keys to values, e.g. {{num-rounds: 5}}")
    parent_name = plan.pop("extends", None)
    if parent_name is None:
        return plan
    if not isinstance(parent_name, str) or not parent_name:
        raise ExperimentFileError(f"{path}: 'extends' names one experiment file, got {parent_name!r}")
    parent = read_file(path.parent / parent_name, (*_seen, path.resolve()))
    parent.pop("name", None)
    base = {**parent.get("base", {}), **plan.get("base", {})}
    plan = {**parent, **plan, "base": {k: v for k, v in base.items() if v is not None}}
    return plan


def load_plan(path: Path) -> dict[str, Any]:
    """Parse and validate the YAML file; every run's config is validated before anything runs."""
    plan = read_file(path)
    if not isinstance(plan.get("runs"), list) or not plan["runs"]:
        raise ExperimentFileError(f"{path}: needs a non-empty 'runs' list")
    plan.setdefault("name", path.stem)
    plan.setdefault("seeds", [0])
    plan.setdefault("num-supernodes", 4)
    plan.setdefault("metrics", list(DEFAULT_METRICS))
    plan.setdefault("base", {})
    plan.setdefault("per-client", False)
    plan.setdefault("threads", 1)
    if not isinstance(plan["threads"], int) or isinstance(plan["threads"], bool) or plan["threads"] < 1:
        raise ExperimentFileError(f"{path}: 'threads' must be a whole number >= 1, got {plan['threads']!r}")
    targets = plan.get("targets")
    if targets is not None and not (
        isinstance(targets, dict)
        and isinstance(targets.get("metric"), str)
        and isinstance(targets.get("values"), list)
        and all(isinstance(v, (int, float)) for v in targets["values"])
    ):
        raise ExperimentFileError(
            f"{path}: 'targets' needs a metric name and a list of values, e.g. "
            "{metric: balanced_accuracy, values: [0.55, 0.65, 0.75]}"
        )
    plan["pretrain"] = _stand_ins(path, plan.get("pretrain"))
    names = set()
    for i, run in enumerate(plan["runs"]):
        if not isinstance(run, dict) or "name" not in run:
            raise ExperimentFileError(f"{path}: runs[{i}] needs a 'name'")
        if run["name"] in names:
            raise ExperimentFileError(f"{path}: run name {run['name']!r} appears twice")
        names.add(run["name"])
        for seed in plan["seeds"]:
            config = run_config(plan, run, seed, Path("."))
            if config.get("backbone-weights") in plan["pretrain"]:  # built before the first run
                config["backbone-weights"] = "none"
            try:
                cfg = ExperimentConfig.from_run_config({**defaults(), **config}, check_paths=True)
            except ConfigError as err:
                raise ExperimentFileError(f"{path}: run {run['name']!r}: {err}") from err
            if problem := missing_package(cfg.tracking):  # the server's environment: where this command runs
                raise ExperimentFileError(f"{path}: run {run['name']!r}: {problem}")
    if plan.get("reference") is not None and plan["reference"] not in names:
        raise ExperimentFileError(
            f"{path}: 'reference' {plan['reference']!r} is not one of the runs ({', '.join(sorted(names))})"
        )
    return plan


def _stand_ins(path: Path, block: Any) -> dict[str, list[str]]:
    """The ``pretrain`` block as {absolute weights path: pretrain arguments}; a malformed entry is an error."""
    if block is None:
        return {}
    if not isinstance(block, dict) or not all(isinstance(v, (str, list)) for v in block.values()):
        raise ExperimentFileError(
            f"{path}: 'pretrain' maps a weights file to the arguments of python -m medflower.pretrain, e.g. "
            "{outputs/weights/w.safetensors: --objective mim --dataset segfolder:data/ph2}"
        )
    stand_ins = {}
    for out, args in block.items():
        argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
        if "--out" in argv:
            raise ExperimentFileError(f"{path}: pretrain entry {out}: the key is the output file; drop --out")
        problem = io.StringIO()
        try:
            with contextlib.redirect_stderr(problem):
                parse_pretrain_args(argv)
        except SystemExit as err:
            message = problem.getvalue().strip().splitlines()[-1:] or [str(err)]
            raise ExperimentFileError(f"{path}: pretrain entry {out}: {message[0]}") from None
        stand_ins[str(Path(out).expanduser().resolve())] = argv
    return stand_ins


def build_stand_ins(plan: dict[str, Any]) -> None:
    """Pretrain each missing ``pretrain`` weights file before the first run (an existing one is reused)."""
    from .pretrain import main as pretrain

    for out, argv in plan.get("pretrain", {}).items():
        if Path(out).is_file():
            print(f"stand-in {out}: exists, reused", flush=True)
            continue
        print(f"stand-in {out}: python -m medflower.pretrain {shlex.join(argv)}", flush=True)
        if pretrain([*argv, "--out", out]) != 0:
            raise ExperimentFileError(f"pretraining {out} failed")


def select_runs(plan: dict[str, Any], only: str) -> dict[str, Any]:
    """The plan restricted to the comma-separated run names ``only`` ('' = every run), in the file's order."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    if not names:
        return plan
    known = [run["name"] for run in plan["runs"]]
    if unknown := [n for n in names if n not in known]:
        raise ExperimentFileError(
            f"--only names {', '.join(unknown)}, which the file does not list (its runs: {', '.join(known)})"
        )
    if plan.get("reference") is not None and plan["reference"] not in names:
        raise ExperimentFileError(f"--only must include the reference run {plan['reference']!r}")
    return {**plan, "runs": [run for run in plan["runs"] if run["name"] in names]}


def select_seeds(plan: dict[str, Any], seeds: str) -> dict[str, Any]:
    """The plan restricted to the comma-separated seeds ``seeds`` ('' = every seed), in the file's order: more
    seeds for a table can be run later (or elsewhere) and compared together with ``--compare-only``."""
    parts = [s.strip() for s in seeds.split(",") if s.strip()]
    if not parts:
        return plan
    if bad := [s for s in parts if not s.lstrip("-").isdigit()]:
        raise ExperimentFileError(f"--seeds takes comma-separated integers, got {', '.join(bad)}")
    chosen = {int(s) for s in parts}
    if unknown := sorted(chosen - set(plan["seeds"])):
        raise ExperimentFileError(
            f"--seeds names {', '.join(map(str, unknown))}, which the file does not list (its seeds: "
            f"{', '.join(map(str, plan['seeds']))})"
        )
    return {**plan, "seeds": [s for s in plan["seeds"] if s in chosen]}


def delta_m(row: dict[str, float | None], reference: dict[str, float | None]) -> float | None:
    """FedBKD's Δm: mean over the sites in both of (value − reference value), in points (×100)."""
    diffs = [row[c] - reference[c] for c in row if row[c] is not None and reference.get(c) is not None]
    return 100.0 * statistics.fmean(diffs) if diffs else None


def _absolute_dataset(dataset: str) -> str:
    """A file-backed dataset entry with its path made absolute; other entries unchanged."""
    kind, colon, arg = dataset.partition(":")
    if colon and kind in PATH_DATASETS:
        return f"{kind}:{Path(arg).expanduser().resolve()}"
    return dataset


def absolute_paths(config: dict[str, Any]) -> dict[str, Any]:
    """Relative data/weights paths are meant from where this command runs, not from the SuperLink's folder."""
    out = dict(config)
    if "data-dir" in out:
        out["data-dir"] = str(Path(out["data-dir"]).expanduser().resolve())
    if "dataset" in out:
        out["dataset"] = _absolute_dataset(str(out["dataset"]))
    if out.get("site-datasets"):
        out["site-datasets"] = ",".join(_absolute_dataset(e.strip()) for e in str(out["site-datasets"]).split(","))
    weights = out.get("backbone-weights")
    if isinstance(weights, str) and weights not in ("none", "auto"):
        out["backbone-weights"] = str(Path(weights).expanduser().resolve())
    for key in ("class-embeddings", "text-encoder"):
        if out.get(key):
            out[key] = str(Path(out[key]).expanduser().resolve())
    uri = out.get("tracking-uri")
    if isinstance(uri, str) and uri and ":" not in uri.split("/")[0]:  # a folder, not a URI (sqlite:, http:, ...)
        out["tracking-uri"] = str(Path(uri).expanduser().resolve())
    return out


def run_name(run: dict[str, Any], seed: int) -> str:
    """The run name, and folder under the file's output folder, of one (run, seed): ``<run>-seed<k>``."""
    return f"{safe_name(run['name'])}-seed{seed}"


def run_config(plan: dict[str, Any], run: dict[str, Any], seed: int, out_dir: Path) -> dict[str, Any]:
    """One (run, seed)'s run config. Its folder is <out_dir>/<run>-seed<k>: running the file again redoes it
    (``overwrite`` true unless the file sets it false, then a finished run's folder is refused). Tracked runs of a
    file go together: an MLflow experiment named after the file, TensorBoard log folders side by side in
    <out_dir>/tensorboard/ (docs/experiments.md#tracking)."""
    config = {"overwrite": True, "tracking-experiment": plan["name"], **plan["base"]}
    config.update({k: v for k, v in run.items() if k != "name"})
    config.update({"seed": seed, "output-dir": str(out_dir.resolve()), "run-name": run_name(run, seed)})
    return absolute_paths(config)


def earlier_run(config: dict[str, Any], threads: int) -> str:
    """What the (run, seed)'s folder already holds of this very run, for ``--resume``: "finished" (summary.json), or
    "stopped" (a valid checkpoint to continue from, ``resume-from``), or "" (nothing, another config's run, files
    that do not read, or no valid checkpoint: then the run starts over). The same run: its config.json holds every
    key the file gives it with the same value (``overwrite`` and ``resume-from`` aside) and the same torch thread
    count. Defaults the file does not set are not compared, so a run made by an older medflower whose defaults have
    since changed is kept: delete its folder (or leave out ``--resume``) to redo it."""
    folder = Path(config["output-dir"]) / config["run-name"]
    try:
        recorded = json.loads((folder / run_folder.CONFIG).read_text())
        resolved = recorded["resolved"]
        same = all(
            recorded[key] == json.loads(json.dumps(value))
            for key, value in config.items()
            if key not in ("overwrite", "resume-from")
        )
        same = same and int(resolved["torch-threads"]) == threads
    except (OSError, ValueError, TypeError, KeyError):  # no run here, or one whose config does not read
        return ""
    if not same:
        return ""
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((folder / run_folder.SUMMARY_JSON).read_text())
        if isinstance(summary, dict) and isinstance(summary.get("final"), dict):
            return "finished"
    from .contract.checkpoint import Checkpointer, CheckpointError

    try:  # a valid checkpoint, the newest one that passes its digest check (the one resume-from takes)
        Checkpointer(folder / run_folder.CHECKPOINT).load()
    except (FileNotFoundError, CheckpointError):
        return ""
    return "stopped"


def execute(plan: dict[str, Any], out_dir: Path, engine: str, parallel: int = 1, resume: bool = False) -> None:
    """Every (run, seed) of the file, with torch's thread count pinned to the file's ``threads`` (results on the CPU
    change with it: the order of floating-point sums does); config.json records it (``resolved.torch-threads``).
    ``parallel`` > 1 (in process only): that many runs at a time, each in a fresh process (``run_parallel``).
    ``resume``: a finished run of the same config is kept, a stopped one continues from its checkpoint
    (``earlier_run``); the others run from the start."""
    build_stand_ins(plan)
    jobs = [(run, seed) for run in plan["runs"] for seed in plan["seeds"]]
    n = int(plan["num-supernodes"])
    threads = int(plan["threads"])
    configs = [run_config(plan, run, seed, out_dir) for run, seed in jobs]
    if resume:
        jobs, configs = resumed_jobs(jobs, configs, threads)
        if not jobs:
            return
    progress = Progress(
        [
            Job(
                f"{run['name']} seed {seed}",
                out_dir / config["run-name"],
                int(config.get("num-rounds", 5)),
                continued=bool(config.get("resume-from")),
            )
            for (run, seed), config in zip(jobs, configs)
        ]
    )
    where = "in process" if engine == "inprocess" else f"flwr run, {n} simulated sites"
    at_once = f", {parallel} at a time, each run's log in {out_dir / LOGS}" if parallel > 1 else ""
    print(f"{len(jobs)} runs ({where}, {threads} torch thread(s) each{at_once})", flush=True)

    def finished(i: int, failure: str = "") -> None:
        path = out_dir / configs[i]["run-name"] / run_folder.SUMMARY_JSON
        summary = json.loads(path.read_text()) if path.is_file() and not failure else None
        progress.finish(i, summary, list(plan["metrics"]), failure)

    if engine == "inprocess" and parallel > 1:
        try:
            run_parallel(configs, n, threads, parallel, out_dir / LOGS, progress, finished)
        finally:
            progress.close()
        return
    if engine == "inprocess":
        import torch

        from .inprocess import run_inprocess

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for i, config in enumerate(configs):
                progress.start(i)
                run_inprocess(config, num_nodes=n, record_sent=False)
                finished(i)
        finally:
            progress.close()
            torch.set_num_threads(before)
        return
    from .loopback import LoopbackFederation

    pinned = {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    with LoopbackFederation(num_supernodes=n, simulation=True, workdir=out_dir / ".superlink", extra_env=pinned) as fed:
        try:
            for i, config in enumerate(configs):
                progress.start(i)
                fed.run_app(config)
                finished(i)
        finally:
            progress.close()


def resumed_jobs(
    jobs: list[tuple[dict[str, Any], int]], configs: list[dict[str, Any]], threads: int
) -> tuple[list[tuple[dict[str, Any], int]], list[dict[str, Any]]]:
    """``--resume``: the jobs still to run, a stopped one with ``resume-from`` its folder; says what was kept."""
    left, left_configs, kept, continued = [], [], [], []
    for (run, seed), config in zip(jobs, configs):
        state = earlier_run(config, threads)
        if state == "finished":
            kept.append(config["run-name"])
            continue
        if state == "stopped":
            continued.append(config["run-name"])
            config = {**config, "resume-from": str(Path(config["output-dir"]) / config["run-name"])}
        left.append((run, seed))
        left_configs.append(config)
    print(
        f"--resume: {len(kept)} finished run(s) kept ({', '.join(kept) or 'none'}), "
        f"{len(continued)} continued from their checkpoints ({', '.join(continued) or 'none'}), "
        f"{len(left) - len(continued)} from the start",
        flush=True,
    )
    return left, left_configs


class RunsFailed(RuntimeError):
    """Some runs of a ``--parallel`` file failed; the others finished. The message names each with its log."""


class RunsMissing(RuntimeError):
    """A comparison asked for runs that have not finished; the message names every one."""


def _run_in_child(config: dict[str, Any], num_nodes: int, threads: int, log_path: str) -> None:
    """One run in a fresh process, everything it prints (Flower's log, a traceback) in ``log_path``."""
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    import torch

    from .inprocess import run_inprocess

    torch.set_num_threads(threads)
    run_inprocess(config, num_nodes=num_nodes, record_sent=False)


def run_parallel(
    configs: list[dict[str, Any]],
    num_nodes: int,
    threads: int,
    parallel: int,
    logs: Path,
    progress: Progress,
    finished: Callable[[int, str], None],
) -> None:
    """Up to ``parallel`` runs at a time, each in a fresh (spawned) process with ``threads`` torch threads and its log
    in ``logs/<run-name>.log``, started in the file's order. A fresh process per run: nothing carries over between
    runs (the same as running them one by one, which a test checks bit for bit), and a run's memory, on a GPU its
    CUDA context included, is returned when it ends. A run that fails is reported with its log and the others go on;
    RunsFailed at the end names the failures. Ctrl-C stops the runs under way and starts no more.

    The runs share the machine: on a CPU give each its thread(s) (``parallel`` × ``threads`` at most the cores), on a
    GPU keep ``parallel`` × one run's peak memory below the card's (docs/experiments.md#several-runs-at-a-time)."""
    logs.mkdir(parents=True, exist_ok=True)
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that has threads (and maybe CUDA)
    order = iter(range(len(configs)))
    lock = threading.Lock()
    stop = threading.Event()
    failures: dict[int, str] = {}
    children: dict[int, multiprocessing.process.BaseProcess] = {}

    def next_run() -> int | None:
        with lock:
            return None if stop.is_set() else next(order, None)

    def worker() -> None:
        while (i := next_run()) is not None:
            log = logs / f"{configs[i]['run-name']}.log"
            log.write_bytes(b"")
            child = spawn.Process(
                target=_run_in_child, args=(configs[i], num_nodes, threads, str(log)), name=configs[i]["run-name"]
            )
            progress.start(i)
            with lock:
                children[i] = child
            child.start()
            child.join()
            failure = "" if child.exitcode == 0 else f"exit code {child.exitcode}, its log: {log}"
            if failure:
                failures[i] = failure
            finished(i, failure)

    workers = [threading.Thread(target=worker, name=f"medflower-run-{k}") for k in range(parallel)]
    for thread in workers:
        thread.start()
    try:
        for thread in workers:
            while thread.is_alive():
                thread.join(timeout=1.0)
    except KeyboardInterrupt:
        stop.set()
        with lock:
            under_way = [child for child in children.values() if child.is_alive()]
        for child in under_way:
            child.terminate()
        for thread in workers:
            thread.join(timeout=60)
        raise
    if failures:
        raise RunsFailed(
            f"{len(failures)} of {len(configs)} runs failed: "
            + "; ".join(f"{configs[i]['run-name']} ({why})" for i, why in sorted(failures.items()))
        )


def _finite(values: list[Any]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = _finite(values)
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


EPSILON_COLUMNS = {"epsilon_client": "ε client-level", "epsilon_dp_sgd": "ε DP-SGD (largest site)"}


def privacy_epsilons(summary: dict[str, Any]) -> dict[str, float]:
    """The ε a run spent (docs/privacy.md#accounting), by table column; none for a run without dp or dp-sgd."""
    privacy = summary.get("privacy") or {}
    found = {}
    if level := privacy.get("client_level"):
        found["epsilon_client"] = level["epsilon"]
    if sgd := privacy.get("dp_sgd"):
        found["epsilon_dp_sgd"] = sgd["epsilon"]
    return found


def seed_problem(summary: dict[str, Any]) -> str | None:
    """Why one (run, seed) is not the experiment its file describes, or None when it is.

    The server goes on without a site whose reply failed or was rejected (docs/reliability.md), and a run's
    final metrics are each site's last evaluation: after such a failure, a site's training is missing from some
    round, its final value can come from an earlier round, or the site is missing from the mean altogether. Such
    a seed would mix a different experiment into the mean ± std, so ``compare`` leaves it out and names it.
    """
    communication = summary.get("communication") or {}
    failed, rejected = communication.get("failed_replies", 0), communication.get("rejected_replies", 0)
    if failed or rejected:
        return f"{failed} failed and {rejected} rejected site replies"
    rounds = {client: values.get("round") for client, values in (summary.get("per_client") or {}).items()}
    last = max((r for r in rounds.values() if isinstance(r, int)), default=None)
    stale = sorted(client for client, r in rounds.items() if isinstance(r, int) and r != last)
    if stale:
        return f"the last evaluation of {', '.join(stale)} is older than round {last}"
    return None


def compare(plan: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Mean ± std over seeds of each run's final metrics, plus communication per round; seeds with a failed or
    rejected site reply or a site's stale final evaluation (``seed_problem``) are left out and listed."""
    table: dict[str, Any] = {}
    per_client: dict[str, Any] = {}
    left_out: dict[str, dict[int, str]] = {}
    missing = [
        f"{run['name']} seed {seed}"
        for run in plan["runs"]
        for seed in plan["seeds"]
        if not (out_dir / run_name(run, seed) / run_folder.SUMMARY_JSON).is_file()
    ]
    if missing:
        raise RunsMissing(
            f"{len(missing)} run(s) have not finished in {out_dir} ({', '.join(missing)}): run them with --only and "
            "--seeds (--resume keeps the finished ones), or compare just the runs and seeds that finished with "
            "--only and --seeds"
        )
    for run in plan["runs"]:
        finals: dict[str, list[float]] = defaultdict(list)
        clients: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for seed in plan["seeds"]:
            folder = out_dir / run_name(run, seed)
            summary = json.loads((folder / run_folder.SUMMARY_JSON).read_text())
            if problem := seed_problem(summary):
                left_out.setdefault(run["name"], {})[seed] = problem
                continue
            for metric in plan["metrics"]:
                finals[metric].append(summary["final"].get(metric))
                for client, values in summary["per_client"].items():
                    if metric in values:  # pooled metrics have no per-site value
                        clients[metric][client].append(values[metric])
            if plan.get("targets"):
                for target, reached in rounds_to_targets(plan, run_records(plan, out_dir, run, seed)).items():
                    finals[f"rounds_to_{target}"].append(reached)
            for column, epsilon in privacy_epsilons(summary).items():
                finals[column].append(epsilon)
            rounds = max(summary["rounds"], 1)
            finals["bytes_per_round"].append(
                (summary["communication"]["bytes_up"] + summary["communication"]["bytes_down"]) / rounds
            )
        if not finals:  # every seed left out
            targets = [f"rounds_to_{t}" for t in plan["targets"]["values"]] if plan.get("targets") else []
            finals = {m: [] for m in [*plan["metrics"], *targets, "bytes_per_round"]}
        table[run["name"]] = {m: dict(zip(("mean", "std"), _mean_std(v)), values=v) for m, v in finals.items()}
        per_client[run["name"]] = {m: {c: _mean_std(v)[0] for c, v in sorted(by.items())} for m, by in clients.items()}
    result = {
        "name": plan["name"],
        "seeds": plan["seeds"],
        "num-supernodes": plan["num-supernodes"],
        "table": table,
        "per_client": per_client,
        "left_out": left_out,
    }
    mixing = {run["name"]: final_mixing(plan, out_dir, run) for run in plan["runs"]}
    if mixing := {name: w for name, w in mixing.items() if w is not None}:
        result["sgca_W"] = mixing
    if plan.get("reference") is not None:
        reference = per_client[plan["reference"]]
        result["delta_m"] = {
            name: {m: delta_m(by, reference.get(m, {})) for m, by in row.items()} for name, row in per_client.items()
        }
    (out_dir / "comparison.json").write_text(json.dumps(result, indent=1))
    markdown = comparison_markdown(plan, table) + left_out_markdown(left_out)
    for name, seeds in left_out.items():
        for seed, why in seeds.items():
            print(f"warning: {name} seed {seed} is left out of the comparison: {why}", file=sys.stderr)
    if plan.get("per-client"):
        markdown += per_client_markdown(plan, per_client, result.get("delta_m"))
    if mixing:
        markdown += mixing_markdown(mixing)
    if plot_per_site(plan, per_client, out_dir):
        markdown += (
            f"\nEach run's final metrics per site, mean over seeds {plan['seeds']}:\n\n![per site]({PER_SITE})\n"
        )
    (out_dir / "comparison.md").write_text(markdown)
    plot_overlay(plan, out_dir, left_out)
    return result


def plot_per_site(plan: dict[str, Any], per_client: dict[str, Any], out_dir: Path) -> bool:
    """per-site.png: the per-site table (comparison.json's ``per_client``) as one heat map per metric, runs as rows
    and sites as columns; False when no metric has per-site values (pooled metrics) or it cannot be drawn (said)."""
    from .figures import plot_per_site_table

    path = out_dir / PER_SITE
    try:
        written = plot_per_site_table(per_client, plan["metrics"], path, plan["name"])
    except Exception as err:  # the tables are written all the same
        print(f"warning: no {path} ({type(err).__name__}: {err})", file=sys.stderr)
        written = False
    if not written:
        path.unlink(missing_ok=True)  # not one of an earlier comparison
    return written


def final_mixing(plan: dict[str, Any], out_dir: Path, run: dict[str, Any]) -> dict[str, Any] | None:
    """The mixing matrix of the last round that logged one (``sgca_W``: SGCA's W of Eq. 7, or lat's fixed n_k
    weights; rows = receiving site), averaged over the seeds whose last W covers the same sites; None for a run
    that logs none. With it, where every one of those seeds logged them, the two things SGCA's W weighs: the
    scaled distances ``D`` (``sgca_D``) and the size shares ``m`` (``sgca_m``), averaged the same way."""
    lasts, clients = [], None
    for seed in plan["seeds"]:
        logged = [r for r in run_records(plan, out_dir, run, seed) if "sgca_W" in r and "sgca_clients" in r]
        if not logged:
            continue
        last = logged[-1]
        clients = clients or list(last["sgca_clients"])
        if list(last["sgca_clients"]) == clients:
            lasts.append(last)
    if not lasts:
        return None
    n = len(clients)
    result: dict[str, Any] = {"clients": clients, "seeds": len(lasts)}
    for key, name in (("sgca_W", "W"), ("sgca_D", "D")):
        if all(key in last for last in lasts):
            result[name] = [[statistics.fmean(float(r[key][i][j]) for r in lasts) for j in range(n)] for i in range(n)]
    if all("sgca_m" in last for last in lasts):
        result["m"] = [statistics.fmean(float(r["sgca_m"][j]) for r in lasts) for j in range(n)]
    return result


def mixing_markdown(mixing: dict[str, dict[str, Any]]) -> str:
    """Each run's last-round W as a table (row i is what site i receives from each site), and for SGCA the scaled
    distances D and size shares m it weighed."""
    out = []

    def matrix(title: str, corner: str, clients: list[str], rows: list[list[float]]) -> None:
        out.extend(["", title, "", f"| {corner} | " + " | ".join(clients) + " |", "|---|" + "---|" * len(clients)])
        out.extend(f"| {c} | " + " | ".join(f"{v:.3f}" for v in row) + " |" for c, row in zip(clients, rows))

    for name, entry in mixing.items():
        clients, seeds = entry["clients"], entry["seeds"]
        what = f"mean over {seeds} seed(s):"
        matrix(
            f"{name}: the last round's mixing weights W (row = receiving site), {what}",
            "receiving site",
            clients,
            entry["W"],
        )
        if "D" in entry:
            matrix(f"{name}: the scaled distances D that W weighed (row = site), {what}", "site", clients, entry["D"])
        if "m" in entry:
            out += ["", f"{name}: the size shares m: " + ", ".join(f"{c} {v:.3f}" for c, v in zip(clients, entry["m"]))]
    return "\n".join(out) + "\n"


def round_values(records: list[dict[str, Any]], metric: str) -> dict[int, float]:
    """Per round, the server record's value of ``metric`` (a pooled metric), else the mean over the sites' eval
    records (records without a kind count as eval records)."""
    by_round: dict[int, list[float]] = defaultdict(list)
    server = {
        int(r["round"]): float(r[metric])
        for r in records
        if r.get("kind") == "server" and isinstance(r.get(metric), (int, float))
    }
    if server:
        return dict(sorted(server.items()))
    for record in records:
        if record.get("kind", "eval") == "eval" and isinstance(record.get(metric), (int, float)):
            by_round[int(record["round"])].append(float(record[metric]))
    return {rnd: statistics.fmean(values) for rnd, values in sorted(by_round.items())}


def rounds_to_targets(plan: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, int | None]:
    """For each target value: the first round whose value of the target metric (the mean over sites, or the
    pooled value) reaches it (None: never)."""
    means = round_values(records, plan["targets"]["metric"]).items()
    return {
        str(target): next((rnd for rnd, mean in means if mean >= float(target)), None)
        for target in plan["targets"]["values"]
    }


def _rounds_cell(values: list[int | None]) -> str:
    """Mean rounds over the seeds that reached the target, and how many did when not all."""
    reached = [v for v in values if v is not None]
    if not values:  # every seed left out
        return "–"
    if not reached:
        return "not reached"
    text = f"{statistics.fmean(reached):.1f}"
    return text if len(reached) == len(values) else f"{text} ({len(reached)}/{len(values)} seeds)"


def comparison_markdown(plan: dict[str, Any], table: dict[str, Any]) -> str:
    metrics = list(plan["metrics"])
    seeds = plan["seeds"]
    targets = [str(t) for t in plan["targets"]["values"]] if plan.get("targets") else []
    target_heads = [f"rounds to {float(t):.0%}" for t in targets]
    epsilons = [c for c in EPSILON_COLUMNS if any(row.get(c) for row in table.values())]
    epsilon_heads = [EPSILON_COLUMNS[c] for c in epsilons]
    head = "| run | " + " | ".join(metrics + target_heads + epsilon_heads) + " | MB per round |"
    pooled = [m for m in metrics if m in POOLED]
    lines = [
        f"Mean ± std over seeds {seeds} of the final mean-over-clients test metrics"
        + (f" ({', '.join(pooled)}: all sites' test rows pooled)" if pooled else "")
        + f"; {plan['num-supernodes']} sites; {plan.get('threads', 1)} torch thread(s) per run.",
        "",
        head,
        "|---|" + "---|" * (len(metrics) + len(targets) + len(epsilons) + 1),
    ]
    if targets:
        target = plan["targets"]["metric"]
        lines[0] += (
            f" Rounds to x%: the first round whose {'' if target in POOLED else 'mean over sites of '}"
            f"{target} reaches x, averaged over the seeds that reach it."
        )
    for name, row in table.items():
        cells = []
        for metric in metrics:
            m, s = row[metric]["mean"], row[metric]["std"]
            n = len(_finite(row[metric]["values"]))
            if m is None:
                cells.append("–")
            elif n < len(seeds):  # seeds left out (or a metric undefined in some): say how many are in the mean
                cells.append(
                    f"{m:.3f} ({n}/{len(seeds)} seeds)" if n == 1 else f"{m:.3f} ± {s:.3f} ({n}/{len(seeds)} seeds)"
                )
            else:
                cells.append(f"{m:.3f} ± {s:.3f}")
        cells += [_rounds_cell(row[f"rounds_to_{t}"]["values"]) for t in targets]
        cells += [_epsilon_cell(row.get(c), any(row.get(e) for e in epsilons)) for c in epsilons]
        mb = row["bytes_per_round"]["mean"]
        cells.append("–" if mb is None else f"{mb / 1e6:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def left_out_markdown(left_out: dict[str, dict[int, str]]) -> str:
    """The seeds ``compare`` left out of every mean, each with its reason (empty when none was)."""
    if not left_out:
        return ""
    lines = ["", "Left out of every mean and table above (rerun them with --only and --seeds):", ""]
    lines += [f"- {name} seed {seed}: {why}" for name, seeds in left_out.items() for seed, why in seeds.items()]
    return "\n".join(lines) + "\n"


def _epsilon_cell(column: dict[str, Any] | None, private: bool) -> str:
    """ε is a function of the plan (noise, sampling rate, steps), so seeds agree on it: the mean only. A run with
    no DP at all reads ∞; one with the other kind of DP reads – (client-level ε also bounds each image's)."""
    if column and column["mean"] is not None:
        return f"{column['mean']:.3g}"
    return "–" if private else "∞ (no DP)"


def per_client_markdown(
    plan: dict[str, Any], per_client: dict[str, Any], deltas: dict[str, dict[str, float | None]] | None = None
) -> str:
    """One table per metric: runs as rows, sites as columns (mean over seeds), plus the mean over sites and,
    with a ``reference`` run, Δm against it."""
    out = []
    for metric in plan["metrics"]:
        clients = sorted({c for row in per_client.values() for c in row.get(metric, {})})
        if not clients:  # a pooled metric: no per-site value
            continue
        extra = [f"Δm vs {plan['reference']} (points)"] if deltas is not None else []
        out += [
            "",
            f"{metric} per site (mean over seeds {plan['seeds']}):",
            "",
            "| run | " + " | ".join(clients + ["mean"] + extra) + " |",
            "|---|" + "---|" * (len(clients) + 1 + len(extra)),
        ]
        for name, row in per_client.items():
            values = [row.get(metric, {}).get(c) for c in clients]
            cells = ["–" if v is None else f"{v:.3f}" for v in values + [_mean_std(values)[0]]]
            if deltas is not None:
                delta = deltas[name].get(metric)
                cells.append("–" if delta is None else f"{delta:+.2f}")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def run_records(plan: dict[str, Any], out_dir: Path, run: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """A run's eval records and server round records (where the pooled metrics are)."""
    return [
        r
        for r in read_records(out_dir / run_name(run, seed) / run_folder.METRICS)
        if r.get("kind") in ("eval", "server")
    ]


def plot_task_overlay(plan: dict[str, Any], out_dir: Path, left_out: dict[str, dict[int, str]]) -> None:
    """Continual runs: test AUC after every epoch, task after task, mean over sites and seeds (but those
    ``left_out``), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.8))
    starts: dict[int, int] = {}
    for run in plan["runs"]:
        curves: dict[int, list[list[float]]] = defaultdict(list)  # task -> curves of every site and seed
        for seed in plan["seeds"]:
            if seed in left_out.get(run["name"], {}):
                continue
            for r in run_records(plan, out_dir, run, seed):
                if isinstance(r.get("auc_curve"), list):
                    curves[int(r.get("task", r["round"]))].append(r["auc_curve"])
        starts, xs, ys = task_curve_layout(curves)
        ax.plot(xs, ys, lw=1.4, label=run["name"])
    for start in starts.values():
        ax.axvline(start - 0.5, ls=":", color="grey")
    ax.set_xlabel("epoch (0 = initialisation), task after task")
    ax.set_ylabel(f"test AUC, mean over sites and seeds {plan['seeds']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="lower right")
    ax.set_title(plan["name"])
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=110)
    plt.close(fig)


def plot_overlay(plan: dict[str, Any], out_dir: Path, left_out: dict[str, dict[int, str]] | None = None) -> None:
    """Mean-over-clients (or pooled) test metric per round, averaged over seeds (but those ``left_out``), one line
    per run (continual runs: the per-epoch AUC curves instead)."""
    left_out = left_out or {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = run_records(plan, out_dir, plan["runs"][0], plan["seeds"][0])
    if any("auc_curve" in r for r in first):
        plot_task_overlay(plan, out_dir, left_out)
        return
    # Summary-only columns (class-incremental `last`/`avg`) have no per-round values: plot the per-round
    # accuracy they are made of instead.
    metrics = [m for m in plan["metrics"] if any(m in r for r in first)]
    if len(metrics) < len(plan["metrics"]) and "accuracy" not in metrics and any("accuracy" in r for r in first):
        metrics.insert(0, "accuracy")
    metrics = metrics or list(plan["metrics"])
    colors = plt.cm.tab20.colors if len(plan["runs"]) > 10 else plt.cm.tab10.colors
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.3), squeeze=False)
    for i, run in enumerate(plan["runs"]):
        for ax, metric in zip(axes[0], metrics):
            per_round: dict[int, list[float]] = defaultdict(list)
            for seed in plan["seeds"]:
                if seed in left_out.get(run["name"], {}):
                    continue
                for rnd, value in round_values(run_records(plan, out_dir, run, seed), metric).items():
                    per_round[rnd].append(value)
            if per_round:
                xs = sorted(per_round)
                ax.plot(
                    xs,
                    [statistics.fmean(per_round[x]) for x in xs],
                    marker="o",
                    ms=3,
                    label=run["name"],
                    color=colors[i % len(colors)],
                )
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(metric)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    if len(plan["runs"]) > 6:
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    else:
        axes[0][0].legend(fontsize=8)
    fig.suptitle(plan["name"])
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medflower.experiments", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, help="experiments/<name>.yaml")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/experiments"))
    parser.add_argument(
        "--engine",
        choices=("flwr", "inprocess"),
        default="flwr",
        help="flwr: every run through `flwr run` (default); inprocess: quick checks",
    )
    parser.add_argument("--compare-only", action="store_true", help="only rebuild the table and curves")
    parser.add_argument("--only", default="", help="comma-separated run names: run and compare just these")
    parser.add_argument("--seeds", default="", help="comma-separated seeds of the file: run and compare just these")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="with --engine inprocess: N runs at a time, each in its own process, its log in <output>/logs/",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep each finished run of the same config, continue each stopped one from its checkpoint",
    )
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be 1 or more, got {args.parallel}")
    if args.parallel > 1 and args.engine != "inprocess":
        parser.error(
            "--parallel needs --engine inprocess: through flwr run, one simulation already trains its sites side by "
            "side (Ray's actors), and several simulations would each start their own Ray on the same cores"
        )
    try:
        plan = select_seeds(select_runs(load_plan(args.file), args.only), args.seeds)
    except ExperimentFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out_dir = args.output_dir / safe_name(plan["name"])
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.compare_only:
        try:
            execute(plan, out_dir, args.engine, args.parallel, args.resume)
        except RunsFailed as err:
            print(f"error: {err}; rerun them with --only and --seeds, then --compare-only", file=sys.stderr)
            return 1
    try:
        result = compare(plan, out_dir)
    except RunsMissing as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print((out_dir / "comparison.md").read_text())
    written = [out_dir / name for name in ("comparison.md", "comparison.json", "curves.png", PER_SITE)]
    print(f"written: {', '.join(str(path) for path in written if path.is_file())}")
    return 0 if result else 1


if __name__ == "__main__":
    sys.exit(main())
