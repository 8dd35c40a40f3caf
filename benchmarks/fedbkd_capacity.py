"""What a FedBKD site pays by capacity β: parameters, uplink, peak memory and training time of its sub-encoder.

For each β a fresh Python process builds a ViT classifier (random weights), cuts the sub-encoder that keeps
⌈β·d_ffn⌉ neurons of every FFN (``extract_subnetwork``, a prefix: the cost does not depend on which neurons),
and trains it with Adam on random images for ``--steps`` steps after one warm-up step. Reported:

- ``encoder_params``: parameters of the sub-encoder (what the site trains and sends, besides the indices);
- ``ffn_params``: the part of them in the FFNs, the only part β shrinks (the rest, attention, norms and
  patch embedding, stays whole at every β);
- ``uplink_mb``: its float32 bytes plus the int64 kept indices;
- ``peak_rss_mb``: the process's peak resident memory (model, gradients, Adam state, activations);
- ``step_s``: mean seconds per training step of ``--batch`` images;
- ``epoch_s_per_1000``: seconds per epoch of 1,000 images at that speed.

    python benchmarks/fedbkd_capacity.py                               # vit-s16 at 224, batch 16, CPU
    python benchmarks/fedbkd_capacity.py --backbone vit-b16 --device cuda

Results are printed as a table and written to benchmarks/results/fedbkd_capacity.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAPACITIES = (1.0, 0.5, 0.25, 0.125, 0.0625)


def measure_one(backbone: str, img_size: int, capacity: float, batch: int, steps: int, device: str) -> dict:
    import numpy as np
    import torch

    from medflower.models import ModelSpec, build_model
    from medflower.models.ffn_slices import extract_subnetwork, ffn_modules, select_neurons

    torch.manual_seed(0)
    model = build_model(ModelSpec(backbone=backbone, adapter="full", img_size=img_size, weights="none"), 2)
    kept = {name: select_neurons(m.fc1.out_features, capacity, "prefix") for name, m in ffn_modules(model).items()}
    sub = extract_subnetwork(model, kept).to(device).train()
    del model
    encoder = {k: v for k, v in sub.trainable_parameters().items() if k.startswith("backbone.")}
    params = sum(p.numel() for p in encoder.values())
    ffn_params = sum(p.numel() for m in ffn_modules(sub).values() for p in m.parameters())
    opt = torch.optim.Adam([p for p in sub.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(batch, 3, img_size, img_size, device=device)
    y = torch.randint(0, 2, (batch,), device=device)
    times = []
    for step in range(steps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(sub(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
    step_s = float(np.mean(times))
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "capacity": capacity,
        "encoder_params": params,
        "ffn_params": ffn_params,
        "uplink_mb": (4 * params + 8 * sum(len(v) for v in kept.values())) / 1e6,
        "peak_memory_mb": peak,
        "step_s": step_s,
        "epoch_s_per_1000": step_s * 1000 / batch,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="vit-s16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)  # internal: measure one capacity
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.backbone, args.img_size, args.one, args.batch, args.steps, args.device)))
        return 0
    rows = []
    for capacity in CAPACITIES:  # a fresh process each, so peak memory is this capacity's alone
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                str(capacity),
                "--backbone",
                args.backbone,
                "--img-size",
                str(args.img_size),
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
                "--device",
                args.device,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    other = {r["encoder_params"] - r["ffn_params"] for r in rows}
    print(f"\nnon-FFN encoder parameters (the same at every β): {', '.join(f'{o:,}' for o in sorted(other))}")
    memory = "peak GPU memory MB" if args.device == "cuda" else "peak RSS MB"
    print(
        f"\n| β | encoder parameters | uplink MB | {memory} | s per step ({args.batch} images) | s per 1,000 images |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['capacity']:g} | {r['encoder_params']:,} | {r['uplink_mb']:.1f} | {r['peak_memory_mb']:.0f} | "
            f"{r['step_s']:.2f} | {r['epoch_s_per_1000']:.0f} |"
        )
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "fedbkd_capacity.json").write_text(
        json.dumps(
            {
                "backbone": args.backbone,
                "img_size": args.img_size,
                "batch": args.batch,
                "device": args.device,
                "torch_threads": __import__("torch").get_num_threads(),
                "rows": rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
