"""Export a run's model (the site's, with a personalised method) for a viewer or a pipeline, with its model card.

    python -m medflower.export --run outputs/fedavg-polyp --format onnx --out polyp.onnx
    python -m medflower.export --run outputs/fedsa-prostate --site site-1 --format torchscript --out site-1.pt

The model is assembled as ``medflower.predict`` assembles it (``medflower/trained.py``: the last good checkpoint, and
the site's own state with a personalised method), then its adapters are folded into the layers they adapt where the
adapter allows it: LoRA and IA3 by peft's own merge (the steps of peft's ``merge_and_unload``; medflower injects
adapters without a PeftModel, so it runs them on the backbone itself). The bottleneck adapter (a non-linear branch)
and a method's forward hooks cannot be folded and stay as modules; the card says which.

Formats: ``safetensors`` (the weights of the merged model; ``load_safetensors`` rebuilds it from the file alone),
``torchscript`` (``torch.jit.load``), ``onnx`` (needs the ``export`` extra: onnx, onnxruntime). Every export is
loaded back and run on a few probe inputs; its outputs must equal the run's model's (within 1e-4, relative to the
logits' scale), else the export fails. The card (``<out>.json``; the safetensors file carries the model part in its
metadata too) names the backbone, the weights' source and checksum, the input size and normalisation, the classes or
structures, the strategy and rounds, the final metrics and the ε spent under differential privacy. docs/predict.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ConfigError
from .data import DataError
from .data.transforms import normalise
from .models import ModelError, ModelSpec, build_model
from .models.adapters import Bottleneck
from .models.qk_delta import QKDelta
from .trained import RunError, TrainedRun, add_run_arguments, with_site_model

FORMATS = ("safetensors", "torchscript", "onnx")
METADATA_KEY = "medflower"  # the safetensors metadata entry holding how to rebuild the model
PROBES = 2  # probe images every export is checked on
TOLERANCE = 1e-4  # largest |export - model| allowed, relative to max(1, the logits' largest magnitude)


class ExportError(ValueError):
    """A format this model cannot take (the message says why), or an export whose outputs differ from the model's."""


# ----------------------------------------------------------------------------- folding
def fold_adapters(model: nn.Module) -> dict[str, Any]:
    """Merge every peft adapter layer of ``model`` into the layer it adapts, in place (peft's merge_and_unload
    steps: ``merge`` each tuner layer, put its base layer in its place); returns what was folded and what stays."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuners = {name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}
    folded: Counter[str] = Counter()
    for name in sorted(tuners):
        if any(name.startswith(other + ".") for other in tuners):
            continue  # inside another tuner layer
        module = model.get_submodule(name)
        kind = type(module).__module__.split(".")[2] if type(module).__module__.startswith("peft.tuners.") else "peft"
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if hasattr(module, "unload_and_optionally_merge_module"):
            replacement = module.unload_and_optionally_merge_module(merge=True, safe_merge=True, adapter_names=None)
        else:
            module.merge(safe_merge=True)
            replacement = module.get_base_layer()
        setattr(parent, child, replacement)
        folded[kind] += 1
    adapters, foreign = _hooked(model)
    kept = Counter(f"{kind} (cannot be folded: {why})" for kind, why in adapters)
    notes: dict[str, Any] = {"folded": dict(folded), "kept_as_modules": dict(kept)}
    if foreign:  # a method's per-site computation (FedDBE's bias): only the traced formats record it
        notes["method_hooks"] = foreign
    return notes


def _hooked(model: nn.Module) -> tuple[list[tuple[str, str]], list[str]]:
    """(adapters that work through forward hooks and are rebuilt with the model, other forward hooks: a method's
    per-site additions that only the traced formats keep)."""
    adapters, foreign = [], []
    for name, module in model.named_modules():
        for hook in [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]:
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, Bottleneck):
                adapters.append(("bottleneck adapter", "a non-linear branch beside the layer"))
            elif isinstance(owner, QKDelta):
                adapters.append((type(owner).__name__, "an update held beside the fused qkv weights"))
            else:
                what = type(owner).__name__ if owner is not None else getattr(hook, "__qualname__", repr(hook))
                foreign.append(f"{what} on {name or 'the model'}")
    return adapters, foreign


# ----------------------------------------------------------------------------- formats
def probe_inputs(img_size: int, count: int = PROBES, seed: int = 0) -> torch.Tensor:
    """Seeded images as the loaders give them: uint8-valued pixels through the data layer's normalisation."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (count, 3, img_size, img_size), generator=generator).float()
    return normalise(pixels)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without torch's tracer and deprecation warnings (torch.jit and the TorchScript-based ONNX exporter warn at
    every call)."""
    with warnings.catch_warnings():
        for category in (torch.jit.TracerWarning, FutureWarning, DeprecationWarning, UserWarning):
            warnings.simplefilter("ignore", category)
        yield


def write_safetensors(model: nn.Module, path: Path, rebuild: dict[str, Any]) -> None:
    """The merged model's weights, with what rebuilds its architecture (``rebuild``, checked to fit them first)."""
    from safetensors.torch import save_model

    _, foreign = _hooked(model)
    if foreign:
        raise ExportError(
            f"format safetensors holds weights only, but this model also computes through forward hooks "
            f"({'; '.join(foreign)}), which its weights cannot bring back; export torchscript or onnx, which record "
            "the whole computation"
        )
    if rebuild:
        shapes = {k: tuple(v.shape) for k, v in rebuilt(rebuild).state_dict().items()}
        if misfit := [k for k, v in model.state_dict().items() if shapes.get(k) != tuple(v.shape)]:
            raise ExportError(
                f"format safetensors rebuilds the model from the run config's description, which this model does not "
                f"fit ({len(misfit)} weights differ in shape or name, e.g. {misfit[0]}: a site's sub-network of the "
                "backbone, as the sub-model strategies train); export torchscript or onnx, which hold the architecture"
            )
    save_model(model, str(path), metadata={METADATA_KEY: json.dumps(rebuild)})


def rebuilt(rebuild: dict[str, Any]) -> nn.Module:
    """The architecture a safetensors export describes, its adapters folded (random weights)."""
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in rebuild["spec"].items() if k in fields})
    model = build_model(spec, int(rebuild["classes"]))
    fold_adapters(model)
    return model


def load_safetensors(path: str | Path) -> nn.Module:
    """The model of a safetensors export, rebuilt from the file alone: its architecture from the metadata (no
    pretrained weights are read), its adapters folded as on export, then every weight loaded (strictly)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if METADATA_KEY not in metadata:
        raise ExportError(f"{path}: not a medflower export (no '{METADATA_KEY}' entry in its metadata)")
    model = rebuilt(json.loads(metadata[METADATA_KEY]))
    load_model(model, str(path), strict=True)
    return model.eval()


def write_torchscript(model: nn.Module, path: Path, example: torch.Tensor) -> None:
    try:
        with _quiet():
            traced = torch.jit.trace(model, example, check_trace=False)
            torch.jit.save(traced, str(path))
    except Exception as err:  # torch raises many kinds for an untraceable forward
        raise ExportError(
            f"format torchscript cannot take this model: tracing failed: {type(err).__name__}: {err}"
        ) from err


def load_torchscript(path: str | Path) -> torch.jit.ScriptModule:
    with _quiet():
        return torch.jit.load(str(path), map_location="cpu").eval()


def write_onnx(model: nn.Module, path: Path, example: torch.Tensor) -> str:
    """The ONNX file of ``model`` with a dynamic batch axis; returns which exporter wrote it."""
    try:
        import onnx  # noqa: F401  (torch's exporters need it)
    except ImportError:
        raise ExportError(
            "format onnx needs the onnx package, which is not installed: pip install 'medflower[export]' "
            "(onnx, onnxruntime, onnxscript)"
        ) from None
    names = {"input_names": ["image"], "output_names": ["logits"]}
    with _quiet():
        try:  # the TorchScript-based exporter: seconds, a dynamic batch axis by name
            axes = {"image": {0: "batch"}, "logits": {0: "batch"}}
            torch.onnx.export(model, (example,), str(path), dynamic_axes=axes, dynamo=False, **names)
            return "torch.onnx (TorchScript-based)"
        except Exception as err:  # torch raises many kinds; a torch without that exporter too
            first = f"{type(err).__name__}: {err}"
        try:  # the torch.export-based exporter
            shapes = ({0: torch.export.Dim("batch")},)
            torch.onnx.export(model, (example,), str(path), dynamic_shapes=shapes, dynamo=True, **names)
            return "torch.onnx (torch.export-based)"
        except Exception as err:  # torch raises many kinds for a model it cannot export
            raise ExportError(
                f"format onnx cannot take this model: the TorchScript-based exporter said {first}; the "
                f"torch.export-based one {type(err).__name__}: {err}"
            ) from err


def onnx_outputs(path: str | Path, x: torch.Tensor) -> torch.Tensor | None:
    """The ONNX file's outputs for ``x`` by onnxruntime (CPU), or None when onnxruntime is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def loaded_outputs(fmt: str, path: Path, x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of the export at ``path`` read back in its own format (None: no runtime here to read it)."""
    if fmt == "onnx":
        return onnx_outputs(path, x)
    model = load_safetensors(path) if fmt == "safetensors" else load_torchscript(path)
    with torch.no_grad():
        return model(x).float()


# ----------------------------------------------------------------------------- export
def rebuild_description(run: TrainedRun, model: nn.Module) -> dict[str, Any]:
    """What ``load_safetensors`` needs: the model's spec (no pretrained weights: every weight is in the file; the
    input normalisation as it resolved) and its output width."""
    spec = dataclasses.asdict(model.spec) if getattr(model, "spec", None) is not None else {}
    norm = getattr(model, "input_norm_name", "imagenet")
    spec.update(weights="none", input_norm="mean-std" if norm.startswith("mean-std") else norm, encoded_inputs=False)
    return {"spec": spec, "classes": run.model_classes}


def export(
    run: str | Path | TrainedRun,
    fmt: str,
    out: str | Path,
    site: str | None = None,
    state_dir: str | Path | None = None,
    card_path: str | Path | None = None,
) -> dict[str, Any]:
    """Write the run's (site's) merged model to ``out`` in format ``fmt`` and its card beside it (``<out>.json``
    unless ``card_path``); returns the card. The export is read back and checked against the model."""
    from .modelcard import file_sha256, model_card

    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    run = run if isinstance(run, TrainedRun) else TrainedRun(run)
    chosen = run.site(site, state_dir)
    model = with_site_model(run, chosen, lambda m, _: copy.deepcopy(m).cpu().eval(), device="cpu")
    x = probe_inputs(run.cfg.img_size)
    with torch.no_grad():
        expected = model(x).float()
    merged = copy.deepcopy(model)
    folding = fold_adapters(merged)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    exporter = {"safetensors": "safetensors.torch.save_model", "torchscript": "torch.jit.trace"}.get(fmt)
    if fmt == "safetensors":
        write_safetensors(merged, out, rebuild_description(run, model))
    elif fmt == "torchscript":
        write_torchscript(merged, out, x)
    else:
        exporter = write_onnx(merged, out, x)
    try:
        got = loaded_outputs(fmt, out, x)
    except Exception as err:  # each format's reader raises its own kinds
        out.unlink(missing_ok=True)
        raise ExportError(
            f"the {fmt} file could not be read back ({type(err).__name__}: {err}); nothing was written"
        ) from err
    scale = max(1.0, float(expected.abs().max()))
    check: dict[str, Any] = {
        "probe_inputs": PROBES,
        "against": "the run's model before folding",
        "tolerance": TOLERANCE,
    }
    if got is None:
        check.update(verified=False, why="onnxruntime is not installed here to run the file")
    else:
        difference = float((got - expected).abs().max()) if got.shape == expected.shape else float("inf")
        check.update(verified=difference <= TOLERANCE * scale, max_abs_difference=difference)
        if not check["verified"]:
            out.unlink(missing_ok=True)
            raise ExportError(
                f"the {fmt} export's outputs differ from the model's by up to {difference:.3g} (shape "
                f"{tuple(got.shape)} vs {tuple(expected.shape)}); nothing was written"
            )
    card = model_card(
        run,
        chosen,
        format=fmt,
        file=out.name,
        sha256=file_sha256(out),
        exporter=exporter,
        adapters=folding,
        check=check,
        load=LOADERS[fmt].format(file=out.name),
    )
    card_path = Path(card_path).expanduser() if card_path else out.with_name(out.name + ".json")
    card_path.write_text(json.dumps(card, indent=1))
    return card


LOADERS = {
    "safetensors": "from medflower.export import load_safetensors; model = load_safetensors('{file}')",
    "torchscript": "import torch; model = torch.jit.load('{file}')",
    "onnx": "import onnxruntime; session = onnxruntime.InferenceSession('{file}'); "
    "logits = session.run(None, {{'image': x}})[0]",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medflower.export", description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--format", required=True, choices=FORMATS, help="the file format")
    parser.add_argument("--out", required=True, help="the file to write (its card: <out>.json)")
    parser.add_argument("--card", default=None, help="where the card goes instead of <out>.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        card = export(args.run, args.format, args.out, args.site, args.state_dir, args.card)
    except (RunError, ExportError, DataError, ConfigError, ModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    folded = ", ".join(f"{n} {k}" for k, n in card["adapters"]["folded"].items()) or "none"
    print(
        f"{card['model']} of {card['run']} ({card['strategy']}, round {card['round']}) written to {args.out} "
        f"(adapters folded: {folded}; check: {card['check'].get('max_abs_difference', 'not run')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
