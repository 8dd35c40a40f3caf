"""A foundation-model stand-in for experiments that need a pretrained encoder (FedBKD's; its paper starts every
site from RETFound). Nothing can be downloaded here, so this trains the backbone centrally on a `synthetic-seg`
(default) or `synthetic` pool that no site of the experiments holds: another data seed, hence other images and
other acquisition styles. It writes the timm backbone's weights (no decoder or head) as safetensors, for the
run-config key `backbone-weights`. The default is segmentation: on the 8-class `synthetic` task a centrally
trained encoder reaches accuracy 1.0 in two epochs, which would leave a classification site nothing to learn.

    python -m medflower.pretrain --out outputs/weights/vit-tiny-32-synthetic-seg.safetensors

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
from .training.loops import OptimizerSpec, evaluate, train_epochs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medflower.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/weights/vit-tiny-32-synthetic-seg.safetensors"))
    parser.add_argument("--dataset", default="synthetic-seg", choices=("synthetic-seg", "synthetic"))
    parser.add_argument("--backbone", default="vit-tiny")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=3000, help="images in the pretraining pool")
    parser.add_argument("--data-seed", type=int, default=1000, help="must differ from the experiments' seeds")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_client_data(
        DataSpec(
            dataset=args.dataset,
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
        task=data.task,
    )
    model = build_model(spec, data.num_classes)
    history = []

    def report(epoch: int) -> None:
        metrics = evaluate(model, make_loader(data.val, args.batch_size, False, 0), device, data.class_names)
        history.append({"epoch": epoch, **{k: round(v, 4) for k, v in metrics.items()}})
        print(json.dumps(history[-1]), flush=True)

    torch.manual_seed(args.data_seed)
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
