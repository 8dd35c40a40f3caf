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

Figures (printed, and written as JSON to ``--out``):

- per round: flower ``round_s``, plain round time, their ratio;
- **steady-state overhead** = mean over rounds r >= 2 of (flower_r - plain_r) / plain_r, in %;
- **start-up cost** = (wall time from starting the SuperLink to the end of Flower's round 1)
  - (wall time of the plain run from its start to the end of its round 1, initial model build
  included). It is the sum of two measured parts, both reported:
  ``pre_round1_s`` (SuperLink start -> ServerApp's round 1 begins: SuperLink, ``flwr run``, FAB,
  ``flwr-simulation``, Ray start, ServerApp imports, initial model build, waiting for nodes) minus the
  plain setup, plus ``round1_excess_s`` = flower round 1 - plain round 1 (Ray actor start, imports
  in the actor, first messages);
- the rest of Flower's wall time: between rounds (checkpoint writes, the same in both but only
  timed in Flower), after the last round (summary, plot, ``flwr run`` noticing the end), teardown;
- diagnostics: CPU time per process group (Ray's ClientApp actor, ``flwr-simulation``, SuperLink,
  Ray daemons, the ``flwr run`` log stream, anything else on the machine) over the steady-state
  rounds, the torch/OMP thread count of the ClientApp actor and of the plain loop, Flower's own
  ClientApp runtime total (SuperLink database), and the final mean test metrics of both runs (they
  should agree: same work).

Run from the repository root::

    python benchmarks/flower_overhead.py            # defaults: ~10-15 s per round on 2 CPU cores
    python benchmarks/flower_overhead.py --rounds 3 --synthetic-size 1200   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="federated rounds (steady state = rounds >= 2)")
    p.add_argument("--clients", type=int, default=4, help="simulated SuperNodes / plain-loop clients")
    p.add_argument("--synthetic-size", type=int, default=4800, help="samples in the synthetic pool")
    p.add_argument("--img-size", type=int, default=32, help="input resolution")
    p.add_argument("--patch-size", type=int, default=8, help="ViT patch size")
    p.add_argument("--backbone", default="vit-tiny", help="backbone alias")
    p.add_argument("--local-epochs", type=int, default=1, help="local epochs per round")
    p.add_argument("--batch-size", type=int, default=32, help="local batch size")
    p.add_argument("--lr", type=float, default=0.003, help="learning rate")
    p.add_argument("--partition", default="iid", help="partitioning of the pool")
    p.add_argument("--seed", type=int, default=0, help="run seed")
    p.add_argument("--device", default="cpu", help="training device (both runs)")
    p.add_argument("--order", choices=("plain-first", "flower-first"), default="plain-first",
                   help="which run goes first")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file with all figures")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the Flower run folder and logs here (default: a temporary folder, removed)")
    p.add_argument("--wait-idle", type=float, default=0.0,
                   help="before each run, wait up to this many seconds until other processes use < 0.15 cores")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before `flwr run` is given up")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    """The run config both runs use (run-config keys of the README's table)."""
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
                fields = stat[stat.rindex(")") + 2:].split()
                procs[pid] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick)
                # re-read every time: Ray workers retitle themselves (ray::ClientAppActor) once assigned
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    self._cmdlines[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, ValueError, IndexError):
                continue
        me = os.getpid()
        out = {}
        for pid, (ppid, cpu) in procs.items():
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
        return out

    @staticmethod
    def _thread_info(pid: int) -> dict[str, Any]:
        info: dict[str, Any] = {"pid": pid}
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            info["nice"] = int(stat[stat.rindex(")") + 2:].split()[16])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            for item in env:
                for key in (b"OMP_NUM_THREADS", b"MKL_NUM_THREADS"):
                    if item.startswith(key + b"="):
                        info[key.decode()] = item.split(b"=", 1)[1].decode()
        except OSError as err:
            info["environ_error"] = str(err)
        return info

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.time(), self.snapshot()))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.samples.append((time.time(), self.snapshot()))
        for pid, info in self.actor_info.items():  # threads while alive (Ray keeps the actor to the end)
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("Threads:"):
                        info["os_threads"] = int(line.split()[1])
            except OSError:
                pass

    def usage(self, start: float, end: float) -> dict[str, Any]:
        """CPU seconds and mean cores per category between the samples nearest to ``start`` and ``end``."""
        if len(self.samples) < 2:
            return {}
        t0, s0 = min(self.samples, key=lambda s: abs(s[0] - start))
        t1, s1 = min(self.samples, key=lambda s: abs(s[0] - end))
        if t1 <= t0:
            return {}
        per: dict[str, float] = {}
        for pid, (category, cpu) in s1.items():
            before = s0.get(pid, (category, 0.0))[1]
            per[category] = per.get(category, 0.0) + max(cpu - before, 0.0)
        window = t1 - t0
        return {"window_s": round(window, 2),
                "cpu_s": {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.005},
                "cores": {k: round(v / window, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.005}}


# ----------------------------------------------------------------------------- plain loop
def run_plain(config: dict[str, Any], num_clients: int, sampler: CpuSampler) -> dict[str, Any]:
    """The strategy's rounds without Flower: identify/load, train all, aggregate, evaluate all."""
    import numpy as np
    import torch

    from medflower.config import ExperimentConfig, defaults
    from medflower.data import describe_source, load_client_data, make_loader
    from medflower.models import build_classifier
    from medflower.strategies.base import derive_seed, weighted_mean
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

    data: dict[int, Any] = {}   # the ClientApp's _cached_data
    model = None                # the ClientApp's _cached_model (one object shared by the sites of a process)
    rounds = []
    last_eval: dict[int, dict[str, float]] = {}
    for rnd in range(1, cfg.num_rounds + 1):
        start = time.monotonic()
        wall_round_start = time.time()
        # identify phase (round 1: the strategy's "query"; each site loads its data to report its size)
        for pid in range(num_clients):
            if pid not in data:
                data[pid] = load_client_data(cfg.data_spec(), pid, num_clients)
        t_identify = time.monotonic()
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
        t_train = time.monotonic()
        global_arrays = weighted_mean([a for a, _ in replies], [n for _, n in replies])
        t_aggregate = time.monotonic()
        # evaluate phase: every site evaluates the new global arrays on its val and test split
        for pid in range(num_clients):
            model.set_trainable(global_arrays)
            metrics: dict[str, float] = {}
            for split in ("val", "test"):
                dataset = getattr(data[pid], split)
                if len(dataset) == 0:
                    continue
                m = evaluate(model, make_loader(dataset, cfg.batch_size, False, derive_seed(cfg.seed, rnd, pid, 1)),
                             device)
                metrics.update({(k if split == "test" else f"{split}_{k}"): v for k, v in m.items()})
            last_eval[pid] = metrics
        end = time.monotonic()
        rounds.append({"round": rnd, "round_s": round(end - start, 3),
                       "identify_s": round(t_identify - start, 3), "train_s": round(t_train - t_identify, 3),
                       "aggregate_s": round(t_aggregate - t_train, 4), "evaluate_s": round(end - t_aggregate, 3),
                       "wall_start": wall_round_start, "wall_end": time.time()})
        print(f"  plain round {rnd}: {end - start:.2f}s (train {t_train - t_identify:.2f}s, "
              f"evaluate {end - t_aggregate:.2f}s)", flush=True)
    final = {m: float(np.mean([last_eval[p][m] for p in last_eval])) for m in ("auc", "accuracy", "loss")}
    return {"setup_s": round(setup_s, 3), "rounds": rounds, "total_s": round(time.monotonic() - t0, 3),
            "wall_start": wall_start, "final": final, "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "train_sizes": {pid: len(d.train) for pid, d in data.items()}}


# ----------------------------------------------------------------------------- Flower run
def run_flower(config: dict[str, Any], num_clients: int, workdir: Path, timeout: float) -> dict[str, Any]:
    """The app through `flower-superlink --simulation` + `flwr run --stream`; times from metrics.jsonl."""
    from medflower.loopback import LoopbackFederation
    from medflower.results import read_records

    fed_dir = workdir / "federation"
    fed_dir.mkdir(parents=True, exist_ok=True)
    fed = LoopbackFederation(num_supernodes=num_clients, simulation=True, workdir=fed_dir)
    wall_start = time.time()
    t0 = time.monotonic()
    with fed:
        superlink_up_s = time.monotonic() - t0
        proc = fed.run_app(config, timeout=timeout)
        wall_run_end = time.time()
        run_app_s = time.monotonic() - t0
        superlink_db = fed.workdir / "superlink.db"
        logs = fed.logs(tail=400)
    total_s = time.monotonic() - t0
    run_dir = Path(config["output-dir"]) / config["run-name"]
    server = sorted((r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "server"),
                    key=lambda r: r["round"])
    if len(server) != config["num-rounds"]:
        raise RuntimeError(f"expected {config['num-rounds']} server records in {run_dir}, found {len(server)}:\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{logs}")
    rounds = [{"round": r["round"], "round_s": float(r["round_s"]), "aggregation_s": r.get("aggregation_s"),
               "wall_start": float(r["time"]) - float(r["round_s"]), "wall_end": float(r["time"])} for r in server]
    summary = json.loads((run_dir / "summary.json").read_text())
    clientapp_runtime = None
    try:  # Flower's own total of ClientApp execution time (pushed by flwr-simulation at the end)
        with sqlite3.connect(f"file:{superlink_db}?mode=ro", uri=True) as db:
            row = db.execute("SELECT clientapp_runtime FROM run").fetchone()
            clientapp_runtime = float(row[0]) if row and row[0] is not None else None
    except sqlite3.Error:
        pass
    return {"rounds": rounds, "wall_start": wall_start, "superlink_up_s": round(superlink_up_s, 3),
            "run_app_s": round(run_app_s, 3), "wall_run_end": wall_run_end, "total_s": round(total_s, 3),
            "final": {m: summary["final"].get(m) for m in ("auc", "accuracy", "loss")},
            "summary_wall_time_s": summary.get("wall_time_s"), "clientapp_runtime_s": clientapp_runtime,
            "stdout_tail": proc.stdout[-3000:]}


# ----------------------------------------------------------------------------- figures
def figures(plain: dict[str, Any], flower: dict[str, Any]) -> dict[str, Any]:
    per_round = []
    for p, f in zip(plain["rounds"], flower["rounds"]):
        per_round.append({"round": p["round"], "flower_s": f["round_s"], "plain_s": p["round_s"],
                          "ratio": round(f["round_s"] / p["round_s"], 4),
                          "overhead_pct": round(100 * (f["round_s"] - p["round_s"]) / p["round_s"], 2),
                          "plain_train_s": p["train_s"], "plain_evaluate_s": p["evaluate_s"],
                          "plain_identify_s": p["identify_s"]})
    steady = [r["overhead_pct"] for r in per_round if r["round"] >= 2]
    fr, pr = flower["rounds"], plain["rounds"]
    pre_round1 = fr[0]["wall_start"] - flower["wall_start"]
    round1_excess = fr[0]["round_s"] - pr[0]["round_s"]
    flower_to_end_r1 = fr[0]["wall_end"] - flower["wall_start"]
    plain_to_end_r1 = pr[0]["wall_end"] - plain["wall_start"]
    between = sum(b["wall_start"] - a["wall_end"] for a, b in zip(fr, fr[1:]))
    return {
        "per_round": per_round,
        "steady_state_overhead_pct": round(statistics.mean(steady), 2) if steady else None,
        "steady_state_overhead_pct_range": [min(steady), max(steady)] if steady else None,
        "steady_state_plain_round_s": round(statistics.mean(r["plain_s"] for r in per_round if r["round"] >= 2), 3)
        if steady else None,
        "startup": {
            "definition": "(SuperLink start -> end of Flower round 1) - (plain start -> end of plain round 1)",
            "startup_cost_s": round(flower_to_end_r1 - plain_to_end_r1, 2),
            "flower_to_end_of_round1_s": round(flower_to_end_r1, 2),
            "plain_to_end_of_round1_s": round(plain_to_end_r1, 2),
            "flower_pre_round1_s": round(pre_round1, 2),
            "plain_setup_s": plain["setup_s"],
            "round1_excess_s": round(round1_excess, 2),
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
        "plain_wall": {"total_s": plain["total_s"], "sum_of_rounds_s": round(sum(r["round_s"] for r in pr), 2),
                       "setup_s": plain["setup_s"]},
    }


def print_report(result: dict[str, Any]) -> None:
    fig = result["figures"]
    print("\nFlower simulation vs plain loop (fedavg, same run config and seeds)")
    print(f"  {result['command']}")
    print(f"  {result['machine']['cpu_count']} CPU cores; torch threads: plain {result['plain']['torch_threads']}, "
          f"ClientApp actor OMP_NUM_THREADS {result['flower_actor_threads']}")
    print("\n| round | Flower round_s | plain round_s | ratio | overhead |")
    print("|---:|---:|---:|---:|---:|")
    for r in fig["per_round"]:
        print(f"| {r['round']} | {r['flower_s']:.2f} | {r['plain_s']:.2f} | {r['ratio']:.3f} | {r['overhead_pct']:+.1f}% |")
    ss = fig["steady_state_overhead_pct"]
    st = fig["startup"]
    print(f"\nsteady-state overhead (mean over rounds >= 2 of (flower - plain)/plain): {ss:+.2f}% "
          f"(target < {TARGET_OVERHEAD_PCT:.0f}% at rounds >= {TARGET_MIN_ROUND_S:.0f}s; "
          f"plain steady round {fig['steady_state_plain_round_s']:.1f}s)")
    print(f"start-up cost = (SuperLink start -> end of Flower round 1) - (plain start -> end of plain round 1) "
          f"= {st['flower_to_end_of_round1_s']:.1f}s - {st['plain_to_end_of_round1_s']:.1f}s = "
          f"{st['startup_cost_s']:.1f}s (target < {TARGET_STARTUP_S:.0f}s)")
    print(f"  of which: before round 1 {st['flower_pre_round1_s']:.1f}s (plain setup {st['plain_setup_s']:.1f}s), "
          f"round-1 excess {st['round1_excess_s']:+.1f}s")
    fw = fig["flower_wall"]
    print(f"Flower wall {fw['total_s']:.1f}s = before round 1 {fw['pre_round1_s']:.1f}s + rounds "
          f"{fw['sum_of_rounds_s']:.1f}s + between rounds {fw['between_rounds_s']:.1f}s + after last round "
          f"{fw['after_last_round_s']:.1f}s + teardown {fw['teardown_s']:.1f}s; plain wall "
          f"{fig['plain_wall']['total_s']:.1f}s")
    print(f"final mean test metrics: flower {result['flower']['final']}, plain {result['plain']['final']}")
    if result["flower"].get("clientapp_runtime_s") is not None:
        print(f"Flower's ClientApp runtime total: {result['flower']['clientapp_runtime_s']:.1f}s "
              f"(plain rounds total {fig['plain_wall']['sum_of_rounds_s']:.1f}s)")
    for name in ("flower_steady", "plain_steady"):
        usage = result["cpu"].get(name) or {}
        if usage:
            cores = ", ".join(f"{k} {v:.2f}" for k, v in usage["cores"].items())
            print(f"CPU cores in use, {name.replace('_', ' ')} rounds ({usage['window_s']:.0f}s): {cores}")
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
    command = "python " + " ".join([os.path.relpath(__file__, Path.cwd())] + (argv if argv is not None else sys.argv[1:]))
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
        results: dict[str, Any] = {}
        for which in (("plain", "flower") if args.order == "plain-first" else ("flower", "plain")):
            if args.wait_idle > 0:
                wait_idle(args.wait_idle)
            print(f"{which} run ...", flush=True)
            started = time.monotonic()
            if which == "plain":
                results["plain"] = run_plain(config, args.clients, sampler)
            else:
                results["flower"] = run_flower(config, args.clients, workdir, args.timeout)
                for r in results["flower"]["rounds"]:
                    print(f"  flower round {r['round']}: {r['round_s']:.2f}s", flush=True)
            print(f"{which} run done in {time.monotonic() - started:.1f}s", flush=True)
        sampler.stop()
        plain, flower = results["plain"], results["flower"]
        fr, pr = flower["rounds"], plain["rounds"]
        cpu = {"flower_steady": sampler.usage(fr[1]["wall_start"], fr[-1]["wall_end"]) if len(fr) > 1 else {},
               "plain_steady": sampler.usage(pr[1]["wall_start"], pr[-1]["wall_end"]) if len(pr) > 1 else {}}
        actor_threads = sorted({i.get("OMP_NUM_THREADS", "unset") for i in sampler.actor_info.values()})
        import torch

        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "flwr": __import__("flwr").__version__, "ray": __import__("ray").__version__},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "run_config": {k: v for k, v in config.items() if k != "output-dir"},
            "targets": {"steady_state_overhead_pct": TARGET_OVERHEAD_PCT, "startup_s": TARGET_STARTUP_S,
                        "min_round_s": TARGET_MIN_ROUND_S},
            "figures": figures(plain, flower),
            "plain": plain,
            "flower": {k: v for k, v in flower.items() if k != "stdout_tail"},
            "flower_actor_threads": ",".join(actor_threads) or "not seen",
            "flower_actors": list(sampler.actor_info.values()),
            "cpu": cpu,
            "warnings": [],
        }
        other = "other processes (not this benchmark)"
        for name, usage in cpu.items():
            busy = (usage or {}).get("cores", {}).get(other, 0.0)
            if busy > 0.1:
                result["warnings"].append(f"machine not idle: other processes used {busy:.2f} cores during the "
                                          f"{name.replace('_', ' ')} rounds; the comparison is unreliable")
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
