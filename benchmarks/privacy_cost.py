"""What each privacy option adds to a round: seconds per round and bytes per round of FedAvg with no privacy,
client-level DP (at the site, on the server), sample-level DP-SGD (Opacus), SecAgg+ and SecAgg+ with site DP.

Every configuration runs the same experiment (same data, sites, seed, rounds) through medflower's in-process
engine, the ServerApp and ClientApp code a Flower run executes, with the clients one after another in this
process as on a one-actor simulation; so the difference between rows is the privacy layer's own compute and
its extra SecAgg+ stages, not Flower's process start-up (benchmarks/README.md).

    python benchmarks/privacy_cost.py                       # synthetic data, 4 sites, 4 rounds, 2 passes
    python benchmarks/privacy_cost.py --dataset segfolder:data/polyp --partition natural --clients 2 \\
        --img-size 64 --adapter bottleneck --optimizer adam
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `medflower` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import print_table, write_results

# name -> run-config overrides on top of FedAvg; noise levels are the docs' examples, the cost does not depend on
# them (the noise is one Gaussian draw per entry either way)
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "dp site": {"dp": "site", "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0},
    "dp server": {"dp": "server", "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0},
    "dp-sgd": {"dp-sgd": True, "dp-sgd-noise-multiplier": 1.0, "dp-sgd-max-grad-norm": 1.0},
    "secagg": {"secagg": True},
    "secagg + dp site": {"secagg": True, "dp": "site", "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0},
}


def run_one(name: str, overrides: dict[str, Any], base: dict[str, Any], clients: int, workdir: Path) -> dict:
    """One configuration's run; its per-round times and bytes from the server records of metrics.jsonl."""
    from medflower.inprocess import run_inprocess

    config = {**base, **overrides, "run-name": name.replace(" ", "-").replace("+", "and"), "output-dir": str(workdir)}
    started = time.perf_counter()
    summary, _ = run_inprocess(config, num_nodes=clients, record_sent=False)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (workdir / config["run-name"] / "metrics.jsonl").read_text().splitlines()]
    server = [r for r in records if r.get("kind") == "server"]
    steady = [r["round_s"] for r in server if r["round"] >= 2] or [r["round_s"] for r in server]
    epsilon = (summary.get("privacy") or {}).get("client_level", {}).get("epsilon")
    sgd = (summary.get("privacy") or {}).get("dp_sgd", {}).get("epsilon")
    return {
        "configuration": name,
        "round 1 s": server[0]["round_s"],
        "s per round (rounds ≥ 2)": statistics.fmean(steady),
        "MB per round": statistics.fmean((r["bytes_up"] + r["bytes_down"]) / 1e6 for r in server),
        "ε client-level": "–" if epsilon is None else f"{epsilon:.3g}",
        "ε DP-SGD": "–" if sgd is None else f"{sgd:.3g}",
        "wall s": wall,
        "final": {k: v for k, v in summary["final"].items() if isinstance(v, (int, float))},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--synthetic-size", type=int, default=2400)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--backbone", default="vit-tiny")
    parser.add_argument("--adapter", default="lora")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=2, help="passes over the configurations, every other one in reverse order"
    )
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/privacy_cost.json"))
    args = parser.parse_args(argv)

    base = {
        "strategy": "fedavg",
        "dataset": args.dataset,
        "data-dir": str(Path(args.data_dir).resolve()),
        "partition": args.partition,
        "num-rounds": args.rounds,
        "synthetic-size": args.synthetic_size,
        "img-size": args.img_size,
        "patch-size": args.patch_size,
        "backbone": args.backbone,
        "adapter": args.adapter,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "batch-size": args.batch_size,
        "backbone-weights": "none",
        "seed": args.seed,
        "overwrite": True,
    }
    wanted = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGURATIONS)
    unknown = sorted(set(wanted) - set(CONFIGURATIONS))
    if unknown:
        parser.error(f"--only: unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    passes: dict[str, list[dict]] = {name: [] for name in wanted}
    with tempfile.TemporaryDirectory(prefix="privacy-cost-") as tmp:
        for k in range(args.repeats):  # alternate the order so that a machine whose speed drifts biases no row
            for name in wanted if k % 2 == 0 else reversed(wanted):
                print(f"[privacy_cost] pass {k + 1}/{args.repeats}: {name} ...", flush=True)
                passes[name].append(run_one(name, CONFIGURATIONS[name], base, args.clients, Path(tmp)))
    rows = []
    for runs in passes.values():
        row = dict(runs[0])
        for key in ("round 1 s", "s per round (rounds ≥ 2)", "wall s"):
            row[key] = statistics.fmean(r[key] for r in runs)
        row["per pass s per round"] = [round(r["s per round (rounds ≥ 2)"], 3) for r in runs]
        rows.append(row)
    reference = next((r for r in rows if r["configuration"] == "none"), None)
    for row in rows:
        if reference is not None:
            row["added s per round"] = row["s per round (rounds ≥ 2)"] - reference["s per round (rounds ≥ 2)"]
            row["× none"] = row["s per round (rounds ≥ 2)"] / reference["s per round (rounds ≥ 2)"]
    header = [
        "configuration",
        "round 1 s",
        "s per round (rounds ≥ 2)",
        "added s per round",
        "× none",
        "MB per round",
        "ε client-level",
        "ε DP-SGD",
        "per pass s per round",
    ]
    print_table(header, rows, ".2f")
    arguments = {**vars(args), "out": str(args.out)}
    write_results(args.out, "configurations", [{**row, "arguments": arguments} for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
