"""Measured interference between the sites' and tasks' spectral updates of finished pFedMxF runs.

For every run folder given, this reloads the checkpoint: the allocation table and every (task, site)
coefficient block. It rebuilds each block's ΔW for every q/k matrix (``Re(IDFT2(S))·scale`` of that
block alone), then reports the cosine ⟨ΔW_a, ΔW_b⟩ / (‖ΔW_a‖ ‖ΔW_b‖) over all pairs of blocks
(a ≠ b) and all matrices. It also counts the coordinates whose mirror image (−u, −v) belongs to
another block: the pairs the paper's conjugate-unaware sampling lets interfere.

    python benchmarks/pfedmxf_orthogonality.py outputs/experiments/pfedmxf-synthetic/qbli-pfedmxf-seed0 \
        outputs/experiments/pfedmxf-synthetic/qbli-paper-mode-seed0
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(run_dir: Path) -> dict:
    from medflower.config import ExperimentConfig, defaults
    from medflower.contract import Checkpointer
    from medflower.models import build_model
    from medflower.models.qk_delta import qk_modules, spectral_delta
    from medflower.strategies.incremental.spectral import FrequencyAllocator, conjugate, dense_spectrum

    config = json.loads((run_dir / "config.json").read_text())
    cfg = ExperimentConfig.from_run_config({**defaults(), **config, "resume-from": ""}, check_paths=False)
    arrays, meta = Checkpointer(run_dir / "checkpoint").load()
    modules = {name: (m.dim_qk, m.dim_in) for name, m in qk_modules(build_model(cfg.model_spec(), 8)).items()}
    allocator = FrequencyAllocator(
        list(modules.values()), cfg.seed, cfg.conjugate_aware, shared=cfg.frequency_sharing == "shared"
    )
    allocator.restore(meta["strategy_meta"]["allocations"])
    blocks = allocator.allocations
    cosines = []
    for name, shape in modules.items():
        deltas = []
        for a in blocks:
            values = arrays[f"coef/{a.task}/{a.client}/{name}"]
            deltas.append(
                spectral_delta(
                    torch.as_tensor(dense_spectrum(allocator.coords(a, shape), values, shape)), cfg.fourier_scale
                )
                .double()
                .reshape(2, -1)
            )
        for x, y in itertools.combinations(deltas, 2):
            norms = x.norm(dim=1) * y.norm(dim=1)
            ok = norms > 0
            cosines.extend(((x * y).sum(dim=1)[ok] / norms[ok]).abs().tolist())
    shape = next(iter(modules.values()))
    owner = {}
    for i, a in enumerate(blocks):
        owner.update({int(c): i for c in allocator.coords(a, shape)})
    mirrored = sum(1 for c, i in owner.items() if owner.get(int(conjugate(np.array([c]), shape)[0]), i) != i)
    return {
        "run": run_dir.name,
        "conjugate_aware": cfg.conjugate_aware,
        "sharing": cfg.frequency_sharing,
        "blocks": len(blocks),
        "pairs": len(cosines),
        "max_abs_cosine": max(cosines, default=0.0),
        "mean_abs_cosine": float(np.mean(cosines)) if cosines else 0.0,
        "coordinates_mirrored_in_another_block": mirrored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    for run in args.runs:
        r = measure(run)
        print(
            f"{r['run']:32s} conjugate-aware={str(r['conjugate_aware']):5s} {r['sharing']:8s} "
            f"{r['blocks']} blocks, {r['pairs']} pairs: max |cos| {r['max_abs_cosine']:.2e}, "
            f"mean {r['mean_abs_cosine']:.2e}; {r['coordinates_mirrored_in_another_block']} coordinates "
            f"mirrored in another block"
        )


if __name__ == "__main__":
    main()
