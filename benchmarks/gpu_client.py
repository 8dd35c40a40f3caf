"""One client's training on a GPU: medflower's training loop against a plain PyTorch loop of the same model, in
images per second and model FLOP utilisation.

For each configuration (ViT-B/16 + LoRA, classification at 224 px; SAM ViT-B + bottleneck adapters, segmentation at
256 px; random weights, ``medflower.models``), in one process:

- **plain**: the batch already on the device, ``--steps`` steps of forward and loss under
  ``medflower.training.loops.autocast`` (bf16 on CUDA), backward, AdamW over the trainable parameters; nothing else;
- **medflower**: ``medflower.training.train_epochs``, as a site runs it: ``--steps`` batches of uint8 images from
  ``medflower.data.make_loader`` (collation, resizing and normalisation on the CPU, pinned memory and loader workers
  on CUDA as a site's loaders have them), moved to the device, the same step, plus the loop's per-step checks
  (a finite loss, read back with ``.item()``);
- **FLOPs per image**: forward and backward of one batch counted by ``torch.utils.flop_counter.FlopCounterMode``;
- **peak**: this device's measured matmul rate (``--peak-size`` square float32 matmul on the CPU, bf16 on CUDA,
  best of 5), so that **MFU** = FLOPs per image × images per second / peak says how close to the device's limit a
  step runs, with the same yardstick on every machine.

The goal on a GPU is medflower ≥ 0.9× the plain loop. On the CPU the same table comes out at small sizes (defaults
below), where the loader's share is larger than on a GPU at full size.

    python benchmarks/gpu_client.py                                   # CPU: 112 px ViT-B, 128 px SAM, batch 2
    python benchmarks/gpu_client.py --device cuda                     # GPU: 224 / 256 px, batch 32, 20 steps
    python benchmarks/gpu_client.py --device cuda --only vit-b16-cls --batch-size 64

Results are printed as a table and written to benchmarks/results/gpu_client.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import print_table, write_results  # noqa: E402
from benchmarks.backbone_speed import CONFIGS  # noqa: E402
from medflower.models import ModelSpec, build_model  # noqa: E402
from medflower.training import OptimizerSpec, autocast, task_loss, train_epochs  # noqa: E402

CPU_SIZES = {"vit-b16-cls": 112, "sam-b-seg": 128}  # full sizes take minutes per step on 2 cores


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: torch.device, size: int) -> float:
    """FLOP/s of a square matmul on ``device`` (bf16 on CUDA, float32 elsewhere), best of 5."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        synchronise(device)
        started = time.perf_counter()
        a @ b
        synchronise(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


class ImageSet(torch.utils.data.Dataset):
    """``n`` random uint8 images (and masks or labels), the items a site's datasets give."""

    def __init__(self, n: int, size: int, task: str, classes: int):
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        self.targets = (
            rng.integers(0, 2, (n, size, size), dtype=np.uint8)
            if task == "segmentation"
            else rng.integers(0, classes, n).tolist()
        )
        self.img_size = size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def measure(name: str, args: argparse.Namespace, device: torch.device, peak: float) -> dict:
    from medflower.data import make_loader

    fields, classes = CONFIGS[name]
    size = args.img_size or (fields["img_size"] if device.type == "cuda" else CPU_SIZES[name])
    spec = ModelSpec(**{**fields, "img_size": size}, weights="none")
    model = build_model(spec, classes).to(device).train()
    batch = args.batch_size
    data = ImageSet(batch * (args.steps + 1), size, spec.task, classes)
    x, y = next(iter(make_loader(data, batch, False, 0)))
    x, y = x.to(device), y.to(device)

    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with autocast(device):
            loss = task_loss(spec.task, model(x), y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    flops_per_image = counter.get_total_flops() / batch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def plain_step() -> None:
        with autocast(device):
            loss = task_loss(spec.task, model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    plain_step()  # warm-up (optimizer state, kernels)
    synchronise(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        plain_step()
    synchronise(device)
    plain_s = time.perf_counter() - started

    cuda = device.type == "cuda"
    workers = args.workers if cuda else 0
    loader_of = lambda n: make_loader(  # noqa: E731 (a site's training loader over n batches)
        torch.utils.data.Subset(data, range(n * batch)), batch, True, 0, pin_memory=cuda, workers=workers
    )
    train_epochs(model, loader_of(1), epochs=1, optimizer=OptimizerSpec("adamw", 1e-4), device=device)  # warm-up
    synchronise(device)
    started = time.perf_counter()
    train_epochs(model, loader_of(args.steps), epochs=1, optimizer=OptimizerSpec("adamw", 1e-4), device=device)
    synchronise(device)
    framework_s = time.perf_counter() - started

    images = batch * args.steps
    row = {"config": name, "img": size, "batch": batch, "GFLOP/img": flops_per_image / 1e9}
    for label, seconds in (("plain", plain_s), ("medflower", framework_s)):
        row[f"{label} img/s"] = images / seconds
        row[f"{label} MFU"] = flops_per_image * images / seconds / peak
    row["medflower / plain"] = row["medflower img/s"] / row["plain img/s"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--img-size", type=int, default=0, help="0 = 224/256 on CUDA, 112/128 elsewhere")
    p.add_argument("--batch-size", type=int, default=0, help="0 = 32 on CUDA, 2 elsewhere")
    p.add_argument("--steps", type=int, default=0, help="timed steps; 0 = 20 on CUDA, 3 elsewhere")
    p.add_argument("--workers", type=int, default=4, help="loader workers on CUDA")
    p.add_argument("--peak-size", type=int, default=0, help="matmul size for the peak; 0 = 8192 on CUDA, 2048 else")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_client.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.batch_size = args.batch_size or (32 if cuda else 2)
    args.steps = args.steps or (20 if cuda else 3)
    peak = matmul_peak(device, args.peak_size or (8192 if cuda else 2048))
    print(f"device {device}: measured matmul peak {peak / 1e12:.3f} TFLOP/s", flush=True)
    rows = [measure(name, args, device, peak) for name in args.only]
    header = ["config", "img", "batch", "GFLOP/img", "plain img/s", "medflower img/s", "medflower / plain"]
    print_table([*header, "plain MFU", "medflower MFU"], rows, ".3g")
    write_results(args.out, "rows", [{**r, "device": str(device), "peak_flops": peak} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
