"""Named-array helpers: clean parameter names, numpy snapshots, validated copies into parameters."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from .errors import ModelError

PEFT_ADAPTER_NAME = "default"


# BatchNorm buffers that travel with a fully trained backbone (num_batches_tracked does not: with the default
# momentum it is never read).
RUNNING_STATISTICS = ("running_mean", "running_var")


def is_running_statistic(name: str) -> bool:
    """True for an exchanged BatchNorm statistic: averaged like any array, but it has no gradient (so drift
    corrections and proximal terms leave it out)."""
    return name.rsplit(".", 1)[-1] in RUNNING_STATISTICS


def clean_param_name(name: str) -> str:
    """Drop peft's adapter-name component: ``qkv.lora_A.default.weight`` -> ``qkv.lora_A.weight``."""
    return ".".join(part for part in name.split(".") if part != PEFT_ADAPTER_NAME)


def to_numpy(params: Mapping[str, nn.Parameter]) -> OrderedDict[str, np.ndarray]:
    """float32 numpy copies (never views of the parameters), in the mapping's order."""
    return OrderedDict((name, p.detach().cpu().to(torch.float32).numpy().copy()) for name, p in params.items())


def array_spec(params: Mapping[str, nn.Parameter]) -> OrderedDict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of the arrays ``to_numpy`` returns."""
    return OrderedDict((name, (tuple(p.shape), "float32")) for name, p in params.items())


def check_arrays(params: Mapping[str, nn.Parameter], arrays: Mapping[str, np.ndarray], strict: bool = True) -> None:
    """Raise ModelError if (strict) names differ, or if any shared name has the wrong shape."""
    if strict:
        missing = [n for n in params if n not in arrays]
        unexpected = [n for n in arrays if n not in params]
        if missing or unexpected:
            raise ModelError(
                f"trainable arrays do not match the model: missing {_few(missing)}, "
                f"unexpected {_few(unexpected)} (expected {len(params)} arrays, got {len(arrays)})"
            )
    for name, value in arrays.items():
        if name in params and tuple(np.shape(value)) != tuple(params[name].shape):
            raise ModelError(
                f"array {name!r} has shape {tuple(np.shape(value))} but the model expects {tuple(params[name].shape)}"
            )


def copy_into(params: Mapping[str, nn.Parameter], arrays: Mapping[str, np.ndarray], strict: bool = True) -> None:
    """Validate all arrays first, then copy them into the parameters (no partial update on error).

    ``strict=False`` behaves like ``load_state_dict(strict=False)``: unknown and missing names are skipped.
    """
    check_arrays(params, arrays, strict)
    with torch.no_grad():
        for name, value in arrays.items():
            if name in params:
                p = params[name]
                p.copy_(torch.as_tensor(np.asarray(value), dtype=p.dtype, device=p.device))


def _few(names: list[str], k: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return f"[{shown}{', ...' if len(names) > k else ''}] ({len(names)})" if names else "[]"
