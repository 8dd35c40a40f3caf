"""Training speed and peak memory of the big backbones: SAM ViT-B with bottleneck adapters (segmentation, 256 px),
ViT-B/16 with LoRA (classification, 224 px) and LiteMedSAM at 256 px (its encoder's forward alone, a training step
with bottleneck adapters inside the encoder, and the frozen-encoder mode's step on cached image embeddings, which
trains SAM's mask decoder only), plus the SAM adapter parameter table of docs/models.md.

Each configuration runs in a fresh child process: it builds the model (random weights, ``medflower.models``), puts
one batch of random images (and masks or labels) on the device, and runs ``--warmup`` untimed then ``--steps``
timed training steps: forward and loss under ``medflower.training.loops.autocast`` (bf16 on CUDA, nothing on the
CPU), backward, AdamW step over the trainable parameters (adapters + decoder/head). Reported:

- ``images_per_s``: batch × timed steps / their wall time (``time.perf_counter``, CUDA synchronised);
- ``step_s``: mean seconds per step; ``cpu_seconds`` (process CPU time over the timed steps, all threads) and the
  1-minute load average before and after them show whether the process had its cores (``cores`` in the table).
  On a busy machine, torch threads wait for each other at barriers and that waiting counts as CPU time too: use
  ``--threads 1`` there;
- peak memory (not with ``--speed``). CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps (``peak_mb``,
  weights included) and its rise over the memory allocated before them (``step_peak_mb``). CPU: the process's
  resident-set high-water mark ``VmHWM`` (``peak_mb``) and its rise over the resident set after the model, the batch
  and the optimizer state exist (``step_peak_mb``: activations, gradients and temporaries of a step). The warm-up step
  allocates the optimizer state; the high-water mark is then reset through ``/proc/self/clear_refs`` and the child
  runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set (see fedkei_bilevel.py).
  Where ``/proc`` is missing, ``resource.getrusage`` gives the process peak only. That setting makes every large
  tensor a fresh mmap, which slows allocation-heavy CPU steps (LiteMedSAM's convolutions at 256×256: about 3×);
  ``--speed`` leaves glibc's defaults for the images/s a training run sees, and its memory columns are then not
  meaningful.

    python benchmarks/backbone_speed.py --threads 1                        # both, batch 2, CPU: ~50 s
    python benchmarks/backbone_speed.py --device cuda --batch-size 32 --steps 20
    python benchmarks/backbone_speed.py --only sam-b-seg --batch-size 1
    python benchmarks/backbone_speed.py --param-table                      # the table in docs/models.md
    python benchmarks/backbone_speed.py --threads 1 --only litemedsam-encode litemedsam-adapters litemedsam-frozen
    python benchmarks/backbone_speed.py --device cuda --batch-size 32 --steps 20 --only litemedsam-encode \
        litemedsam-adapters litemedsam-frozen                              # bf16 autocast on a GPU

``litemedsam-encode`` times ``model.encode`` under ``torch.no_grad`` (what building a site's frozen-encoder cache
costs per image); its "step" has no backward and no optimizer.

Results are printed as a table and written to benchmarks/results/backbone_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import write_results  # noqa: E402

# name -> (ModelSpec fields, classes); ``task`` picks the loss.
CONFIGS: dict[str, tuple[dict, int]] = {
    "sam-b-seg": (dict(backbone="sam-b", adapter="bottleneck", img_size=256, task="segmentation"), 1),
    "vit-b16-cls": (dict(backbone="vit-b16", adapter="lora", img_size=224, task="classification"), 8),
    # LiteMedSAM (models/litemedsam.py): the encoder's forward alone; adapters inside it (forward + backward through
    # it); the frozen-encoder mode's step on the cached 256×64×64 embedding (mask decoder only)
    "litemedsam-encode": (dict(backbone="litemedsam", adapter="none", img_size=256, task="segmentation"), 1),
    "litemedsam-adapters": (dict(backbone="litemedsam", adapter="bottleneck", img_size=256, task="segmentation"), 1),
    "litemedsam-frozen": (
        dict(backbone="litemedsam", adapter="none", img_size=256, task="segmentation", encoded_inputs=True),
        1,
    ),
}
ENCODE_ONLY = ("litemedsam-encode",)

# FedSCA's setup for the communication totals: 4 clients; 100 rounds (docs/methods/sgca.md: "the paper's 100 rounds").
FEDSCA_CLIENTS = 4
FEDSCA_ROUNDS = 100
FEDSCA_PAPER = {"lat": 156.4e6, "all": 5.5e9}  # parameters exchanged over the run, as the paper reports them


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def child(args: dict) -> dict:
    """One configuration, measured in this (fresh) process."""
    import torch

    from medflower.models import ModelSpec, build_model
    from medflower.training import bce_dice_loss
    from medflower.training.loops import autocast

    fields, classes = CONFIGS[args["config"]]
    if args.get("threads"):
        torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    spec = ModelSpec(**fields, weights="none", bottleneck_ratio=args["ratio"])
    model = build_model(spec, classes).to(device).train(args["config"] not in ENCODE_ONLY)
    trainable = list(model.trainable_parameters().values())
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    b, s = args["batch_size"], spec.img_size
    shape = (b, 256, s // 4, s // 4) if spec.encoded_inputs else (b, 3, s, s)
    x = torch.randn(*shape, generator=gen).to(device)
    if spec.task == "segmentation":
        target = (torch.rand(b, s, s, generator=gen) > 0.5).long().to(device)
    else:
        target = torch.randint(0, classes, (b,), generator=gen).to(device)

    def step() -> None:
        if args["config"] in ENCODE_ONLY:
            with torch.no_grad(), autocast(device):
                model.encode(x)
            return
        with autocast(device):
            logits = model(x)
            loss = (
                bce_dice_loss(logits.float(), target)
                if spec.task == "segmentation"
                else torch.nn.functional.cross_entropy(logits.float(), target)
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args["warmup"]):
        step()
    proc = _status_kb("VmRSS") is not None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    elif proc:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        before = _status_kb("VmRSS") * 1024
    else:
        before = 0
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args["steps"]):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    elif proc:
        peak = _status_kb("VmHWM") * 1024
    else:  # ru_maxrss: KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    total = sum(p.numel() for p in model.parameters())
    return {
        **args,
        "spec": fields,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # all threads of this process; / seconds = cores it got
        "cpu_s_per_image": cpu_seconds / (b * args["steps"]),
        "load_1min": [load_before, os.getloadavg()[0] if load_before is not None else None],
        "step_s": seconds / args["steps"],
        "images_per_s": b * args["steps"] / seconds,
        "peak_mb": peak / 2**20,
        "step_peak_mb": max(peak - before, 0) / 2**20 if before else None,
        "parameters": total,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "threads": torch.get_num_threads(),
    }


def _run_child(spec: dict) -> dict:
    env = dict(os.environ)
    if spec.get("memory", True):
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ adapter parameters


def sam_adapter_counts(ratio: float = 0.25, backbone: str = "sam-b") -> dict:
    """Parameter counts of the bottleneck adapters on a SAM encoder, from the built model (random weights)."""
    from medflower.models import ModelSpec, adapter_modules, build_model, lowest_adapter_names

    spec = ModelSpec(
        backbone=backbone,
        adapter="bottleneck",
        bottleneck_ratio=ratio,
        img_size=64,
        weights="none",
        task="segmentation",
    )
    model = build_model(spec, 1)
    arrays = {k: v.size for k, v in model.get_trainable().items()}
    groups = adapter_modules(arrays)
    sizes = [sum(arrays[n] for n in names) for names in groups.values()]
    lowest = lowest_adapter_names(arrays, 1)
    encoder = sum(p.numel() for n, p in model.backbone.named_parameters() if ".adapter_" not in n)
    return {
        "ratio": ratio,
        "hidden": model.backbone.blocks[0].adapter_attn.down.out_features,
        "blocks": len(model.backbone.blocks),
        "modules": len(groups),
        "module": sizes[0],
        "all": sum(sizes),
        "lat": sum(arrays[n] for n in lowest),
        "lat_names": sorted({n.rsplit(".", 2)[0] for n in lowest}),
        "decoder": sum(v for k, v in arrays.items() if k.startswith("decoder.")),
        "encoder": encoder,
    }


def param_table(ratio: float = 0.25) -> str:
    """The Markdown table of docs/models.md "SAM encoders" (tests/models/test_sam_encoder.py checks the page has it)."""
    c, r = FEDSCA_CLIENTS, FEDSCA_ROUNDS
    n = sam_adapter_counts(ratio)
    msa_modules = 3 * n["blocks"]  # Medical-SAM-Adapter's blocks also hold a Depth_Adapter (3-D inputs only)
    entries = [
        (f"one adapter module (ratio {ratio:g}: {n['hidden']} hidden units)", 1, n["module"]),
        ("`lat-layers=1`: `blocks.0.adapter_attn`", 1, n["lat"]),
        ("all adapters, as placed here (2 per block)", n["modules"], n["all"]),
        ("all adapters with Medical-SAM-Adapter's Depth_Adapter (3 per block)", msa_modules, msa_modules * n["module"]),
        ("light decoder (256 → 64 channels; only `fedavg`/`fedprox` send it)", "–", n["decoder"]),
    ]
    rows = [
        f"| SAM ViT-B | modules | parameters P | {c} clients × {r} rounds, up: {c}·{r}·P | up + down: 2·{c}·{r}·P |",
        "|---|---:|---:|---:|---:|",
    ]
    for what, modules, p in entries:
        rows.append(f"| {what} | {modules} | {p:,} | {_si(c * r * p)} | {_si(2 * c * r * p)} |")
    return "\n".join(rows)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:g}"


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first allocates AdamW state)")
    parser.add_argument("--ratio", type=float, default=0.25, help="bottleneck ratio (Medical-SAM-Adapter: 0.25)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument("--param-table", action="store_true", help="print the SAM adapter parameter table and exit")
    parser.add_argument(
        "--speed",
        action="store_true",
        help="glibc's default allocator settings: faster steps (LiteMedSAM's encoder about 3x on the CPU), but the "
        "step's memory is no longer measurable (freed tensors stay in the resident set)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "backbone_speed.json")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.param_table:
        print(param_table(args.ratio))
        return 0
    if args.warmup < 1 and args.device == "cpu":
        parser.error("--warmup must be >= 1 on the CPU (a step's memory is measured once the optimizer state exists)")
    results = []
    print(
        f"{'config':>12} {'batch':>5} {'img/s':>7} {'s/step':>7} {'cores':>5} {'CPU s/img':>9} {'load':>5} "
        f"{'peak MB':>8} {'step MB':>8} {'trainable':>10}"
    )
    for name in args.only:
        spec = {
            "config": name,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "ratio": args.ratio,
            "device": args.device,
            "threads": args.threads,
            "memory": not args.speed,
        }
        result = _run_child(spec)
        results.append(result)
        step_mb = f"{result['step_peak_mb']:8.0f}" if result["step_peak_mb"] is not None else f"{'–':>8}"
        print(
            f"{name:>12} {args.batch_size:>5} {result['images_per_s']:7.2f} {result['step_s']:7.2f} "
            f"{result['cpu_seconds'] / result['seconds']:5.2f} {result['cpu_s_per_image']:9.2f} "
            f"{max(result['load_1min'] or [0]):5.2f} "
            f"{result['peak_mb']:8.0f} {step_mb} {result['trainable_parameters']:>10,}",
            flush=True,
        )
    write_results(args.out, "results", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
