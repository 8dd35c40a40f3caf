"""Bytes on the wire per site and round: pFedMxF's spectral coefficients against LoRA on q and k.

For each (backbone, method) this runs one class-incremental task with ``--rounds`` rounds through the
medflower ServerApp logic and in-process ClientApps (``medflower.inprocess``) on a small synthetic pool,
then reads the bytes the server counted (``metrics.jsonl`` server records: every array of every message,
as sent). Reported per site and training round:

- ``uplink``: what a site sends after training (``bytes_up`` / sites / rounds);
- ``uplink_adapter``: the same without the head (which every method sends alike);
- ``down_train``: the mean size of one training message (``bytes_down`` also counts the evaluation
  messages, which carry the same state);
- ``trainable_qk``: the trainable q/k parameters of one site (its float32 uplink without the head).

The paper's comparison is n-frequency 3000 against LoRA rank 16 on ViT-B/16 (d = 768): the
coefficients have about the parameters of rank 2.

    python benchmarks/pfedmxf_communication.py                      # vit-b16 and vit-tiny, 2 sites
    python benchmarks/pfedmxf_communication.py --backbones vit-tiny --sites 4

Results are printed as a table and written to benchmarks/results/pfedmxf_communication.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = (
    ("pfedmxf", {"n-frequency": 3000}),
    ("fedavg-lora", {"lora-rank": 16}),
    ("fedstack", {"lora-rank": 16}),
    ("fedavg-lora-r2", {"lora-rank": 2}),
)


def measure(backbone: str, method: str, overrides: dict, sites: int, rounds: int, out: Path) -> dict:
    from medflower.contract import _record_bytes
    from medflower.inprocess import run_inprocess

    strategy = method.split("-r")[0] if method.startswith("fedavg-lora-r") else method
    config = {
        "strategy": strategy,
        "backbone": backbone,
        "backbone-weights": "none",
        "img-size": 32,
        "patch-size": 16,
        "dataset": "synthetic",
        "synthetic-size": 40 * sites,
        "partition": "iid",
        "num-tasks": 1,
        "classes-per-task": 2,
        "rounds-per-task": rounds,
        "batch-size": 16,
        "optimizer": "adam",
        "lr": 1e-3,
        "output-dir": str(out),
        "run-name": f"{backbone}-{method}",
        **overrides,
    }
    summary, grid = run_inprocess(config, num_nodes=sites)
    server = [json.loads(line) for line in (out / config["run-name"] / "metrics.jsonl").read_text().splitlines()]
    server = [r for r in server if r["kind"] == "server"]
    train_messages = [m for m in grid.sent if m.metadata.message_type == "train"]
    uploads = sum(r["bytes_up"] for r in server) / (sites * rounds)
    first = train_messages[0].content["arrays"]
    head = sum(int(first[k].numpy().nbytes) for k in ("head.weight", "head.bias"))
    return {
        "backbone": backbone,
        "method": method,
        "sites": sites,
        "rounds": rounds,
        "uplink": uploads,
        "uplink_adapter": uploads - head,
        "trainable_qk": int(uploads - head) // 4,
        "down_train": sum(_record_bytes(m.content) for m in train_messages) / len(train_messages),
        "last": summary["final"].get("last"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", default="vit-b16,vit-tiny")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "pfedmxf_communication.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for backbone in args.backbones.split(","):
            for method, overrides in METHODS:
                results.append(measure(backbone, method, overrides, args.sites, args.rounds, Path(tmp)))
                r = results[-1]
                print(
                    f"{backbone:10s} {method:16s} uplink {r['uplink'] / 1e3:9.1f} kB (adapter "
                    f"{r['uplink_adapter'] / 1e3:9.1f} kB, {r['trainable_qk']:>9,} q/k parameters), "
                    f"training message down {r['down_train'] / 1e3:9.1f} kB",
                    flush=True,
                )
    Path(args.output).write_text(json.dumps(results, indent=1))
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
