"""What a deployed round costs beyond its training: the same experiment in simulation and in a loopback deployment,
split per phase.

One invocation runs the same run config (same seeds, sites and rounds) in each chosen mode:

- ``sim``: a real ``flower-superlink --simulation`` and ``flwr run`` (Flower's simulation engine: one long-lived
  Ray actor runs every site's ClientApp in turn);
- ``worker``: a real SuperLink and one real SuperNode per site on 127.0.0.1 (``medflower.loopback``); Flower starts a
  ``flwr-clientapp`` process per message, which hands it to the site's long-lived worker (node-config
  ``site-worker=true``, the default; docs/deployment.md#site-worker);
- ``process``: the same deployment with ``site-worker=false``: each message's own process imports torch, timm and
  peft, builds the model and reads the data (medflower's cache on disk spares the decoding), as before the worker;
- ``worker+poll``: ``worker`` with ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1`` on the SuperNodes (Flower's SuperExec
  looks for a new message every 0.1 s instead of every 1 s);
- ``worker+fold`` and ``sim+fold``: ``worker`` and ``sim`` with run-config ``evaluate-in-train=true`` (each round's
  evaluation rides in the next round's training replies: one message per site and round; the same metrics,
  docs/deployment.md#fewer-messages-per-round). Their steady state is rounds 2 .. R-1 (the last round still has
  its evaluate phase).

Every site writes one profile record per message (``MEDFLOWER_PROFILE``, medflower/profiling.py) and the ServerApp
writes each round's ``round_s`` and per-phase wall times (``phase_s``) to ``metrics.jsonl``. Per mode the report
gives the steady-state round (mean of rounds >= 2), its ratio to simulation, and per message (mean over sites and
rounds >= 2, the slowest site of each phase):

- ``queue``: from the server creating the message to the start of the process that handles it (SuperLink, the
  SuperNode's 3-s poll, SuperExec's 1-s poll, process launch); in simulation, to the handler's start;
- ``startup``: from that process's start to the handler (Python, Flower's runtime, medflower's entry point);
  0 for a long-lived process;
- ``imports``, ``model``, ``data``, ``train``, ``evaluate``: inside the handler (medflower/profiling.py);
- ``other``: the rest of the handler (message decoding, the reply's arrays, the worker's socket);
- ``reply``: from the handler's end to the end of the server's phase (the SuperNode's 0.5-s reply poll, the
  transfer, the server's 0.2-s poll).

Run from the repository root (the machine otherwise idle)::

    python benchmarks/deployment_overhead.py                       # every mode; 3 sites, 5 rounds
    python benchmarks/deployment_overhead.py --modes sim worker --rounds 3
    python benchmarks/deployment_overhead.py --run-config "dataset='medmnist:pneumoniamnist' data-dir='data'"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python benchmarks/deployment_overhead.py` from a clone

from benchmarks._report import print_table  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "deployment_overhead.json"
# mode -> (simulation, site-worker, SuperExec's task poll in s or None for Flower's default of 1 s, evaluate-in-train)
MODES = {
    "sim": (True, False, None, False),
    "process": (False, False, None, False),
    "worker": (False, True, None, False),
    "worker+poll": (False, True, 0.1, False),
    "sim+fold": (True, False, None, True),
    "worker+fold": (False, True, None, True),
}
COLUMNS = ("queue", "startup", "imports", "model", "data", "train", "evaluate", "other", "reply")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--sites", type=int, default=3, help="SuperNodes (simulated or real)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (steady state: rounds >= 2; 2..R-1 with the fold)")
    p.add_argument("--strategy", default="fedavg")
    p.add_argument(
        "--run-config",
        default="",
        help="extra run config, flwr's syntax (key=value, strings quoted); default: the app's defaults "
        "(ViT-Tiny + LoRA on the synthetic set at 32 px)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file with every figure")
    p.add_argument("--workdir", type=Path, default=None, help="keep the run folders and logs here")
    p.add_argument("--report-only", action="store_true", help="report the finished runs in --workdir again")
    return p.parse_args(argv)


def parse_run_config(text: str) -> dict[str, Any]:
    """``key=value`` pairs in flwr's --run-config syntax, read with the same TOML rules."""
    import tomllib

    return (
        tomllib.loads("\n".join(f'"{k}" = {v}' for k, v in (kv.split("=", 1) for kv in text.split()))) if text else {}
    )


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One run in ``mode``; its server rounds and the sites' profile records."""
    from medflower.loopback import LoopbackFederation

    folder = workdir / mode.replace("+", "-")
    folder.mkdir(parents=True, exist_ok=True)
    profile = folder / "profile.jsonl"
    profile.unlink(missing_ok=True)
    simulation, worker, superexec_poll, fold = MODES[mode]
    config = {
        "strategy": args.strategy,
        "num-rounds": args.rounds,
        "evaluate-in-train": fold,
        "output-dir": str(folder / "outputs"),
        "run-name": "run",
        "min-nodes": args.sites,
        **parse_run_config(args.run_config),
    }
    node_configs = [{"site-worker": worker} for _ in range(args.sites)]
    # Simulation trains one site at a time with every core; the deployed sites train at once on this one machine,
    # so each gets its share of the cores (torch threads beyond the cores wait on each other at every barrier).
    cores = os.cpu_count() or 1
    threads = cores if simulation else max(1, cores // args.sites)
    env = {"MEDFLOWER_PROFILE": str(profile), "OMP_NUM_THREADS": str(threads)}
    if superexec_poll is not None:
        env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(superexec_poll)
    started = time.monotonic()
    with LoopbackFederation(
        num_supernodes=args.sites,
        simulation=simulation,
        workdir=folder / "federation",
        node_configs=node_configs,
        extra_env=env,
    ) as fed:
        fed.run_app(config, timeout=args.timeout)
    return collect(mode, folder, time.monotonic() - started)


def collect(mode: str, folder: Path, wall: float | None = None) -> dict[str, Any]:
    """A finished run's server rounds and profile records."""
    profile = folder / "profile.jsonl"
    lines = (folder / "outputs" / "run" / "metrics.jsonl").read_text().splitlines()
    # a round's record (evaluate-in-train adds records of late pooled metrics, without round_s)
    server = [r for r in map(json.loads, lines) if r["kind"] == "server" and "round_s" in r]
    messages = [json.loads(line) for line in profile.read_text().splitlines()] if profile.exists() else []
    return {"mode": mode, "wall_s": wall, "server": server, "messages": messages}


def breakdown(run: dict[str, Any]) -> dict[str, Any]:
    """The steady-state round and the per-message split (module docstring) of one run."""
    last = max(r["round"] for r in run["server"])
    folded = MODES[run["mode"]][3] and last >= 3  # its last round has the evaluate phase the others carry
    steady = [r for r in run["server"] if 2 <= r["round"] < (last if folded else last + 1)] or run["server"]
    rows: dict[str, list[dict[str, float]]] = {}
    for rec in steady:
        for phase, wall in rec.get("phase_s", {}).items():
            msgs = [m for m in run["messages"] if m["round"] == rec["round"] and m["message_type"] == phase]
            if not msgs:
                continue
            slowest = max(msgs, key=lambda m: m["handler_end"] - m["created_at"])
            rows.setdefault(phase, []).append(split(slowest, wall))
    phases = {
        phase: {col: statistics.fmean(r[col] for r in splits) for col in (*COLUMNS, "wall")}
        for phase, splits in rows.items()
    }
    return {
        "round_s": statistics.fmean(r["round_s"] for r in steady),
        "round1_s": run["server"][0]["round_s"],
        "wall_s": run["wall_s"] or float("nan"),
        "phases": phases,
    }


def split(message: dict[str, Any], phase_wall: float) -> dict[str, float]:
    """One message's time from the server's creation of it to the end of its phase, by column."""
    start = message.get("process_start")
    long_lived = start is None or start < message["created_at"]
    queue = (message["handler_start"] if long_lived else start) - message["created_at"]
    startup = 0.0 if long_lived else message["handler_start"] - start
    handler = message["handler_end"] - message["handler_start"]
    inside = {name: message.get(f"{name}_s", 0.0) for name in ("imports", "model", "data", "train", "evaluate")}
    reply = phase_wall - (message["handler_end"] - message["created_at"])
    return {
        "queue": queue,
        "startup": startup,
        **inside,
        "other": handler - sum(inside.values()),
        "reply": reply,
        "wall": phase_wall,
    }


def report(results: dict[str, dict[str, Any]]) -> None:
    sim = results.get("sim", {}).get("round_s")
    rows = []
    for mode, res in results.items():
        rows.append(
            {
                "mode": mode,
                "round s": res["round_s"],
                "x sim": res["round_s"] / sim if sim else float("nan"),
                "round 1 s": res["round1_s"],
                "run wall s": res["wall_s"],
            }
        )
    print("\nsteady-state round (mean of rounds >= 2; 2..R-1 with the fold)")
    print_table(["mode", "round s", "x sim", "round 1 s", "run wall s"], rows, ".2f")
    for mode, res in results.items():
        print(f"\n{mode}: seconds per phase, the slowest site's message (mean of rounds >= 2)")
        rows = [{"phase": phase, **{c: v[c] for c in (*COLUMNS, "wall")}} for phase, v in res["phases"].items()]
        print_table(["phase", *COLUMNS, "wall"], rows, ".2f")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="medflower-deploy-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        results = {}
        for mode in args.modes:
            if args.report_only:
                run = collect(mode, workdir / mode.replace("+", "-"))
            else:
                print(f"[deployment_overhead] {mode}: {args.sites} sites, {args.rounds} rounds", flush=True)
                run = run_mode(mode, args, workdir)
            results[mode] = {**breakdown(run), "raw": run}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "cores": os.cpu_count(),
        "results": results,
    }
    args.out.write_text(json.dumps(summary, indent=1))
    report(results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
