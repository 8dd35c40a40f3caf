"""A foundation-model stand-in: pretrain a backbone centrally on images no site of the federation holds, and write
its weights for the run-config key `backbone-weights` (docs/models.md#a-stand-in-pretrained-on-real-images).

Nothing can be downloaded here, so the papers' foundation weights (SAM, RETFound, DINO) are out of reach; this
trains the next best thing from local sets: a folder, manifest, MedMNIST file or volume folder (any `dataset`
the run config takes, e.g. the public sets a given federation does not use; `--dataset` given several times pools
them for the self-supervised objectives), or a synthetic pool of another data seed. Three objectives:

- `supervised` (default): the data's own task, classification (cross-entropy) or segmentation (BCE + Dice), every
  backbone parameter trained, the head or decoder thrown away;
- `contrastive`: self-supervised, labels unused. Two augmented views of each image (random crop, flips, rotation,
  intensity jitter: the training augmentation of docs/data.md#augmentation) are pulled together and pushed away
  from the other images of the batch with SimCLR's NT-Xent loss (Chen et al., ICML 2020) on a linear projection
  of the pooled features;
- `mim`: self-supervised masked-image modelling as SimMIM (Xie et al., CVPR 2022): a random 60 % of the patch
  tokens are replaced by a learned mask token and a linear head regresses their normalised pixels (L1 on the masked
  patches only, the paper's Eq. 1). ViT backbones only (the masking acts on timm's patch tokens).

It writes the timm backbone's weights (no decoder, head or projection) as safetensors, with the command and the
per-epoch history in the file's metadata.

    python -m medflower.pretrain --out outputs/weights/vit-tiny-32-synthetic-seg.safetensors
    python -m medflower.pretrain --dataset 'segfolder:/data/polyp' --objective contrastive --img-size 64 \\
        --out outputs/weights/vit-tiny-64-polyp-contrastive.safetensors
    python -m medflower.pretrain --objective mim --dataset segfolder:data/ph2 --dataset medmnist:pneumoniamnist \\
        --img-size 64 --out outputs/weights/vit-tiny-64-pool-mim.safetensors

Why an encoder must be pretrained for FedBKD: its feature-consistency loss pulls each site's features towards
the global encoder's. Against a randomly initialised global encoder that is a pull towards noise; in a trial
(4 rounds, the experiment's federation) the classification site stayed at chance with it and learned without it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from .data import DataSpec, load_client_data, make_loader
from .models import build_model
from .models.backbones import backbone_family, resolve_backbone
from .models.errors import ModelError
from .models.spec import ModelSpec, is_unet
from .training.loops import OptimizerSpec, evaluate, train_epochs

VIEWS = "crop:0.6,flip,rotate:15,jitter:0.4"  # SimCLR-style views from the training augmentation
PROJECTION_DIM = 128
MASK_RATIO = 0.6  # SimMIM's default
TEMPERATURE = 0.2


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """SimCLR's NT-Xent loss (Chen et al. 2020, Eq. 1) of two views' projections [B, D]: each view's positive is
    the other view of its image, the 2B - 2 views of other images are negatives. Written out because it is a few
    lines of torch; no project dependency ships it."""
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    logits = z @ z.T / temperature
    logits.fill_diagonal_(float("-inf"))  # a view is not its own negative
    n = len(z1)
    positives = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return torch.nn.functional.cross_entropy(logits, positives)


class ImagePool(torch.utils.data.ConcatDataset):
    """The images of one or more datasets' splits for the self-supervised objectives, each resized to ``img_size``
    on its own and given three channels (sets of different sizes and channel counts pool); labels and masks are
    dropped."""

    def __init__(self, datasets, img_size: int):
        super().__init__([dataset for dataset in datasets if len(dataset)])
        self.img_size = img_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from .data.transforms import image_batch

        image = image_batch([super().__getitem__(index)[0]], self.img_size)[0]  # [C, S, S], 0..255
        return image.expand(3, -1, -1).permute(1, 2, 0).contiguous(), 0


class SimMIM(torch.nn.Module):
    """SimMIM (Xie et al., CVPR 2022) around a timm ViT: masked patch tokens are replaced by a learned token and a
    linear head regresses the masked patches' normalised pixels. Written out because timm ships the encoders but
    no masked-image-modelling objective; the mask acts on the ViT's own patch tokens (the paper masks 32-px
    patches of 192-px images; at the small sizes here a token is the natural unit)."""

    def __init__(self, backbone: torch.nn.Module, mask_ratio: float = MASK_RATIO):
        super().__init__()
        self.backbone = backbone
        self.patch = backbone.patch_embed.patch_size[0]
        self.mask_ratio = mask_ratio
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 1, backbone.embed_dim))
        torch.nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = torch.nn.Linear(backbone.embed_dim, self.patch * self.patch * 3)

    def random_mask(self, batch: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
        """[B, N] bool, exactly round(ratio * N) tokens of each image masked, uniformly at random."""
        ranks = torch.rand(batch, tokens, generator=generator).argsort(1).argsort(1)
        return ranks < max(1, round(self.mask_ratio * tokens))

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, N, p*p*3] in the patch embedding's row-major token order."""
        b, c, h, w = x.shape
        p = self.patch
        return x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), -1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SimMIM's loss (Eq. 1): mean absolute error over the masked patches' pixels only."""
        vit = self.backbone
        tokens = vit.patch_embed(x)
        weight = mask.unsqueeze(-1).to(tokens.dtype)
        tokens = tokens * (1 - weight) + self.mask_token.to(tokens.dtype) * weight
        hidden = vit.norm(vit.blocks(vit.norm_pre(vit.patch_drop(vit._pos_embed(tokens)))))
        error = (self.head(hidden[:, vit.num_prefix_tokens :]) - self.patchify(x)).abs().mean(-1)
        return (error * mask).sum() / mask.sum()


def contrastive_objective(model: torch.nn.Module, seed: int, device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Batch (0..255) -> NT-Xent between two augmented views of each image; the views are drawn from ``seed``."""
    from .data.augment import Augmenter
    from .data.transforms import normalise

    views = Augmenter(VIEWS, seed)

    def loss(x: torch.Tensor) -> torch.Tensor:
        first, _ = views(x)
        second, _ = views(x)
        return nt_xent(model(normalise(first).to(device)), model(normalise(second).to(device)))

    return loss


def mim_objective(model: SimMIM, seed: int, device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Batch (0..255) -> SimMIM's masked L1; the masks are drawn from ``seed``."""
    from .data.transforms import normalise

    generator = torch.Generator().manual_seed(seed)

    def loss(x: torch.Tensor) -> torch.Tensor:
        x = normalise(x)
        tokens = (x.shape[-1] // model.patch) * (x.shape[-2] // model.patch)
        return model(x.to(device), model.random_mask(len(x), tokens, generator).to(device))

    return loss


def _image_loader(dataset: ImagePool, batch_size: int, shuffle: bool, seed: int):
    from torch.utils.data import DataLoader

    from .data.transforms import image_batch

    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=shuffle and len(dataset) > batch_size,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=lambda batch: image_batch([item[0] for item in batch], None),
    )


def self_supervised_epochs(
    model, objective, dataset: ImagePool, *, epochs: int, batch_size: int, lr: float, seed: int, device, after_epoch
) -> None:
    """Train ``model`` (the backbone and the objective's projection or pixel head) on ``objective(model, seed,
    device)``: AdamW, one loss per batch of at least two images."""
    loss_of = objective(model, seed, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.to(device)
    for epoch in range(1, epochs + 1):
        model.train()
        for x in _image_loader(dataset, batch_size, True, seed + epoch):
            if len(x) < 2:
                continue
            loss = loss_of(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
        after_epoch(epoch)


@torch.no_grad()
def self_supervised_loss(model, objective, dataset: ImagePool, batch_size: int, seed: int, device) -> float:
    """Mean objective over a split with fixed views or masks (the seed), for the per-epoch history."""
    model.eval()
    loss_of = objective(model, seed, device)
    losses = [float(loss_of(x)) for x in _image_loader(dataset, batch_size, False, seed) if len(x) >= 2]
    return sum(losses) / max(len(losses), 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with the message on a bad one)."""
    parser = argparse.ArgumentParser(prog="python -m medflower.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/weights/vit-tiny-32-synthetic-seg.safetensors"))
    parser.add_argument(
        "--dataset",
        action="append",
        help="any run-config dataset: synthetic-seg (default), synthetic, medmnist:<flag> (with --data-dir), "
        "csv:<manifest>, segfolder:<root>, volumes:<root>; several pool their images (contrastive and mim only)",
    )
    parser.add_argument("--data-dir", default="data", help="folder of <flag>.npz for medmnist:<flag>")
    parser.add_argument("--mask-values", default="", help="run-config mask-values for the data's masks")
    parser.add_argument("--objective", default="supervised", choices=("supervised", "contrastive", "mim"))
    parser.add_argument("--backbone", default="vit-tiny")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=3000, help="images in the synthetic pretraining pool")
    parser.add_argument("--data-seed", type=int, default=1000, help="must differ from the experiments' seeds")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    args.dataset = args.dataset or ["synthetic-seg"]
    if is_unet(args.backbone):
        parser.error(
            f"--backbone {args.backbone}: the U-Net baselines train from random initialisation, as in FedSCA's "
            "comparison; pretrain a ViT or Swin encoder"
        )
    if args.objective == "supervised" and len(args.dataset) > 1:
        parser.error(
            f"--objective supervised trains one dataset's own task; {len(args.dataset)} datasets were given "
            "(pool them with --objective contrastive or mim)"
        )
    if args.objective == "mim":
        try:
            family = backbone_family(resolve_backbone(args.backbone))
        except ModelError as err:
            parser.error(f"--backbone {args.backbone}: {err}")
        if family != "vit":
            parser.error(
                f"--backbone {args.backbone}: --objective mim masks a ViT's patch tokens; a {family} backbone has none"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sets = [
        load_client_data(
            DataSpec(
                dataset=dataset,
                data_dir=args.data_dir,
                mask_values=args.mask_values,
                partition="iid",
                img_size=args.img_size,
                seed=args.data_seed,
                synthetic_size=args.size,
                val_fraction=0.1,
                test_fraction=0.1,
            ),
            0,
            1,
        )
        for dataset in args.dataset
    ]
    data = sets[0]
    spec = ModelSpec(
        backbone=args.backbone,
        adapter="full",
        img_size=args.img_size,
        patch_size=args.patch_size,
        weights="none",
        seed=args.data_seed,
        task=data.task if args.objective == "supervised" else "classification",
    )
    # contrastive: the classifier's linear head is the projection g(h) of SimCLR, dropped with the head afterwards
    model = build_model(spec, data.num_classes if args.objective == "supervised" else PROJECTION_DIM)
    backbone = model.backbone
    history = []
    if args.objective == "supervised":
        val = data.val if len(data.val) > 1 else data.test
    else:
        objective = contrastive_objective if args.objective == "contrastive" else mim_objective
        if args.objective == "mim":
            model = SimMIM(backbone)
        train = ImagePool([s.train for s in sets], args.img_size)
        val = ImagePool([s.val if len(s.val) > 1 else s.test for s in sets], args.img_size)
        print(f"pretraining on {len(train)} images ({len(val)} for validation) from {', '.join(args.dataset)}")

    def report(epoch: int) -> None:
        if args.objective == "supervised":
            metrics = evaluate(model, make_loader(val, args.batch_size, False, 0), device, data.class_names)
        else:
            loss = self_supervised_loss(model, objective, val, args.batch_size, args.data_seed, device)
            metrics = {"val_nt_xent" if args.objective == "contrastive" else "val_mim_l1": loss}
        history.append({"epoch": epoch, **{k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}})
        print(json.dumps(history[-1]), flush=True)

    torch.manual_seed(args.data_seed)
    if args.objective == "supervised":
        train_epochs(
            model,
            make_loader(data.train, args.batch_size, True, args.data_seed),
            epochs=args.epochs,
            optimizer=OptimizerSpec("adamw", args.lr),
            device=device,
            after_epoch=report,
        )
    else:
        self_supervised_epochs(
            model,
            objective,
            train,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.data_seed,
            device=device,
            after_epoch=report,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in backbone.state_dict().items()}
    save_file(
        state,
        str(args.out),
        metadata={"pretraining": json.dumps({**vars(args), "out": str(args.out), "history": history})},
    )
    print(f"wrote {args.out} ({len(state)} tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
