"""Adapter injection: LoRA / IA3 through peft, plus a Medical-SAM-Adapter style bottleneck."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from peft import IA3Config, LoraConfig, inject_adapter_in_model
from torch import nn

from .errors import ModelError
from .qk_delta import QK_ADAPTERS, add_qk_adapters

# "full": no adapter, the whole backbone trains (SiFT and its baselines); "none": only the head trains.
ADAPTERS = ("lora", "ia3", "bottleneck", *QK_ADAPTERS, "full", "none")

# Module-name suffixes targeted by default (timm ViT/Swin/SAM fuse q,k,v into one `qkv` Linear).
_TRANSFORMER_TARGETS = {"lora": ("qkv",), "ia3": ("qkv", "fc2")}
_TRANSFORMER_FEEDFORWARD = ("fc2",)
_RESNET_BLOCK_CONV = re.compile(r"layer\d+\.\d+\.conv\d+")


def inject_adapter(
    backbone: nn.Module,
    adapter: str,
    family: str,
    *,
    targets: Sequence[str] = (),
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    bottleneck_ratio: float = 0.25,
    n_frequency: int = 3000,
    fourier_scale: float = 150.0,
    backbone_name: str = "",
) -> None:
    """Add ``adapter`` to ``backbone`` in place (parameters of the new modules are new nn.Parameters)."""
    if adapter in ("none", "full"):
        return
    if adapter in QK_ADAPTERS:
        add_qk_adapters(
            backbone,
            adapter,
            n_frequency=n_frequency,
            fourier_scale=fourier_scale,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            backbone_name=backbone_name,
        )
        return
    if adapter == "bottleneck":
        add_bottleneck_adapters(backbone, bottleneck_ratio, backbone_name=backbone_name)
        return
    if adapter not in ("lora", "ia3"):
        raise ModelError(f"unknown adapter {adapter!r}; choose one of {list(ADAPTERS)}")

    modules = _match_targets(
        backbone, tuple(targets) or _default_targets(backbone, adapter, family, backbone_name), backbone_name
    )
    if adapter == "lora":
        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=modules)
    else:
        feedforward = set(_feedforward_modules(backbone, family)) & set(modules)
        config = IA3Config(target_modules=modules, feedforward_modules=[m for m in modules if m in feedforward])
    try:
        # No PeftModel wrapper: parameter names stay timm names plus `<adapter param>.default`.
        inject_adapter_in_model(config, backbone)
    except ValueError as e:
        shown = f"{modules[:4]}{' ...' if len(modules) > 4 else ''}"
        raise ModelError(f"peft cannot add {adapter!r} to modules {shown} of {backbone_name!r}: {e}") from e


def _default_targets(backbone: nn.Module, adapter: str, family: str, backbone_name: str) -> tuple[str, ...]:
    if family in ("vit", "swin", "samvit", "tinyvit"):
        return _TRANSFORMER_TARGETS[adapter]
    if family == "resnet":  # every conv inside the residual blocks of layer1..4
        return tuple(n for n, _ in backbone.named_modules() if _RESNET_BLOCK_CONV.fullmatch(n))
    raise ModelError(
        f"no default {adapter!r} targets for backbone {backbone_name!r} (family {family!r}); pass "
        f"adapter_targets (module-name suffixes), e.g. from modules {_some_module_names(backbone)}"
    )


def _feedforward_modules(backbone: nn.Module, family: str) -> list[str]:
    """IA3 scales the *input* of feed-forward modules: the MLP's fc2, or the last conv of each residual block."""
    names = [n for n, _ in backbone.named_modules()]
    if family == "resnet":
        last_conv: dict[str, str] = {}
        for n in names:
            if _RESNET_BLOCK_CONV.fullmatch(n):
                last_conv[n.rsplit(".", 1)[0]] = n  # named_modules order: the block's last conv wins
        return list(last_conv.values())
    return [n for n in names if n.rsplit(".", 1)[-1] in _TRANSFORMER_FEEDFORWARD]


def _match_targets(backbone: nn.Module, targets: Sequence[str], backbone_name: str) -> list[str]:
    """Full names of the modules whose name equals or ends with ``.<target>`` (peft's list semantics)."""
    matched = [n for n, _ in backbone.named_modules() if n and any(n == t or n.endswith("." + t) for t in targets)]
    if not matched:
        raise ModelError(
            f"adapter targets {list(targets)} match no module of {backbone_name!r}; "
            f"module names look like {_some_module_names(backbone)}"
        )
    return matched


def _some_module_names(backbone: nn.Module, k: int = 8) -> list[str]:
    leaves = [n for n, m in backbone.named_modules() if n and not list(m.children())]
    return leaves[:: max(1, len(leaves) // k)][:k]


# ------------------------------------------------------------------------------------------ bottleneck adapter


class Bottleneck(nn.Module):
    """``scale * up(GELU(down(x)))`` added to a module's output by a forward hook.

    ``up`` starts at zero, so a freshly added adapter leaves the backbone unchanged. ``parallel=False`` feeds the
    hooked module's output (sequential adapter with skip), ``parallel=True`` its input (adapter beside it).
    Hand-written because peft has no bottleneck adapter with this (Medical-SAM-Adapter) placement.
    """

    def __init__(
        self, dim: int, ratio: float, *, scale: float = 1.0, parallel: bool = False, input_norm: nn.Module | None = None
    ):
        super().__init__()
        hidden = max(1, round(dim * ratio))
        self.down = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.up = nn.Linear(hidden, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.scale = scale
        self.parallel = parallel
        # A norm the hooked module applies inside itself (TinyViT's Mlp starts with its LayerNorm): the parallel
        # adapter reads the normalised tokens, as beside a timm block's MLP. Held outside the module tree (it is the
        # block's own, frozen, and must not appear twice among the parameters); deepcopy maps it to the copy's.
        object.__setattr__(self, "_input_norm", input_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(x)))

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """Forward hook for the adapted module. A bound method, so ``copy.deepcopy`` rebinds it to the copy."""
        x = args[0] if self.parallel else output
        if self.parallel and self._input_norm is not None:
            x = self._input_norm(x)
        return output + self.scale * self(x)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, parallel={self.parallel}"


def transformer_blocks(backbone: nn.Module) -> list[nn.Module]:
    """Blocks with ``.attn`` and ``.mlp`` submodules (timm ViT ``Block``, Swin ``SwinTransformerBlock``, SAM's
    ``vision_transformer_sam.Block``, LiteMedSAM's ``TinyViTBlock``)."""
    return [
        m
        for m in backbone.modules()
        if isinstance(getattr(m, "attn", None), nn.Module) and isinstance(getattr(m, "mlp", None), nn.Module)
    ]


def add_bottleneck_adapters(backbone: nn.Module, ratio: float, backbone_name: str = "") -> None:
    """Per block: ``attn_out + adapter_attn(attn_out)`` and ``mlp(x) + 0.5 * adapter_mlp(x)``.

    This is Medical-SAM-Adapter's placement in SAM's image encoder: its Space_Adapter (with skip) on the attention
    output and its MLP_Adapter beside the MLP, scaled by 0.5, both fed per token. The hooks sit on ``attn`` and
    ``mlp`` themselves, so windowed blocks (Swin, SAM) get the attention adapter inside the window partition, as
    Medical-SAM-Adapter applies it (the adapter is per token, so the partition does not change its result on the
    real tokens). Its third module, the Depth_Adapter, only runs on 3-D inputs and is not added.

    TinyViT's blocks (LiteMedSAM) apply their MLP's LayerNorm inside ``mlp`` (``mlp.norm``), and their attention
    starts with its own (``attn.norm``): the MLP adapter is fed ``mlp.norm(x)``, the tokens the MLP itself reads, as
    SAM's is fed ``norm2(x)``. Their depth-wise ``local_conv`` between attention and MLP is left as it is.
    """
    blocks = transformer_blocks(backbone)
    if not blocks:
        raise ModelError(
            f"adapter 'bottleneck' needs a transformer backbone with .attn/.mlp blocks "
            f"(got {backbone_name or type(backbone).__name__}); use lora or ia3"
        )
    for block in blocks:
        dim = _block_dim(block)
        block.adapter_attn = Bottleneck(dim, ratio, scale=1.0, parallel=False)
        inner_norm = getattr(block.mlp, "norm", None)
        block.adapter_mlp = Bottleneck(
            dim,
            ratio,
            scale=0.5,
            parallel=True,
            input_norm=inner_norm if isinstance(inner_norm, nn.LayerNorm) else None,
        )
        block.attn.register_forward_hook(block.adapter_attn.hook)
        block.mlp.register_forward_hook(block.adapter_mlp.hook)


def _block_dim(block: nn.Module) -> int:
    """Token width of a transformer block (input of its MLP)."""
    fc1 = getattr(block.mlp, "fc1", None)
    if isinstance(fc1, nn.Linear):
        return fc1.in_features
    norm = getattr(block, "norm1", None)
    if isinstance(norm, nn.LayerNorm):
        return norm.normalized_shape[-1]
    raise ModelError(f"cannot infer the width of transformer block {type(block).__name__} for the bottleneck adapter")
