"""Selecting exchanged arrays by name: which adapter module a parameter belongs to, and depth order.

Strategies see a model only as ``name -> array`` (the contract in docs/experiments.md), so LAT's "lowest L adapter
modules" is computed from names alone, identically on the server and on every site.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable

# peft parameter names below the adapted module (``qkv.lora_A.weight`` -> module ``qkv``).
PEFT_PARAM_MARKERS = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "ia3_l",
    "fourierft_spectrum",
)
BOTTLENECK_PREFIX = "adapter_"  # Bottleneck modules are block attributes adapter_attn / adapter_mlp
_INT = re.compile(r"\d+")


def adapter_module(name: str) -> str | None:
    """The adapter module that parameter ``name`` belongs to; None for head/decoder (non-backbone) arrays."""
    if not name.startswith("backbone."):
        return None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PEFT_PARAM_MARKERS:
            return ".".join(parts[:i])
        if part.startswith(BOTTLENECK_PREFIX):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def adapter_modules(names: Iterable[str]) -> OrderedDict[str, list[str]]:
    """Adapter module -> its parameter names, modules ordered by depth (forward order).

    Depth is the tuple of integers in the module name (``layers.1.blocks.0`` -> (1, 0)); within a block
    the attention adapter comes before the MLP adapter (the forward order), then registration order.
    ViT and SAM encoders (``blocks.<k>``, windowed or global attention alike) order by block index; SAM's neck and
    the decoder/head hold no adapter, so they never form a module here (decoder/head names are not ``backbone.``).
    """
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for name in names:
        module = adapter_module(name)
        if module is not None:
            groups.setdefault(module, []).append(name)
    keys = list(groups)
    order = sorted(
        range(len(keys)), key=lambda i: (tuple(int(n) for n in _INT.findall(keys[i])), _block_position(keys[i]), i)
    )
    return OrderedDict((keys[i], groups[keys[i]]) for i in order)


def lowest_adapter_names(names: Iterable[str], layers: int | str) -> list[str]:
    """Names of the parameters of the ``layers`` lowest adapter modules (``'all'``: every adapter).

    Returned in the order of ``names``. Raises ValueError if the model has no adapters.
    """
    names = list(names)
    groups = adapter_modules(names)
    if not groups:
        raise ValueError(
            "the model has no adapter parameters to transmit (adapter='none'?); "
            "LAT needs adapter lora, ia3 or bottleneck"
        )
    chosen = list(groups.values()) if layers == "all" else list(groups.values())[: int(layers)]
    keep = {n for group in chosen for n in group}
    return [n for n in names if n in keep]


def _block_position(module: str) -> int:
    """0 for attention-side adapters, 1 for MLP-side ones, 2 otherwise (forward order inside a block)."""
    parts = module.split(".")
    if any("attn" in part for part in parts):
        return 0
    if any("mlp" in part for part in parts):
        return 1
    return 2
