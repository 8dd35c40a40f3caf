"""ModelSpec: everything needed to build the same classifier in every process."""

from __future__ import annotations

from dataclasses import dataclass

from .adapters import ADAPTERS
from .backbones import WEIGHT_MODES, resolve_backbone
from .errors import ModelError
from .litemedsam import PROMPTS
from .normalisation import INPUT_NORMS

TASKS = ("classification", "segmentation")
# linear: a trainable nn.Linear. text / random: SiFT's cosine head cos(w_c, P·f)/τ with class embeddings W from a
# text source (text) or random with the same shape (random: the paper's 'Random' ablation), P a seeded projector.
HEADS = ("linear", "text", "random")


@dataclass(frozen=True)
class ModelSpec:
    """Backbone + adapter configuration; validated on construction (weights files are checked at build time)."""

    backbone: str = "vit-tiny"  # alias (BACKBONE_ALIASES), timm model name, or U-Net (unet.UNET_BACKBONES)
    adapter: str = "lora"  # lora | ia3 | bottleneck | none (head only) | full (whole backbone; U-Nets: full only)
    img_size: int = 32
    patch_size: int = 0  # 0 = backbone default; ViTs only
    weights: str = "auto"  # none | auto | path to a local .safetensors/.pth/.pt/.bin file
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    adapter_targets: tuple[str, ...] = ()  # module-name suffixes (or "a,b" string); () = per-family default
    bottleneck_ratio: float = 0.25
    n_frequency: int = 3000  # fourier: trainable spectral coefficients per adapted matrix
    fourier_scale: float = 150.0  # fourier: ΔW = Re(IDFT2(S)) * scale (peft FourierFT's default scaling)
    seed: int = 0  # seeds backbone, adapter and head init: same spec -> identical model
    task: str = "classification"  # classification (linear head) | segmentation (light decoder)
    head: str = "linear"  # linear | text | random (HEADS); the cosine heads need a class-embedding source:
    class_embeddings: str = ""  # .npy/.safetensors file [classes, dim], or
    text_encoder: str = ""  # a local transformers model folder encoding ``class_texts`` (one per class)
    class_texts: tuple[str, ...] = ()
    head_tau: float = 0.07  # cosine heads: logits = cos / tau
    train_projector: bool = False  # cosine heads: P trains (SiFT's 'TrainableProj' ablation)
    sam_prompt: str = "whole-image"  # litemedsam segmentation: whole-image | box (models/litemedsam.py)
    input_norm: str = "auto"  # auto | imagenet | min-max | mean-std (models/normalisation.py)
    encoded_inputs: bool = False  # the model takes its encoder's output, not images (frozen-encoder mode)

    def __post_init__(self) -> None:
        # Accept "qkv,fc2" strings and lists (run configs) but keep the spec hashable; "" means default.
        targets = self.adapter_targets.split(",") if isinstance(self.adapter_targets, str) else self.adapter_targets
        object.__setattr__(self, "adapter_targets", tuple(t.strip() for t in targets if t.strip()))
        unet = is_unet(self.backbone)  # U-Net baselines (models/unet.py) are smp models, not timm backbones
        if not unet:
            resolve_backbone(self.backbone)
        if self.adapter not in ADAPTERS:
            raise ModelError(f"unknown adapter {self.adapter!r}; choose one of {list(ADAPTERS)}")
        if not isinstance(self.weights, str) or not self.weights:
            raise ModelError(
                f"weights must be one of {list(WEIGHT_MODES)} or a path to a local weights file, got {self.weights!r}"
            )
        _check(self.task in TASKS, "task", self.task, f"one of {list(TASKS)}")
        _check(self.head in HEADS, "head", self.head, f"one of {list(HEADS)}")
        _check(self.head_tau > 0, "head_tau", self.head_tau, "> 0")
        _check(self.sam_prompt in PROMPTS, "sam_prompt", self.sam_prompt, f"one of {list(PROMPTS)}")
        _check(self.input_norm in INPUT_NORMS, "input_norm", self.input_norm, f"one of {list(INPUT_NORMS)}")
        if self.sam_prompt != "whole-image" and (self.backbone != "litemedsam" or self.task != "segmentation"):
            raise ModelError(
                f"sam_prompt={self.sam_prompt!r} prompts SAM's mask decoder, which only backbone 'litemedsam' "
                f"segments with (task {self.task!r}, backbone {self.backbone!r})"
            )
        if self.backbone == "litemedsam":
            from .litemedsam import check_img_size

            check_img_size(self.img_size)
        object.__setattr__(self, "class_texts", tuple(self.class_texts))
        _check(self.img_size >= 1, "img_size", self.img_size, "an integer >= 1")
        _check(self.patch_size >= 0, "patch_size", self.patch_size, "0 (backbone default) or an integer >= 1")
        _check(self.lora_rank >= 1, "lora_rank", self.lora_rank, "an integer >= 1")
        _check(0.0 <= self.lora_dropout < 1.0, "lora_dropout", self.lora_dropout, "in [0, 1)")
        _check(self.n_frequency >= 1, "n_frequency", self.n_frequency, "an integer >= 1")
        _check(self.bottleneck_ratio > 0.0, "bottleneck_ratio", self.bottleneck_ratio, "> 0")
        if unet:
            check_unet_spec(self)


def _check(ok: bool, field: str, value: object, valid: str) -> None:
    if not ok:
        raise ModelError(f"{field}={value!r} is invalid; it must be {valid}")


# ----- U-Net baselines (models/unet.py builds them): the facts a spec is checked against
ADAPTER = "full"  # the only adapter of a U-Net: every parameter trains
OUTPUT_STRIDE = 32  # 5 downsamplings: inputs must be divisible by 32
RESNET_DEPTHS = (18, 34, 50, 101, 152)
# run-config backbone -> smp encoder
UNET_ENCODERS: dict[str, str] = {
    "unet": "vgg13_bn",
    "resunet": "resnet34",
    **{f"resunet-{d}": f"resnet{d}" for d in RESNET_DEPTHS},
}
UNET_BACKBONES = tuple(UNET_ENCODERS)


def is_unet(backbone: object) -> bool:
    """True for a U-Net baseline backbone name (``unet``, ``resunet``, ``resunet-<depth>``)."""
    return isinstance(backbone, str) and backbone in UNET_ENCODERS


def check_unet_spec(spec: ModelSpec) -> None:
    """Refuse what a U-Net baseline cannot be: ModelError naming the field and the valid value."""
    name = spec.backbone
    if spec.task != "segmentation":
        raise ModelError(f"backbone {name!r} is a segmentation model; it needs task='segmentation', got {spec.task!r}")
    if spec.adapter != ADAPTER:
        raise ModelError(
            f"backbone {name!r} trains every parameter: its adapter is {ADAPTER!r} (leave the run config's adapter "
            f"unset or set it to {ADAPTER!r}), got adapter={spec.adapter!r}"
        )
    if spec.weights not in ("none", "auto"):
        raise ModelError(
            f"backbone {name!r} starts from a seeded random init; weights must be 'none' or 'auto' (both random), "
            f"got {spec.weights!r}"
        )
    if spec.patch_size:
        raise ModelError(f"patch_size={spec.patch_size} applies to ViTs only; backbone {name!r} needs patch_size=0")
    if spec.head != "linear":
        raise ModelError(f"backbone {name!r} has its own segmentation head; head must be 'linear', got {spec.head!r}")
    check_img_size(name, spec.img_size)


def check_img_size(name: str, size: int) -> None:
    if size % OUTPUT_STRIDE:
        low = size // OUTPUT_STRIDE * OUTPUT_STRIDE
        hint = f"{low} or {low + OUTPUT_STRIDE}" if low else str(OUTPUT_STRIDE)
        raise ModelError(
            f"img_size={size} is not divisible by {OUTPUT_STRIDE}: backbone {name!r} downsamples 5 times, so its "
            f"input must be a multiple of {OUTPUT_STRIDE} (e.g. {hint})"
        )
