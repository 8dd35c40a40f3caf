"""Server-side SGCA aggregation time: cvxpy vs closed form, at N = 10, 100 and 1000 clients.

Times ``SGCA.aggregate_train`` itself (the whole step the ServerApp runs after a training phase:
stacking the replies, distances, the mixing matrix W, Θ̂_i = Σ_j W_ij Θ_j for every client and
splitting them back into named arrays), plus the W solve alone, for each solver.

The transmitted adapters have realistic sizes: by default the lowest Medical-SAM-Adapter style
bottleneck of ViT-B/16 (width 768, ratio 0.25: 295,872 parameters, what SAM ViT-B's encoder sends
with lat-layers=1), and that of ViT-Tiny (width 192: 18,672 parameters). Replies are random normal
arrays; the QP's work does not depend on their values.

    python benchmarks/sgca_aggregation.py                       # N = 10, 100, 1000; both widths
    python benchmarks/sgca_aggregation.py --clients 10 100 --cvxpy-max-clients 100

The two dense products of the step (the distances' Gram matrix and the mixing W Θ, 2·N·N·P flops each,
``sgca.product_flops``) run in torch on run-config ``sgca-device`` (``--device``: cpu, or cuda where there is one).
The table sets the whole step against those flops at this device's measured matmul rate (a square float32 matmul
of ``--peak-size`` on the CPU, bf16 on CUDA, best of 5; ``gpu_client.matmul_peak``): "products at peak" is the
least time the two products can take here, and "step / products at peak" how far the whole step is from it.

Results are printed as a table and written to benchmarks/results/sgca_aggregation.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import print_table, write_results  # noqa: E402
from benchmarks.gpu_client import matmul_peak  # noqa: E402
from medflower.config import ExperimentConfig  # noqa: E402
from medflower.contract import Reply  # noqa: E402
from medflower.results import RunRecorder  # noqa: E402
from medflower.strategies.sgca import SGCA, adapter_distances, product_flops, sgca_weights  # noqa: E402


def bottleneck_arrays(width: int, ratio: float = 0.25) -> OrderedDict[str, tuple[int, ...]]:
    """Names and shapes of blocks.0.adapter_attn of a ViT of this width."""
    hidden = round(width * ratio)
    prefix = "backbone.blocks.0.adapter_attn"
    return OrderedDict(
        [
            (f"{prefix}.down.weight", (hidden, width)),
            (f"{prefix}.down.bias", (hidden,)),
            (f"{prefix}.up.weight", (width, hidden)),
            (f"{prefix}.up.bias", (width,)),
        ]
    )


def make_strategy(shapes, solver: str, workdir: Path, device: str = "cpu") -> SGCA:
    cfg = ExperimentConfig.from_run_config(
        {"strategy": "sgca", "sgca-solver": solver, "lat-layers": 1, "sgca-device": device}
    )
    initial = OrderedDict((k, np.zeros(s, np.float32)) for k, s in shapes.items())
    return SGCA(cfg, RunRecorder(workdir), initial, num_classes=1)


def make_replies(shapes, n: int, seed: int) -> list[Reply]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(50, 500, size=n)
    return [
        Reply(
            node_id=i,
            client=f"site-{i:04d}",
            arrays=OrderedDict((k, rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()),
            metrics={"num-examples": float(sizes[i])},
            config={},
        )
        for i in range(n)
    ]


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--widths", type=int, nargs="+", default=[768, 192], help="ViT widths (768 = ViT-B)")
    parser.add_argument("--cvxpy-max-clients", type=int, default=1000, help="skip cvxpy above this N")
    parser.add_argument("--repeats", type=int, default=3, help="closed form: best of this many runs")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="sgca-device of the step")
    parser.add_argument(
        "--peak-size", type=int, default=0, help="matmul size for the peak; 0 = 8192 on CUDA, 2048 else"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sgca_aggregation.json")
    args = parser.parse_args()
    import torch

    peak = matmul_peak(torch.device(args.device), args.peak_size or (8192 if args.device == "cuda" else 2048))
    print(f"{args.device}: measured matmul rate {peak / 1e9:.1f} GFLOP/s", flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width in args.widths:
            shapes = bottleneck_arrays(width)
            params = sum(int(np.prod(s)) for s in shapes.values())
            for n in args.clients:
                replies = make_replies(shapes, n, seed=n)
                thetas = np.stack([np.concatenate([r.arrays[k].ravel() for k in shapes]) for r in replies])
                m = np.array([r.num_examples for r in replies]) / sum(r.num_examples for r in replies)
                d = adapter_distances(thetas)
                flops = product_flops(n, params)
                row = {"width": width, "params": params, "clients": n, "products GFLOP": flops / 1e9}
                row["products at peak s"] = flops / peak
                solved = {}
                for solver in ("closed-form", "cvxpy"):
                    if solver == "cvxpy" and n > args.cvxpy_max_clients:
                        continue
                    repeats = args.repeats if solver == "closed-form" else 1
                    strategy = make_strategy(shapes, solver, Path(tmp), args.device)
                    row[f"{solver} step s"] = best_of(lambda: strategy.aggregate_train(1, replies), repeats)  # noqa: B023 (called here)
                    row[f"{solver} W s"] = best_of(
                        lambda: solved.__setitem__(solver, sgca_weights(m, d, 0.8, solver)),  # noqa: B023 (called here)
                        repeats,
                    )
                row["step / products at peak"] = row["closed-form step s"] / row["products at peak s"]
                if "cvxpy" in solved:
                    row["max |W_cvxpy - W_closed|"] = float(np.abs(solved["cvxpy"] - solved["closed-form"]).max())
                    row["W speed-up"] = row["cvxpy W s"] / row["closed-form W s"]
                rows.append(row)
                print(json.dumps(row), flush=True)

    header = [
        "width",
        "params",
        "clients",
        "closed-form step s",
        "closed-form W s",
        "cvxpy step s",
        "cvxpy W s",
        "W speed-up",
        "max |W_cvxpy - W_closed|",
        "products GFLOP",
        "products at peak s",
        "step / products at peak",
    ]
    print_table(header, rows, ".3g")
    write_results(args.out, "rows", [{**r, "device": args.device, "matmul_flops_per_s": peak} for r in rows])


if __name__ == "__main__":
    main()
