"""Weight updates on the q and k slices of a fused ``qkv`` projection: spectral (FourierFT) and LoRA.

pFedMxF (docs/methods/pfedmxf.md) adapts only the query and key projections. timm fuses q, k and v into one
``qkv`` Linear, and peft's FourierFT/LoRA adapt a whole module, so these are our own modules: a
forward hook adds ``x @ [ΔW_q; ΔW_k]ᵀ`` to the q and k thirds of the output. Each keeps a frozen
``merged`` update (the tasks already finished, the paper merges ΔW^t into the frozen weights),
held as a buffer rather than written into the backbone so that one cached model can serve many sites.

- ``SpectralQK``: ``ΔW = Re(IDFT2(S))·scale`` (peft FourierFT's ``get_delta_weight``, shown equal in a
  test), S zero except the trainable real ``coefficients`` at the flat coordinates ``coords`` plus a
  frozen dense spectrum ``frozen`` (the other sites' coefficients of the current task).
- ``LoRAQK``: ``ΔW = (alpha/r)·B A`` for q and k (the FedAvg-LoRA and FedStack baselines).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .errors import ModelError

QK_ADAPTERS = ("fourier", "lora-qk")
QK_MODULE = "qk_delta"  # attribute of the attention module holding the update
FOURIER_LOCATION_SEED = 777  # peft FourierFTConfig's default random_loc_seed


class QKDelta(nn.Module):
    """Base: ``output[..., :2d] += x @ (merged + delta())ᵀ`` on a fused qkv Linear of width 3d.

    ``heads`` = h > 0: the projection interleaves q, k and v per head (TinyViT's attention, LiteMedSAM: output viewed
    as ``[h, 3e]``, head j's q, k, v at ``[j, :e]``, ``[j, e:2e]``, ``[j, 2e:]``); ΔW_q and ΔW_k keep timm's head-major
    row order (row j·e + i is head j's dimension i) and are added to those rows. 0: timm's ``[q; k; v]``."""

    def __init__(self, dim_in: int, dim_qk: int, heads: int = 0):
        super().__init__()
        self.dim_in, self.dim_qk, self.heads = dim_in, dim_qk, heads
        self.register_buffer("merged", torch.zeros(2, dim_qk, dim_in), persistent=False)

    def delta(self) -> torch.Tensor:
        """The trainable update [2, dim_qk, dim_in] (q, k)."""
        raise NotImplementedError

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        update = (self.merged + self.delta()).reshape(2 * self.dim_qk, self.dim_in)
        extra = torch.nn.functional.linear(args[0], update.to(output.dtype))
        if self.heads:
            h, e = self.heads, self.dim_qk // self.heads
            per_head = output.reshape(*output.shape[:-1], h, 3 * e)
            q_k = extra.reshape(*extra.shape[:-1], 2, h, e).movedim(-3, -2).reshape(*extra.shape[:-1], h, 2 * e)
            return torch.cat([per_head[..., : 2 * e] + q_k, per_head[..., 2 * e :]], dim=-1).reshape(output.shape)
        qk = output[..., : 2 * self.dim_qk] + extra
        return torch.cat([qk, output[..., 2 * self.dim_qk :]], dim=-1)


class SpectralQK(QKDelta):
    """``ΔW = Re(IFFT2(frozen + scatter(coords, coefficients)))·scale`` for q and k (FourierFT on q, k)."""

    def __init__(self, dim_in: int, dim_qk: int, n_frequency: int, scale: float, heads: int = 0):
        super().__init__(dim_in, dim_qk, heads)
        if not 1 <= n_frequency <= dim_in * dim_qk:
            raise ModelError(
                f"n-frequency = {n_frequency} must be in 1..{dim_in * dim_qk} (the coordinates of "
                f"a {dim_qk}x{dim_in} matrix)"
            )
        self.scale = scale
        self.coefficients = nn.Parameter(torch.zeros(2, n_frequency))  # zero: the model starts as the backbone
        # flat u * dim_in + v; by default peft's random locations (pFedMxF sets its allocation per message)
        locations = torch.randperm(dim_qk * dim_in, generator=torch.Generator().manual_seed(FOURIER_LOCATION_SEED))
        self.register_buffer("coords", locations[:n_frequency].clone(), persistent=False)
        self.register_buffer("frozen", torch.zeros(2, dim_qk, dim_in), persistent=False)

    def spectrum(self) -> torch.Tensor:
        """The dense real spectrum S [2, dim_qk, dim_in]: frozen coefficients plus the trainable ones."""
        flat = self.frozen.reshape(2, -1).scatter_add(1, self.coords.expand(2, -1), self.coefficients)
        return flat.reshape(2, self.dim_qk, self.dim_in)

    def delta(self) -> torch.Tensor:
        return spectral_delta(self.spectrum(), self.scale)

    def extra_repr(self) -> str:
        return f"{self.dim_qk}x{self.dim_in}, n_frequency={self.coefficients.shape[1]}, scale={self.scale}"


def spectral_delta(spectrum: torch.Tensor, scale: float) -> torch.Tensor:
    """``Re(IDFT2(S))·scale`` over the last two axes (float32: torch.fft has no bf16/fp16 on CPU)."""
    return torch.fft.ifft2(spectrum.float()).real * scale


class LoRAQK(QKDelta):
    """``ΔW = (alpha/r)·B A`` for q and k; A Kaiming-uniform like peft, B zero."""

    def __init__(self, dim_in: int, dim_qk: int, rank: int, alpha: float, heads: int = 0):
        super().__init__(dim_in, dim_qk, heads)
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(2, rank, dim_in))
        self.lora_B = nn.Parameter(torch.zeros(2, dim_qk, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A fresh LoRA (FedStack starts one every round): A as peft initialises it, B = 0."""
        for a in self.lora_A:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def delta(self) -> torch.Tensor:
        return self.scale * self.lora_B @ self.lora_A


def add_qk_adapters(
    backbone: nn.Module,
    adapter: str,
    *,
    n_frequency: int,
    fourier_scale: float,
    lora_rank: int,
    lora_alpha: float,
    backbone_name: str = "",
) -> None:
    """Add a ``SpectralQK`` (``fourier``) or ``LoRAQK`` (``lora-qk``) to every attention module's fused qkv."""
    found = 0
    for module in list(backbone.modules()):
        qkv = getattr(module, "qkv", None)
        if not isinstance(qkv, nn.Linear) or qkv.out_features % 3:
            continue
        dim_qk = qkv.out_features // 3
        heads = per_head_layout(module, dim_qk)
        if adapter == "fourier":
            delta: QKDelta = SpectralQK(qkv.in_features, dim_qk, n_frequency, fourier_scale, heads)
        else:
            delta = LoRAQK(qkv.in_features, dim_qk, lora_rank, lora_alpha, heads)
        setattr(module, QK_MODULE, delta)
        qkv.register_forward_hook(delta.hook)
        found += 1
    if not found:
        raise ModelError(
            f"adapter {adapter!r} adapts the q and k slices of fused qkv projections, and "
            f"{backbone_name or type(backbone).__name__} has none; use a ViT or Swin backbone"
        )


def per_head_layout(attention: nn.Module, dim_qk: int) -> int:
    """The number of heads when ``attention``'s qkv interleaves q, k, v per head (TinyViT's ``Attention``, which
    splits ``qkv(x).view(B, N, heads, -1)`` into key_dim, key_dim, d), else 0 (timm's fused ``[q; k; v]``)."""
    heads, key_dim, d = (getattr(attention, name, None) for name in ("num_heads", "key_dim", "d"))
    if type(attention).__module__.endswith("tiny_vit_sam") and isinstance(heads, int) and key_dim == d:
        if heads * key_dim != dim_qk:
            raise ModelError(f"TinyViT attention with {heads} heads of {key_dim} has no square q/k of width {dim_qk}")
        return heads
    return 0


def qk_modules(model: nn.Module) -> dict[str, QKDelta]:
    """Every q/k update of a model by module path (forward order), e.g. ``backbone.blocks.0.attn.qk_delta``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QKDelta)}
