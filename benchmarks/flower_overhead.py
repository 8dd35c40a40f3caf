"""Flower's overhead: the same FedAvg training through Flower's simulation engine and as a plain loop.

One invocation runs the same experiment (strategy ``fedavg``, the same run config and seeds) twice:

1. **flower**: ``LoopbackFederation(num_supernodes=N, simulation=True)`` starts a real
   ``flower-superlink --simulation``; ``run_app`` runs the app with ``flwr run <repo> --stream``.
   Per-round wall times are the ServerApp's own ``round_s`` (``<run dir>/metrics.jsonl``, records
   with ``"kind": "server"``): from the start of a round (node refresh, train phase, aggregation,
   evaluate phase) to its end, checkpoint excluded.
2. **plain**: the same work in this process, without Flower: per round, for every client, its data
   (``load_client_data``, loaded once per site like the ClientApp's cache), one model
   (``build_classifier``, built once like the ClientApp's cache), set the global arrays,
   ``train_epochs`` with the same loader seed, torch seed and optimizer; ``weighted_mean`` over the
   clients' arrays weighted by training size; then the evaluate phase: set the new global arrays and
   ``evaluate`` on every client's val and test split. Round 1 also pays the one-time data load and
   model build, as the ClientApp does in its first round. Before round 1 (not counted in any round),
   both build the server's initial model.

By default (``--order sandwich``) the plain loop runs once before and once after the Flower run, and
a round's plain time is the mean of the two: the measuring computer's speed drifts by 10 % and more between
minutes, and a single plain run before Flower mixes that drift into the comparison. The spread of the
two plain runs is reported as the resolution of the comparison. Round 1 and the start-up cost use the
first plain run only (the second reuses this process's data caches).

Figures (printed, and written as JSON to ``--out``):

- per round: flower ``round_s``, plain round time, their ratio;
- **steady-state overhead** = mean over rounds r >= 2 of (flower_r - plain_r) / plain_r, in %
  (also against each plain run alone);
- **start-up cost** = (wall time from starting the SuperLink to the end of Flower's round 1)
  - (wall time of the first plain run from its start to the end of its round 1, initial model build
  included). It is the sum of two measured parts, both reported:
  ``pre_round1_s`` (SuperLink start -> ServerApp's round 1 begins: SuperLink, ``flwr run``, FAB,
  ``flwr-simulation``, Ray start, ServerApp imports, initial model build, waiting for nodes) minus the
  plain setup, plus ``round1_excess_s`` = flower round 1 - plain round 1 (Ray actor start, imports
  in the actor, first messages);
- the rest of Flower's wall time: between rounds (checkpoint writes, the same in both but only
  timed in Flower), after the last round (summary, plot, ``flwr run`` noticing the end), teardown;
- diagnostics: CPU cores used per process group (Ray's ClientApp actor, ``flwr-simulation``,
  SuperLink, Ray daemons, the ``flwr run`` log stream, processes that are not this benchmark's) over
  the steady-state rounds of each run, which also shows that the ClientApp actor keeps both cores busy
  like the plain loop (Ray gives the actor num_cpus=2, so OMP_NUM_THREADS=2 and torch uses 2 threads;
  the plain loop's ``torch.get_num_threads()`` is reported); the actor's niceness (Ray workers run at
  nice 15); Flower's own ClientApp runtime total (``run.clientapp_runtime`` in the SuperLink
  database), hence the time of Flower's rounds spent outside ClientApps; and the final mean test
  metrics of both runs, which must agree (same work, same seeds).

``--trace-clientapp`` (diagnosis) runs a generated copy of the app whose ClientApp wraps medflower's
handler with per-message timing, and splits each Flower round into time inside ClientApp handlers
(per phase, wall and CPU) and time outside them (dispatch through the simulation engine, polling,
(de)serialisation, aggregation): the part of the overhead that is Flower's without any doubt.

The machine must be otherwise idle: other processes' CPU use during the rounds is measured and a
warning is printed above 0.1 cores (``--wait-idle S`` waits up to S seconds for quiet before each run).

Run from the repository root::

    python benchmarks/flower_overhead.py            # defaults: ~13 s per round on 2 CPU cores
    python benchmarks/flower_overhead.py --trace-clientapp   # + per-phase split of Flower's rounds
    python benchmarks/flower_overhead.py --rounds 3 --synthetic-size 1200   # quick look
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/flower_overhead.py` from a clone
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "benchmarks" / "results" / "flower_overhead.json"
TARGET_OVERHEAD_PCT = 10.0
TARGET_STARTUP_S = 30.0
TARGET_MIN_ROUND_S = 10.0


# ----------------------------------------------------------------------------- configuration
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5, help="federated rounds (steady state = rounds >= 2)")
    p.add_argument("--clients", type=int, default=4, help="simulated SuperNodes / plain-loop clients")
    p.add_argument("--synthetic-size", type=int, default=6000, help="samples in the synthetic pool")
    p.add_argument("--img-size", type=int, default=32, help="input resolution")
    p.add_argument("--patch-size", type=int, default=8, help="ViT patch size")
    p.add_argument("--backbone", default="vit-tiny", help="backbone alias")
    p.add_argument("--local-epochs", type=int, default=1, help="local epochs per round")
    p.add_argument("--batch-size", type=int, default=32, help="local batch size")
    p.add_argument("--lr", type=float, default=0.003, help="learning rate")
    p.add_argument("--partition", default="iid", help="partitioning of the pool")
    p.add_argument("--seed", type=int, default=0, help="run seed")
    p.add_argument("--device", default="cpu", help="training device (both runs)")
    p.add_argument(
        "--order",
        choices=("sandwich", "plain-first", "flower-first"),
        default="sandwich",
        help="sandwich: plain, Flower, plain again; the plain reference of a round is the mean of both "
        "plain runs, so a machine that slowly speeds up or slows down does not bias the comparison",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file with all figures")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the Flower run folder and logs here (default: a temporary folder, removed)",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=300.0,
        help="before each run, wait up to this many seconds until other processes use < 0.15 cores",
    )
    p.add_argument(
        "--trace-clientapp",
        action="store_true",
        help="diagnosis: run a copy of the app whose ClientApp times each message's handler, and split "
        "Flower's rounds into time inside ClientApp handlers (per phase) and outside them",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before `flwr run` is given up")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    """The run config both runs use (run-config keys: docs/run-config.md)."""
    return {
        "strategy": "fedavg",
        "num-rounds": args.rounds,
        "seed": args.seed,
        "min-nodes": args.clients,
        "dataset": "synthetic",
        "partition": args.partition,
        "synthetic-size": args.synthetic_size,
        "backbone": args.backbone,
        "backbone-weights": "none",
        "img-size": args.img_size,
        "patch-size": args.patch_size,
        "local-epochs": args.local_epochs,
        "batch-size": args.batch_size,
        "lr": args.lr,
        "device": args.device,
        "output-dir": str(output_dir.resolve()),
        "run-name": "flower",
        "overwrite": True,  # a second benchmark run with the same --workdir replaces the first
    }


# ----------------------------------------------------------------------------- CPU accounting
def _category(pid: int, cmdline: str, mine: bool) -> str:
    if pid == os.getpid():
        return "benchmark process"
    if not mine:
        return "other processes (not this benchmark)"
    if "ClientAppActor" in cmdline:
        return "ray ClientAppActor (ClientApp)"
    if "flwr-simulation" in cmdline:
        return "flwr-simulation (ServerApp + simulation engine)"
    if "flower-superlink" in cmdline:
        return "flower-superlink"
    if any(s in cmdline for s in ("raylet", "gcs_server", "ray/", "ray::", "dashboard", "log_monitor")):
        return "ray daemons"
    if "flwr run" in cmdline or cmdline.endswith("/flwr") or "/flwr run" in cmdline or "bin/flwr" in cmdline:
        return "flwr run (CLI, log stream)"
    return "other descendants of this benchmark"


class CpuSampler(threading.Thread):
    """Samples utime+stime of every process on the machine (read-only /proc) once per ``interval`` s."""

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.actor_info: dict[int, dict[str, Any]] = {}
        self._halt = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._cmdlines: dict[int, str] = {}

    def snapshot(self) -> dict[int, tuple[str, float]]:
        """pid -> (category, CPU seconds); processes not descending from this one are 'other'."""
        procs: dict[int, tuple[int, float]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2 :].split()
                procs[pid] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick)
                # re-read every time: Ray workers retitle themselves (ray::ClientAppActor) once assigned
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    self._cmdlines[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, ValueError, IndexError):
                continue
        me = os.getpid()
        out: dict[int, tuple[str, float]] = {}
        try:  # time the hypervisor gave to other guests (steal), machine-wide, as pseudo-pid -1
            with open("/proc/stat") as f:
                out[-1] = ("steal (hypervisor, machine-wide)", int(f.readline().split()[8]) / self._tick)
        except (OSError, ValueError, IndexError):
            pass
        for pid, (_ppid, cpu) in procs.items():
            ancestor, mine, hops = pid, False, 0
            while ancestor > 1 and hops < 64:
                if ancestor == me:
                    mine = True
                    break
                ancestor, hops = procs.get(ancestor, (0, 0.0))[0], hops + 1
            category = _category(pid, self._cmdlines.get(pid, ""), mine)
            if category.startswith("ray ClientAppActor") and pid not in self.actor_info:
                self.actor_info[pid] = self._thread_info(pid)
            out[pid] = (category, cpu)
            if mine and pid != me and not category.startswith("ray ClientAppActor"):
                # context switches of all threads of Flower's supporting processes: how often they wake up
                out[-2 - pid] = (f"wakeups: {category}", float(self._switches(pid)))
        return out

    @staticmethod
    def _switches(pid: int) -> int:
        total = 0
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{task}/status") as f:
                        for line in f:
                            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                                total += int(line.split()[1])
                except OSError:
                    continue
        except OSError:
            pass
        return total

    @staticmethod
    def _thread_info(pid: int) -> dict[str, Any]:
        """Niceness of a ClientApp actor (Ray starts its workers niced)."""
        info: dict[str, Any] = {"pid": pid}
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            info["nice"] = int(stat[stat.rindex(")") + 2 :].split()[16])
        except (OSError, ValueError, IndexError) as err:
            info["error"] = str(err)
        return info

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.time(), self.snapshot()))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.samples.append((time.time(), self.snapshot()))

    def usage(self, start: float, end: float) -> dict[str, Any]:
        """CPU seconds and mean cores per category between the samples nearest to ``start`` and ``end``."""
        if len(self.samples) < 2:
            return {}
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, s0), (t1, s1) = inside[0], inside[-1]
        if t1 <= t0:
            return {}
        per: dict[str, float] = {}
        wakeups: dict[str, float] = {}
        for pid, (category, value) in s1.items():
            if pid not in s0 and category.startswith("wakeups: "):  # started inside the window: CPU time only
                continue
            before = s0.get(pid, (category, 0.0))[1]
            target = wakeups if category.startswith("wakeups: ") else per
            key = category.removeprefix("wakeups: ")
            target[key] = target.get(key, 0.0) + max(value - before, 0.0)
        window = t1 - t0
        order = sorted(per.items(), key=lambda kv: -kv[1])
        return {
            "window_s": round(window, 2),
            "cpu_s": {k: round(v, 2) for k, v in order if v > 0.005},
            "cores": {k: round(v / window, 3) for k, v in order if v > 0.005},
            "context_switches_per_s": {
                k: round(v / window, 1) for k, v in sorted(wakeups.items(), key=lambda kv: -kv[1])
            },
        }


# ----------------------------------------------------------------------------- plain loop
def run_plain(config: dict[str, Any], num_clients: int) -> dict[str, Any]:
    """The strategy's rounds without Flower: identify/load, train all, aggregate, evaluate all."""
    import numpy as np
    import torch

    from medflower.config import ExperimentConfig, defaults
    from medflower.contract import derive_seed, weighted_mean
    from medflower.data import describe_source, load_client_data, make_loader
    from medflower.models import build_classifier
    from medflower.training import OptimizerSpec, evaluate, pick_device, train_epochs

    wall_start = time.time()
    t0 = time.monotonic()
    cfg = ExperimentConfig.from_run_config({**defaults(), **config})
    # server side, before round 1 (as run_experiment): classes and the initial trainable arrays
    num_classes = cfg.num_classes or describe_source(cfg.data_spec())[0]
    global_arrays = build_classifier(cfg.model_spec(), num_classes).get_trainable()
    device = pick_device(cfg.device)
    optimizer = OptimizerSpec(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)
    setup_s = time.monotonic() - t0

    data: dict[int, Any] = {}  # the ClientApp's _cached_data
    model = None  # the ClientApp's _cached_model (one object shared by the sites of a process)
    rounds = []
    last_eval: dict[int, dict[str, float]] = {}
    for rnd in range(1, cfg.num_rounds + 1):
        start = time.monotonic()
        wall_round_start = time.time()
        # identify phase (round 1: the strategy's "query"; each site loads its data to report its size)
        for pid in range(num_clients):
            if pid not in data:
                data[pid] = load_client_data(cfg.data_spec(), pid, num_clients)
        t_identify, c_identify = time.monotonic(), time.process_time()
        # train phase: every site trains the global arrays
        replies = []
        for pid in range(num_clients):
            if model is None:
                model = build_classifier(cfg.model_spec(), num_classes)
            model.set_trainable(global_arrays)
            torch.manual_seed(derive_seed(cfg.seed, rnd, pid, 2))
            loader = make_loader(data[pid].train, cfg.batch_size, True, derive_seed(cfg.seed, rnd, pid, 1))
            train_epochs(model, loader, epochs=cfg.local_epochs, optimizer=optimizer, device=device)
            replies.append((model.get_trainable(), float(len(data[pid].train))))
        t_train, c_train = time.monotonic(), time.process_time()
        global_arrays = weighted_mean([a for a, _ in replies], [n for _, n in replies])
        t_aggregate, c_aggregate = time.monotonic(), time.process_time()
        # evaluate phase: every site evaluates the new global arrays on its val and test split
        for pid in range(num_clients):
            model.set_trainable(global_arrays)
            metrics: dict[str, float] = {}
            for split in ("val", "test"):
                dataset = getattr(data[pid], split)
                if len(dataset) == 0:
                    continue
                m = evaluate(
                    model, make_loader(dataset, cfg.batch_size, False, derive_seed(cfg.seed, rnd, pid, 1)), device
                )
                metrics.update({(k if split == "test" else f"{split}_{k}"): v for k, v in m.items()})
            last_eval[pid] = metrics
        end = time.monotonic()
        rounds.append(
            {
                "round": rnd,
                "round_s": round(end - start, 3),
                "identify_s": round(t_identify - start, 3),
                "train_s": round(t_train - t_identify, 3),
                "aggregate_s": round(t_aggregate - t_train, 4),
                "evaluate_s": round(end - t_aggregate, 3),
                "train_cpu_s": round(c_train - c_identify, 3),
                "evaluate_cpu_s": round(time.process_time() - c_aggregate, 3),
                "wall_start": wall_round_start,
                "wall_end": time.time(),
            }
        )
        print(
            f"  plain round {rnd}: {end - start:.2f}s (train {t_train - t_identify:.2f}s, "
            f"evaluate {end - t_aggregate:.2f}s)",
            flush=True,
        )
    final = {m: float(np.mean([last_eval[p][m] for p in last_eval])) for m in ("auc", "accuracy", "loss")}
    return {
        "setup_s": round(setup_s, 3),
        "rounds": rounds,
        "total_s": round(time.monotonic() - t0, 3),
        "wall_start": wall_start,
        "final": final,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "train_sizes": {pid: len(d.train) for pid, d in data.items()},
    }


# ----------------------------------------------------------------------------- Flower run
TRACED_CLIENT = '''"""medflower's ClientApp, each message's handler timed
(benchmarks/flower_overhead.py --trace-clientapp)."""
import json, os, time

from flwr.clientapp import ClientApp
from medflower.site_app import handle

app = ClientApp()
LOG = {log!r}


def timed(message, context):
    start, cpu = time.time(), time.process_time()
    reply = handle(message, context)
    import torch
    with open(LOG, "a") as f:
        f.write(json.dumps({{"type": message.metadata.message_type, "round": message.metadata.group_id,
                            "partition": context.node_config.get("partition-id"), "start": start,
                            "end": time.time(), "cpu_s": time.process_time() - cpu, "pid": os.getpid(),
                            "torch_threads": torch.get_num_threads(), "nice": os.nice(0)}}) + "\\n")
    return reply


app.query()(timed)
app.train()(timed)
app.evaluate()(timed)
'''


def traced_app(directory: Path) -> tuple[Path, Path]:
    """A copy of the app whose ClientApp wraps medflower's handler with per-message timing."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "clientapp-trace.jsonl"
    pyproject = (REPO / "pyproject.toml").read_text()
    pyproject = pyproject.replace('clientapp = "medflower.client_app:app"', 'clientapp = "traced_client:app"')
    pyproject = pyproject.replace('name = "medflower"', 'name = "medflowertraced"').replace(
        'readme = "README.md"\n', ""
    )
    pyproject = pyproject.replace('[tool.hatch.build.targets.wheel]\npackages = ["medflower"]\n', "")
    if 'clientapp = "traced_client:app"' not in pyproject:
        raise RuntimeError('pyproject.toml has no clientapp = "medflower.client_app:app" to replace')
    (directory / "pyproject.toml").write_text(pyproject)
    (directory / "traced_client.py").write_text(TRACED_CLIENT.format(log=str(log)))
    return directory, log


def clientapp_phases(log: Path, rounds: list[dict[str, Any]]) -> None:
    """Add per-phase ClientApp handler time (sum over messages) and the rest of each round to ``rounds``."""
    messages = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    for r in rounds:
        inside = 0.0
        for phase in ("query", "train", "evaluate"):
            ms = [m for m in messages if m["round"] == str(r["round"]) and m["type"] == phase]
            if ms:
                r[f"{phase}_clientapp_s"] = round(sum(m["end"] - m["start"] for m in ms), 3)
                r[f"{phase}_clientapp_cpu_s"] = round(sum(m["cpu_s"] for m in ms), 3)
                inside += r[f"{phase}_clientapp_s"]
        r["in_clientapp_s"] = round(inside, 3)
        r["outside_clientapp_s"] = round(r["round_s"] - inside, 3)
    if messages:
        rounds[0]["clientapp_torch_threads"] = sorted({m["torch_threads"] for m in messages})
        rounds[0]["clientapp_nice"] = sorted({m["nice"] for m in messages})


def run_flower(
    config: dict[str, Any], num_clients: int, workdir: Path, timeout: float, trace: bool = False
) -> dict[str, Any]:
    """The app through `flower-superlink --simulation` + `flwr run --stream`; times from metrics.jsonl."""
    from medflower.loopback import APP_DIR, LoopbackFederation
    from medflower.results import read_records

    fed_dir = workdir / "federation"
    fed_dir.mkdir(parents=True, exist_ok=True)
    app_dir, trace_log = traced_app(workdir / "traced-app") if trace else (APP_DIR, None)
    fed = LoopbackFederation(num_supernodes=num_clients, simulation=True, workdir=fed_dir)
    wall_start = time.time()
    t0 = time.monotonic()
    with fed:
        superlink_up_s = time.monotonic() - t0
        proc = fed.run_app(config, timeout=timeout, app_dir=app_dir)
        wall_run_end = time.time()
        run_app_s = time.monotonic() - t0
        superlink_db = fed.workdir / "superlink.db"
        logs = fed.logs(tail=400)
    total_s = time.monotonic() - t0
    run_dir = Path(config["output-dir"]) / config["run-name"]
    server = sorted(
        (r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "server"), key=lambda r: r["round"]
    )
    if len(server) != config["num-rounds"]:
        raise RuntimeError(
            f"expected {config['num-rounds']} server records in {run_dir}, found {len(server)}:\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{logs}"
        )
    rounds = [
        {
            "round": r["round"],
            "round_s": float(r["round_s"]),
            "aggregation_s": r.get("aggregation_s"),
            "wall_start": float(r["time"]) - float(r["round_s"]),
            "wall_end": float(r["time"]),
        }
        for r in server
    ]
    if trace_log is not None:
        clientapp_phases(trace_log, rounds)
    summary = json.loads((run_dir / "summary.json").read_text())
    clientapp_runtime = None
    try:  # Flower's own total of ClientApp execution time (pushed by flwr-simulation at the end)
        with sqlite3.connect(f"file:{superlink_db}?mode=ro", uri=True) as db:
            row = db.execute("SELECT clientapp_runtime FROM run").fetchone()
            clientapp_runtime = float(row[0]) if row and row[0] is not None else None
    except sqlite3.Error:
        pass
    return {
        "rounds": rounds,
        "wall_start": wall_start,
        "superlink_up_s": round(superlink_up_s, 3),
        "run_app_s": round(run_app_s, 3),
        "wall_run_end": wall_run_end,
        "total_s": round(total_s, 3),
        "final": {m: summary["final"].get(m) for m in ("auc", "accuracy", "loss")},
        "summary_wall_time_s": summary.get("wall_time_s"),
        "clientapp_runtime_s": clientapp_runtime,
        "stdout_tail": proc.stdout[-3000:],
    }


# ----------------------------------------------------------------------------- figures
def plain_reference(plains: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round, the mean of the plain runs (one, or two around the Flower run with --order sandwich)."""
    rounds = []
    for rs in zip(*(p["rounds"] for p in plains)):
        if rs[0]["round"] == 1:  # only the first plain run is cold (later ones reuse this process's data caches)
            rs = rs[:1]
        mean = {
            k: round(statistics.mean(r[k] for r in rs), 3)
            for k in ("round_s", "train_s", "evaluate_s", "identify_s", "train_cpu_s", "evaluate_cpu_s")
        }
        rounds.append(
            {
                "round": rs[0]["round"],
                **mean,
                "runs_s": [r["round_s"] for r in rs],
                "spread_pct": round(
                    100 * (max(r["round_s"] for r in rs) - min(r["round_s"] for r in rs)) / mean["round_s"], 2
                ),
            }
        )
    return rounds


def figures(plains: list[dict[str, Any]], flower: dict[str, Any]) -> dict[str, Any]:
    pr, fr = plain_reference(plains), flower["rounds"]
    per_round = []
    for p, f in zip(pr, fr):
        per_round.append(
            {
                "round": p["round"],
                "flower_s": f["round_s"],
                "plain_s": p["round_s"],
                "plain_runs_s": p["runs_s"],
                "plain_spread_pct": p["spread_pct"],
                "ratio": round(f["round_s"] / p["round_s"], 4),
                "overhead_pct": round(100 * (f["round_s"] - p["round_s"]) / p["round_s"], 2),
                "plain_train_s": p["train_s"],
                "plain_evaluate_s": p["evaluate_s"],
                "plain_identify_s": p["identify_s"],
                "plain_train_cpu_s": p["train_cpu_s"],
                **{
                    f"flower_{k}": f[k]
                    for k in (
                        "train_clientapp_s",
                        "evaluate_clientapp_s",
                        "query_clientapp_s",
                        "in_clientapp_s",
                        "outside_clientapp_s",
                        "train_clientapp_cpu_s",
                    )
                    if k in f
                },
            }
        )
    steady = [r for r in per_round if r["round"] >= 2]

    def mean(values: list[float]) -> float | None:
        return round(statistics.mean(values), 2) if values else None

    per_plain_run = [
        mean([100 * (f["round_s"] - p["round_s"]) / p["round_s"] for p, f in zip(run["rounds"], fr) if p["round"] >= 2])
        for run in plains
    ]
    pre_round1 = fr[0]["wall_start"] - flower["wall_start"]
    plain_to_end_r1 = plains[0]["rounds"][0]["wall_end"] - plains[0]["wall_start"]  # the cold plain run
    plain_setup = plains[0]["setup_s"]
    flower_to_end_r1 = fr[0]["wall_end"] - flower["wall_start"]
    between = sum(b["wall_start"] - a["wall_end"] for a, b in itertools.pairwise(fr))
    outside = [r["flower_outside_clientapp_s"] for r in steady if "flower_outside_clientapp_s" in r]
    return {
        "per_round": per_round,
        "steady_state_overhead_pct": mean([r["overhead_pct"] for r in steady]),
        "steady_state_overhead_pct_median": round(statistics.median(r["overhead_pct"] for r in steady), 2)
        if steady
        else None,
        "steady_state_overhead_pct_range": [
            min(r["overhead_pct"] for r in steady),
            max(r["overhead_pct"] for r in steady),
        ]
        if steady
        else None,
        "steady_state_overhead_pct_vs_each_plain_run": per_plain_run,
        "steady_state_plain_round_s": mean([r["plain_s"] for r in steady]),
        "steady_state_plain_spread_pct": mean([r["plain_spread_pct"] for r in steady]) if len(plains) > 1 else None,
        "steady_state_outside_clientapp_s": mean(outside) if outside else None,
        "startup": {
            "definition": "(SuperLink start -> end of Flower round 1) - (plain start -> end of plain round 1)",
            "startup_cost_s": round(flower_to_end_r1 - plain_to_end_r1, 2),
            "flower_to_end_of_round1_s": round(flower_to_end_r1, 2),
            "plain_to_end_of_round1_s": round(plain_to_end_r1, 2),
            "flower_pre_round1_s": round(pre_round1, 2),
            "plain_setup_s": round(plain_setup, 3),
            "round1_excess_s": round(fr[0]["round_s"] - pr[0]["round_s"], 2),
            "superlink_listening_s": flower["superlink_up_s"],
        },
        "flower_wall": {
            "total_s": flower["total_s"],
            "sum_of_rounds_s": round(sum(r["round_s"] for r in fr), 2),
            "pre_round1_s": round(pre_round1, 2),
            "between_rounds_s": round(between, 2),
            "after_last_round_s": round(flower["wall_run_end"] - fr[-1]["wall_end"], 2),
            "teardown_s": round(flower["total_s"] - flower["run_app_s"], 2),
        },
        "flower_clientapp": {
            "definition": "Flower's ClientApp runtime total (simulation engine, all rounds) vs the rounds' wall time",
            "clientapp_runtime_s": flower["clientapp_runtime_s"],
            "rounds_outside_clientapp_s": None
            if flower["clientapp_runtime_s"] is None
            else round(sum(r["round_s"] for r in fr) - flower["clientapp_runtime_s"], 2),
        },
        "plain_wall": {
            "total_s": plains[0]["total_s"],
            "sum_of_rounds_s": round(sum(r["round_s"] for r in pr), 2),
            "setup_s": round(plain_setup, 3),
        },
    }


def print_report(result: dict[str, Any]) -> None:
    fig = result["figures"]
    print("\nFlower simulation vs plain loop (fedavg, same run config and seeds)")
    print(f"  {result['command']}")
    actor = result["cpu"].get("flower_steady", {}).get("cores", {}).get("ray ClientAppActor (ClientApp)", "n/a")
    plain_cores = result["cpu"].get("plain_steady", {}).get("cores", {}).get("benchmark process", "n/a")
    print(
        f"  {result['machine']['cpu_count']} CPU cores; "
        f"plain loop: torch threads {result['plain'][0]['torch_threads']}, "
        f"{plain_cores} cores busy; ClientApp actor (Ray, num_cpus=2): nice {result['flower_actor_nice']}, "
        f"{actor} cores busy (steady-state rounds)"
    )
    runs = len(result["plain"])
    if runs > 1:
        print("\nplain round_s: mean of the plain runs before and after the Flower run (round 1: the first, cold one)")
    print(f"\n| round | Flower round_s | plain round_s | ratio | overhead |{' plain runs |' if runs > 1 else ''}")
    print("|---:|---:|---:|---:|---:|" + ("---|" if runs > 1 else ""))
    for r in fig["per_round"]:
        extra = f" {' / '.join(f'{v:.2f}' for v in r['plain_runs_s'])} |" if runs > 1 else ""
        print(
            f"| {r['round']} | {r['flower_s']:.2f} | {r['plain_s']:.2f} | {r['ratio']:.3f} | "
            f"{r['overhead_pct']:+.1f}% |{extra}"
        )
    if any("flower_in_clientapp_s" in r for r in fig["per_round"]):
        print("\nper phase (--trace-clientapp): Flower = time inside the ClientApp handlers, summed over clients")
        print(
            "| round | Flower train (CPU s) | plain train (CPU s) | Flower evaluate | plain evaluate "
            "| Flower outside ClientApps |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for r in fig["per_round"]:
            print(
                f"| {r['round']} | {r.get('flower_train_clientapp_s', 0):.2f} "
                f"({r.get('flower_train_clientapp_cpu_s', 0):.1f}) "
                f"| {r['plain_train_s']:.2f} ({r['plain_train_cpu_s']:.1f}) | "
                f"{r.get('flower_evaluate_clientapp_s', 0):.2f} | {r['plain_evaluate_s']:.2f} | "
                f"{r['flower_outside_clientapp_s']:.2f} |"
            )
        first = result["flower"]["rounds"][0]
        print(f"ClientApp: torch threads {first.get('clientapp_torch_threads')}, nice {first.get('clientapp_nice')}")
    ss = fig["steady_state_overhead_pct"]
    st = fig["startup"]
    print(
        f"\nsteady-state overhead (mean over rounds >= 2 of (flower - plain)/plain): {ss:+.2f}% "
        f"(target < {TARGET_OVERHEAD_PCT:.0f}% at rounds >= {TARGET_MIN_ROUND_S:.0f}s; "
        f"plain steady round {fig['steady_state_plain_round_s']:.1f}s)"
    )
    print(f"  median over rounds >= 2: {fig['steady_state_overhead_pct_median']:+.2f}%")
    if runs > 1:
        print(
            "  vs each plain run alone: "
            f"{', '.join(f'{v:+.2f}%' for v in fig['steady_state_overhead_pct_vs_each_plain_run'])}; "
            f"the two plain runs differ by {fig['steady_state_plain_spread_pct']:.1f}% per round on average "
            f"(machine drift/noise: differences below that are not resolved)"
        )
    if fig["steady_state_outside_clientapp_s"] is not None:
        print(
            f"  time of a steady-state Flower round outside ClientApp handlers: "
            f"{fig['steady_state_outside_clientapp_s']:.2f}s "
            f"({100 * fig['steady_state_outside_clientapp_s'] / fig['steady_state_plain_round_s']:.1f}% "
            "of a plain round)"
        )
    print(
        f"start-up cost = (SuperLink start -> end of Flower round 1) - (plain start -> end of plain round 1) "
        f"= {st['flower_to_end_of_round1_s']:.1f}s - {st['plain_to_end_of_round1_s']:.1f}s = "
        f"{st['startup_cost_s']:.1f}s (target < {TARGET_STARTUP_S:.0f}s)"
    )
    print(
        f"  of which: before round 1 {st['flower_pre_round1_s']:.1f}s (plain setup {st['plain_setup_s']:.1f}s), "
        f"round-1 excess {st['round1_excess_s']:+.1f}s"
    )
    fw = fig["flower_wall"]
    print(
        f"Flower wall {fw['total_s']:.1f}s = before round 1 {fw['pre_round1_s']:.1f}s + rounds "
        f"{fw['sum_of_rounds_s']:.1f}s + between rounds {fw['between_rounds_s']:.1f}s + after last round "
        f"{fw['after_last_round_s']:.1f}s + teardown {fw['teardown_s']:.1f}s; plain wall "
        f"{fig['plain_wall']['total_s']:.1f}s"
    )
    print(
        f"final mean test metrics: flower {result['flower']['final']}, "
        f"plain {' / '.join(str(run['final']) for run in result['plain'])}"
    )
    ca = fig["flower_clientapp"]
    if ca["clientapp_runtime_s"] is not None:
        print(
            f"Flower's ClientApp runtime total {ca['clientapp_runtime_s']:.1f}s; Flower rounds "
            f"{fw['sum_of_rounds_s']:.1f}s, so {ca['rounds_outside_clientapp_s']:.1f}s of the rounds ran outside "
            f"ClientApps (dispatch, polling, (de)serialisation, aggregation); plain rounds total "
            f"{fig['plain_wall']['sum_of_rounds_s']:.1f}s"
        )
    for name in ("flower_steady", "plain_steady", "plain_after_steady"):
        usage = result["cpu"].get(name) or {}
        if usage:
            cores = ", ".join(f"{k} {v:.2f}" for k, v in usage["cores"].items())
            print(f"CPU cores in use, {name.replace('_', ' ')} rounds ({usage['window_s']:.0f}s): {cores}")
            if usage.get("context_switches_per_s"):
                wake = ", ".join(f"{k} {v:.0f}" for k, v in usage["context_switches_per_s"].items())
                print(f"  context switches per second of Flower's supporting processes (all threads): {wake}")
    for warning in result["warnings"]:
        print(f"WARNING: {warning}")


def other_cores(seconds: float = 5.0) -> float:
    """Mean cores used by processes that are not this benchmark's, over ``seconds``."""
    sampler = CpuSampler()
    start, s0 = time.time(), sampler.snapshot()
    time.sleep(seconds)
    end, s1 = time.time(), sampler.snapshot()
    other = "other processes (not this benchmark)"
    used = sum(max(cpu - s0.get(pid, (c, 0.0))[1], 0.0) for pid, (c, cpu) in s1.items() if c == other)
    return used / (end - start)


def wait_idle(limit_s: float, threshold: float = 0.15) -> None:
    """Wait (at most ``limit_s``) until other processes use less than ``threshold`` cores."""
    deadline = time.monotonic() + limit_s
    while True:
        busy = other_cores()
        if busy < threshold:
            return
        if time.monotonic() > deadline:
            print(f"  machine still busy ({busy:.2f} cores used by other processes); going on anyway", flush=True)
            return
        print(f"  waiting for an idle machine: other processes use {busy:.2f} cores", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(
        [os.path.relpath(__file__, Path.cwd())] + (argv if argv is not None else sys.argv[1:])
    )
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="medflower-overhead-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    try:
        config = run_config(args, workdir / "outputs")
        print(f"run config: {json.dumps(config)}", flush=True)
        sampler = CpuSampler()
        sampler.start()
        results: dict[str, Any] = {"plain": []}
        order = {
            "sandwich": ("plain", "flower", "plain"),
            "plain-first": ("plain", "flower"),
            "flower-first": ("flower", "plain"),
        }[args.order]
        for which in order:
            if args.wait_idle > 0:
                wait_idle(args.wait_idle)
            print(f"{which} run ...", flush=True)
            started = time.monotonic()
            if which == "plain":
                results["plain"].append(run_plain(config, args.clients))
            else:
                results["flower"] = run_flower(config, args.clients, workdir, args.timeout, args.trace_clientapp)
                for r in results["flower"]["rounds"]:
                    print(f"  flower round {r['round']}: {r['round_s']:.2f}s", flush=True)
            print(f"{which} run done in {time.monotonic() - started:.1f}s", flush=True)
        sampler.stop()
        plains, flower = results["plain"], results["flower"]
        fr = flower["rounds"]
        cpu = {"flower_steady": sampler.usage(fr[1]["wall_start"], fr[-1]["wall_end"]) if len(fr) > 1 else {}}
        for name, run in zip(("plain_steady", "plain_after_steady"), plains):
            pr = run["rounds"]
            cpu[name] = sampler.usage(pr[1]["wall_start"], pr[-1]["wall_end"]) if len(pr) > 1 else {}
        actor_nice = sorted({str(i.get("nice", "?")) for i in sampler.actor_info.values()})
        import torch

        result = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command,
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "flwr": __import__("flwr").__version__,
                "ray": __import__("ray").__version__,
            },
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "run_config": {k: v for k, v in config.items() if k != "output-dir"},
            "targets": {
                "steady_state_overhead_pct": TARGET_OVERHEAD_PCT,
                "startup_s": TARGET_STARTUP_S,
                "min_round_s": TARGET_MIN_ROUND_S,
            },
            "figures": figures(plains, flower),
            "plain": plains,
            "flower": {k: v for k, v in flower.items() if k != "stdout_tail"},
            "flower_actor_nice": ",".join(actor_nice) or "not seen",
            "flower_actors": list(sampler.actor_info.values()),
            "cpu": cpu,
            "warnings": [],
        }
        other = "other processes (not this benchmark)"
        for name, usage in cpu.items():
            busy = (usage or {}).get("cores", {}).get(other, 0.0)
            steal = (usage or {}).get("cores", {}).get("steal (hypervisor, machine-wide)", 0.0)
            if steal > 0.05:
                result["warnings"].append(
                    f"{steal:.2f} cores stolen by the hypervisor during the "
                    f"{name.replace('_', ' ')} rounds; the comparison is unreliable"
                )
            if busy > 0.1:
                result["warnings"].append(
                    f"machine not idle: other processes used {busy:.2f} cores during the "
                    f"{name.replace('_', ' ')} rounds; the comparison is unreliable"
                )
        spread = result["figures"]["steady_state_plain_spread_pct"]
        if spread is not None and spread > TARGET_OVERHEAD_PCT / 2:
            result["warnings"].append(
                f"the two plain runs differ by {spread:.1f}% per steady-state round on average: the computer's speed "
                f"drifts by more than half the {TARGET_OVERHEAD_PCT:.0f}% target, so the end-to-end overhead is not "
                f"resolved to that precision (see the time outside ClientApps with --trace-clientapp)"
            )
        print_report(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"\nfigures written to {args.out}")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
