"""A foundation-model stand-in: pretrain a backbone centrally on images no site of the federation holds, and write
its weights for the run-config key `backbone-weights` (docs/models.md#a-stand-in-pretrained-on-real-images).

Nothing can be downloaded here, so the papers' foundation weights (SAM, RETFound, DINO) are out of reach; this
trains the next best thing from a local set: a folder, manifest, MedMNIST file or volume folder (any `dataset`
the run config takes, e.g. the public sets a given federation does not use), or a synthetic pool of another data
seed. Two objectives:

- `supervised` (default): the data's own task, classification (cross-entropy) or segmentation (BCE + Dice), every
  backbone parameter trained, the head or decoder thrown away;
- `contrastive`: self-supervised, labels unused. Two augmented views of each image (random crop, flips, rotation,
  intensity jitter: the training augmentation of docs/data.md#augmentation) are pulled together and pushed away
  from the other images of the batch with SimCLR's NT-Xent loss (Chen et al., ICML 2020) on a linear projection
  of the pooled features.

It writes the timm backbone's weights (no decoder, head or projection) as safetensors, with the command and the
per-epoch history in the file's metadata.

    python -m medflower.pretrain --out outputs/weights/vit-tiny-32-synthetic-seg.safetensors
    python -m medflower.pretrain --dataset 'segfolder:/data/polyp' --objective contrastive --img-size 64 \\
        --out outputs/weights/vit-tiny-64-polyp-contrastive.safetensors

Why an encoder must be pretrained for FedBKD: its feature-consistency loss pulls each site's features towards
the global encoder's. Against a randomly initialised global encoder that is a pull towards noise; in a trial
(4 rounds, the experiment's federation) the classification site stayed at chance with it and learned without it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .data import DataSpec, load_client_data, make_loader
from .models import build_model
from .models.spec import ModelSpec
from .models.unet import is_unet
from .training.loops import OptimizerSpec, evaluate, train_epochs

VIEWS = "crop:0.6,flip,rotate:15,jitter:0.4"  # SimCLR-style views from the training augmentation
PROJECTION_DIM = 128
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


def contrastive_epochs(
    model, dataset, *, epochs: int, batch_size: int, lr: float, seed: int, device, after_epoch
) -> None:
    """Train ``model`` (backbone + linear projection head) on NT-Xent between two augmented views of each image."""
    from torch.utils.data import DataLoader

    from .data.augment import Augmenter
    from .data.transforms import image_batch, normalise, target_img_size

    size = target_img_size(dataset)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=len(dataset) > batch_size,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=lambda batch: image_batch([item[0] for item in batch], size),
    )
    views = Augmenter(VIEWS, seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.to(device)
    for epoch in range(1, epochs + 1):
        model.train()
        for x in loader:
            if len(x) < 2:
                continue
            first, _ = views(x)
            second, _ = views(x)
            loss = nt_xent(model(normalise(first).to(device)), model(normalise(second).to(device)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        after_epoch(epoch)


@torch.no_grad()
def contrastive_loss(model, dataset, batch_size: int, seed: int, device) -> float:
    """Mean NT-Xent over a split with fixed views (the seed), for the per-epoch history."""
    from .data.augment import Augmenter
    from .data.transforms import image_batch, normalise, target_img_size

    model.eval()
    views = Augmenter(VIEWS, seed)
    size = target_img_size(dataset)
    losses = []
    for start in range(0, len(dataset) - 1, batch_size):
        x = image_batch([dataset[i][0] for i in range(start, min(start + batch_size, len(dataset)))], size)
        if len(x) < 2:
            continue
        first, _ = views(x)
        second, _ = views(x)
        losses.append(float(nt_xent(model(normalise(first).to(device)), model(normalise(second).to(device)))))
    return sum(losses) / max(len(losses), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medflower.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/weights/vit-tiny-32-synthetic-seg.safetensors"))
    parser.add_argument(
        "--dataset",
        default="synthetic-seg",
        help="any run-config dataset: synthetic-seg, synthetic, medmnist:<flag> (with --data-dir), csv:<manifest>, "
        "segfolder:<root>, volumes:<root>",
    )
    parser.add_argument("--data-dir", default="data", help="folder of <flag>.npz for medmnist:<flag>")
    parser.add_argument("--mask-values", default="", help="run-config mask-values for the data's masks")
    parser.add_argument("--objective", default="supervised", choices=("supervised", "contrastive"))
    parser.add_argument("--backbone", default="vit-tiny")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=3000, help="images in the synthetic pretraining pool")
    parser.add_argument("--data-seed", type=int, default=1000, help="must differ from the experiments' seeds")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    if is_unet(args.backbone):
        parser.error(
            f"--backbone {args.backbone}: the U-Net baselines train from random initialisation, as in FedSCA's "
            "comparison; pretrain a ViT or Swin encoder"
        )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_client_data(
        DataSpec(
            dataset=args.dataset,
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
    history = []
    val = data.val if len(data.val) > 1 else data.test

    def report(epoch: int) -> None:
        if args.objective == "contrastive":
            metrics = {"val_nt_xent": contrastive_loss(model, val, args.batch_size, args.data_seed, device)}
        else:
            metrics = evaluate(model, make_loader(val, args.batch_size, False, 0), device, data.class_names)
        history.append({"epoch": epoch, **{k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}})
        print(json.dumps(history[-1]), flush=True)

    torch.manual_seed(args.data_seed)
    if args.objective == "contrastive":
        contrastive_epochs(
            model,
            data.train,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.data_seed,
            device=device,
            after_epoch=report,
        )
    else:
        train_epochs(
            model,
            make_loader(data.train, args.batch_size, True, args.data_seed),
            epochs=args.epochs,
            optimizer=OptimizerSpec("adamw", args.lr),
            device=device,
            after_epoch=report,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.backbone.state_dict().items()}
    save_file(
        state,
        str(args.out),
        metadata={"pretraining": json.dumps({**vars(args), "out": str(args.out), "history": history})},
    )
    print(f"wrote {args.out} ({len(state)} tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
