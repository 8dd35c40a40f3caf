"""FedKEI's client cost: the bi-level phase against one fine-tuning epoch, and the peak memory of
the exact gradient (autograd through the unrolled inner loop) against the first-order closed form.

For every setting (task size) and mode, a fresh child process builds the model and a binary task of
random images, then measures one call:

- ``finetune``: one epoch of ``medflower.training.train_epochs`` (SGD, the module trains);
- ``alpha``: the inner loop alone (``fedkei.inner_loop``), what the fine-tune phase runs to learn α̂;
- ``direct`` / ``first-order`` / ``exact``: the whole bi-level client step
  (``fedkei.cluster_gradients``: inner epoch on α, the outer loss pass, and for ``exact`` the
  backward through the unrolled inner loop).

Peak memory is CUDA's ``max_memory_allocated`` on a GPU; on a CPU it is the rise of the process's
resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the
call) over the resident set before it, measured in a second child with ``MALLOC_MMAP_THRESHOLD_``
low so that freed tensors really leave the resident set.

    python benchmarks/fedkei_bilevel.py                          # vit-tiny at 32 px, 128/256/512 samples
    python benchmarks/fedkei_bilevel.py --samples 256 --backbone vit-small --img-size 64 --patch-size 16

Results are printed as a table and written to benchmarks/results/fedkei_bilevel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import write_results  # noqa: E402

MODES = ("finetune", "alpha", "direct", "first-order", "exact")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: dict) -> dict:
    """One measurement in this (fresh) process."""
    from medflower.config import ExperimentConfig, defaults
    from medflower.models import build_model
    from medflower.strategies.continual import bilevel as bl
    from medflower.training import OptimizerSpec, train_epochs

    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    cfg = ExperimentConfig.from_run_config(
        {
            **defaults(),
            "backbone": args["backbone"],
            "img-size": args["img_size"],
            "patch-size": args["patch_size"],
            "backbone-weights": "none",
        }
    )
    model = build_model(cfg.model_spec(), 2).to(device).train()
    parts = bl.split_parts(model.trainable_spec())
    loss_fn = bl.module_loss(model, parts, model.parameter_paths())
    gen = torch.Generator().manual_seed(0)
    n, b, s = args["samples"], args["batch_size"], args["img_size"]
    x = torch.randn(n, 3, s, s, generator=gen)
    y = torch.randint(0, 2, (n,), generator=gen)
    batches = [(x[i : i + b].to(device), y[i : i + b].to(device)) for i in range(0, n, b)]
    widths = [bl.part_width(spec) for spec in parts.values()]
    clusters = [0.02 * torch.randn(args["k"], w, generator=gen).to(device) for w in widths]
    mode = args["mode"]

    def run() -> None:
        if mode == "finetune":
            loader = [(xb.cpu(), yb.cpu()) for xb, yb in batches]
            train_epochs(model, loader, epochs=1, optimizer=OptimizerSpec("sgd", 0.005), device=device)
        elif mode == "alpha":
            bl.inner_loop(loss_fn, clusters, batches, 0.05)
        else:
            bl.cluster_gradients(loss_fn, clusters, batches, [(bt, len(bt[1])) for bt in batches], 0.05, mode)

    run() if args["warmup"] else None  # one untimed call (allocator, kernels) when asked
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        before = _status_kb("VmRSS") * 1024
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _status_kb("VmHWM") * 1024
    return {
        **args,
        "seconds": seconds,
        "peak_extra_bytes": max(peak - before, 0),
        "steps": len(batches),
        "module_parameters": sum(widths),
    }


def _run_child(spec: dict, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--backbone", default="vit-tiny")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, nargs="+", default=[128, 256, 512], help="training samples of the task")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="cluster modules per part")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed call each child makes before the measured one",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fedkei_bilevel.json")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    results = []
    print(f"{'samples':>7} {'steps':>5} {'mode':>11} {'seconds':>8} {'x epoch':>8} {'peak MB':>8}")
    for samples in args.samples:
        epoch_s = None
        for mode in args.modes:
            spec = {
                "backbone": args.backbone,
                "img_size": args.img_size,
                "patch_size": args.patch_size,
                "samples": samples,
                "batch_size": args.batch_size,
                "k": args.k,
                "mode": mode,
                "device": args.device,
                "threads": args.threads,
                "warmup": args.warmup,
            }
            result = _run_child(spec, {})
            # Memory in a second child whose large blocks come straight from mmap: freed tensors leave
            # the resident set, so its high-water mark follows the call's live memory instead of glibc's
            # cached heap (that costs page faults, so the time is taken from the first child).
            if args.device == "cpu":
                result["peak_extra_bytes"] = _run_child(spec, {"MALLOC_MMAP_THRESHOLD_": "65536"})["peak_extra_bytes"]
            results.append(result)
            if mode == "finetune":
                epoch_s = result["seconds"]
            ratio = f"{result['seconds'] / epoch_s:8.2f}" if epoch_s else f"{'':>8}"
            print(
                f"{samples:>7} {result['steps']:>5} {mode:>11} {result['seconds']:8.2f} {ratio} "
                f"{result['peak_extra_bytes'] / 2**20:8.1f}",
                flush=True,
            )
    write_results(args.out, "results", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
