"""The model card of a run's model: what it is, what it takes and gives, where it comes from and how it scored.

``medflower.export`` writes it beside the exported file (``<file>.json``, and inside a safetensors file's metadata);
``medflower.predict`` puts it in ``prediction.json``. Every value is read from the run folder: config.json (with its
``resolved`` section: the weights' source and checksum, the input normalisation), the checkpoint, summary.json (the
last evaluation's metrics, the ε spent under differential privacy).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .data.transforms import IMAGENET_MEAN, IMAGENET_STD
from .models.spec import is_unet

if TYPE_CHECKING:
    from .trained import Site, TrainedRun

CARD_VERSION = 1
SHA256 = re.compile(r"sha256:([0-9a-f]{64})")


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights(run: TrainedRun) -> dict[str, Any]:
    """The backbone's starting weights: the run config's setting, what it resolved to and its SHA-256 where the run
    recorded one (config.json's ``resolved``)."""
    source = run.resolved.get("weights-source")
    found = SHA256.search(source or "")
    return {
        "setting": run.cfg.backbone_weights,
        "source": source,
        "sha256": found.group(1) if found else None,
    }


def input_description(run: TrainedRun) -> dict[str, Any]:
    """What the model takes: the data layer's tensor, and how an image becomes it."""
    cfg, size = run.cfg, run.cfg.img_size
    reading = {
        "resize": f"bilinear to {size}x{size} (masks: nearest)",
        "channels": "RGB; a grey image is repeated to 3 channels",
        "intensity": cfg.intensity,
        "intensity_applies_to": "DICOM, NIfTI, 16-bit and float images and volumes (8-bit images as they are)",
    }
    if run.task == "segmentation":
        reading["volumes"] = f"slices across array axis {cfg.slice_axis} (nibabel's voxel order i, j, k)"
    return {
        "tensor": f"float32 [batch, 3, {size}, {size}]",
        "size": [size, size],
        "reading": reading,
        "normalisation": {
            "pixels": "0..255 divided by 255",
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "inside_model": run.resolved.get("input-norm", cfg.input_norm),
            "note": "the model takes (pixels / 255 - mean) / std per channel and applies its backbone's own input "
            "normalisation ('inside_model') itself",
        },
    }


def output_description(run: TrainedRun) -> dict[str, Any]:
    size, width = run.cfg.img_size, run.model_classes
    if run.task == "segmentation":
        return {
            "tensor": f"float32 logits [batch, {width}, {size}, {size}]",
            "mask": "structure k is present where its logit > 0 (sigmoid > 0.5); structures may overlap",
        }
    return {"tensor": f"float32 logits [batch, {width}]", "probabilities": "softmax over the classes"}


def metrics(run: TrainedRun, site: Site | None) -> dict[str, Any] | None:
    """The run's last evaluation (summary.json): the mean over sites, and the site's own when it has one."""
    summary = run.summary
    if summary is None:
        return None
    out: dict[str, Any] = {"of": "the test splits of the run's sites at their last evaluation (summary.json)"}
    out["round"] = summary.get("rounds")
    out["mean_over_sites"] = summary.get("final")
    if site is not None and site.name in (summary.get("per_client") or {}):
        out["site"] = summary["per_client"][site.name]
    return out


def privacy(run: TrainedRun, site: Site | None) -> dict[str, Any]:
    """The ε the run spent (summary.json's privacy section), or 'none' when the run used no differential privacy."""
    cfg = run.cfg
    if cfg.dp == "none" and not cfg.dp_sgd:
        return {"differential_privacy": "none"}
    recorded = (run.summary or {}).get("privacy")
    out: dict[str, Any] = {"dp": cfg.dp, "dp_sgd": bool(cfg.dp_sgd), "delta": cfg.dp_delta}
    if recorded is None:
        out["epsilon"] = None
        out["note"] = "the run has no summary.json (it did not finish): ε is not recorded"
        return out
    if level := recorded.get("client_level"):
        out["client_level_epsilon"] = level.get("epsilon")
        out["client_level_rounds"] = level.get("rounds")
    if sgd := recorded.get("dp_sgd"):
        per_site = sgd.get("epsilon_per_site") or {}
        out["dp_sgd_epsilon"] = (
            per_site.get(site.name) if site is not None and site.name in per_site else sgd.get("epsilon")
        )
        out["dp_sgd_epsilon_is"] = "this site's" if site is not None and site.name in per_site else "the largest site's"
    return out


def model_card(run: TrainedRun, site: Site | None, **extra: Any) -> dict[str, Any]:
    """The card of the run's model (the site's with a personalised method): a JSON-ready dict."""
    from .models.backbones import resolve_backbone

    cfg = run.cfg
    spec = run.model_spec()
    names = run.class_names
    card: dict[str, Any] = {
        "card_version": CARD_VERSION,
        "run": run.folder.name,
        "strategy": cfg.strategy,
        "task": run.task,
        "model": "global" if site is None else f"site {site.label}",
        "site": None if site is None else {"name": site.name, "partition": site.partition_id},
        "round": run.round,
        "rounds_planned": cfg.num_rounds,
        "checkpoint": {
            "folder": str(run.checkpoint.relative_to(run.folder)) if run.checkpoint else None,
            "arrays_sha256": file_sha256(run.checkpoint / "arrays.safetensors") if run.checkpoint else None,
        },
        "backbone": {
            "name": cfg.backbone,
            "architecture": cfg.backbone if is_unet(cfg.backbone) else resolve_backbone(cfg.backbone),
            "weights": weights(run),
        },
        "adapter": spec.adapter,
        "input": input_description(run),
        "output": output_description(run),
        ("structures" if run.task == "segmentation" else "classes"): names,
        "metrics": metrics(run, site),
        "privacy": privacy(run, site),
    }
    card.update(extra)
    return card
