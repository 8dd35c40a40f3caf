"""The foundation-model stand-in on image files (medflower/pretrain.py): supervised and contrastive pretraining on a
folder or a manifest writes a backbone checkpoint that `backbone-weights` loads; NT-Xent against its definition."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from medflower.data.synthetic_seg import write_segfolder
from medflower.models.backbones import create_backbone
from medflower.pretrain import SimMIM, nt_xent
from medflower.pretrain import main as pretrain


def test_nt_xent_equals_its_definition():
    """SimCLR's Eq. 1: l(i, j) = -log exp(sim(z_i, z_j)/t) / sum_{k != i} exp(sim(z_i, z_k)/t), averaged over the
    2N views."""
    gen = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1).double()
    n, t = 4, 0.2
    total = 0.0
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        denominator = sum(math.exp(float(z[i] @ z[k]) / t) for k in range(2 * n) if k != i)
        total += -math.log(math.exp(float(z[i] @ z[j]) / t) / denominator)
    assert abs(float(nt_xent(z1, z2, t)) - total / (2 * n)) < 1e-5
    same = torch.randn(4, 5, generator=gen)
    assert float(nt_xent(same, same)) < float(nt_xent(same, torch.randn(4, 5, generator=gen)))


def saved(path):
    with safe_open(str(path), "pt") as f:
        history = json.loads(f.metadata()["pretraining"])["history"]
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return history, tensors


def loads_as_backbone(path, tensors):
    model, source = create_backbone("vit_tiny_patch16_224", img_size=16, patch_size=8, weights=str(path), seed=7)
    assert source == f"file:{path}" and not any(k.startswith(("head.", "decoder.")) for k in tensors)
    for name, tensor in model.state_dict().items():
        assert name in tensors and bool((tensor == tensors[name]).all()), name


def test_contrastive_pretraining_on_a_segmentation_folder_learns_and_writes_a_backbone(tmp_path):
    root = write_segfolder(tmp_path / "data", {"a": 0, "b": 1}, per_site=48, size=16, seed=3)
    out = tmp_path / "contrastive.safetensors"
    argv = ["--dataset", f"segfolder:{root}", "--objective", "contrastive", "--out", str(out)]
    assert pretrain([*argv, "--epochs", "4", "--img-size", "16", "--batch-size", "16", "--lr", "3e-3"]) == 0
    history, tensors = saved(out)
    losses = [h["val_nt_xent"] for h in history]
    assert len(losses) == 4 and losses[-1] < losses[0]  # the views of one image come together
    loads_as_backbone(out, tensors)


def test_supervised_pretraining_on_a_manifest_of_image_files(tmp_path):
    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for i in range(40):
        label = i % 2
        pixels = rng.integers(0, 60, (24, 24, 3)) + (150 if label else 0)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(tmp_path / f"im{i}.png")
        rows.append(f"im{i}.png,{label}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "supervised.safetensors"
    argv = ["--dataset", f"csv:{tmp_path / 'manifest.csv'}", "--out", str(out), "--epochs", "2"]
    assert pretrain([*argv, "--img-size", "16", "--batch-size", "8"]) == 0
    history, tensors = saved(out)
    assert history[-1]["accuracy"] >= 0.75  # bright vs dark images
    loads_as_backbone(out, tensors)


def tiny_vit():
    model, _ = create_backbone("vit_tiny_patch16_224", img_size=16, patch_size=8, weights="none", seed=0)
    return model


def test_simmim_targets_follow_the_patch_tokens_and_the_loss_counts_masked_patches_only():
    """SimMIM's Eq. 1: L = mean |y - x| over the pixels of the masked patches, each patch in its token's place."""
    mim = SimMIM(tiny_vit())
    x = torch.randn(2, 3, 16, 16)
    # token order: the patch embedding is a linear map of exactly the pixels patchify puts in that token's row
    conv = mim.backbone.patch_embed.proj
    weight = conv.weight.permute(0, 2, 3, 1).reshape(conv.out_channels, -1)  # [D, p, p, C] like patchify's rows
    by_conv = conv(x).flatten(2).transpose(1, 2)
    assert torch.allclose(mim.patchify(x) @ weight.T + conv.bias, by_conv, atol=1e-5)
    # masks: exactly round(0.6 * 4) = 2 of the 4 tokens of each image
    mask = mim.random_mask(2, 4, torch.Generator().manual_seed(0))
    assert mask.sum(1).tolist() == [2, 2]
    # a zero pixel head predicts 0, so the loss is the mean |x| over the masked patches, cut out by hand
    torch.nn.init.zeros_(mim.head.weight)
    torch.nn.init.zeros_(mim.head.bias)
    cut = []
    for b in range(2):
        for token in mask[b].nonzero().flatten().tolist():
            row, col = divmod(token, 2)
            cut.append(x[b, :, row * 8 : (row + 1) * 8, col * 8 : (col + 1) * 8].abs().mean())
    assert torch.allclose(mim(x, mask), torch.stack(cut).mean(), atol=1e-6)


def test_mim_pretraining_pools_sets_of_different_sizes_and_channels_and_learns(tmp_path):
    root = write_segfolder(tmp_path / "seg", {"a": 0}, per_site=40, size=16, seed=3)  # RGB 16 px
    rows = ["path,label"]
    for i in range(40):  # grayscale 24 px stripes
        pixels = np.zeros((24, 24), np.uint8)
        pixels[:, (i % 4) * 6 : (i % 4) * 6 + 6] = 220
        Image.fromarray(pixels).save(tmp_path / f"g{i}.png")
        rows.append(f"g{i}.png,{i % 2}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "mim.safetensors"
    argv = ["--objective", "mim", "--dataset", f"segfolder:{root}", "--dataset", f"csv:{tmp_path / 'manifest.csv'}"]
    assert (
        pretrain([*argv, "--out", str(out), "--epochs", "10", "--img-size", "16", "--batch-size", "16", "--lr", "1e-3"])
        == 0
    )
    history, tensors = saved(out)
    losses = [h["val_mim_l1"] for h in history]
    assert len(losses) == 10 and losses[-1] < 0.8 * losses[0]  # masked pixels become predictable
    assert not any(k.startswith(("mask_token", "head.")) for k in tensors)
    loads_as_backbone(out, tensors)


def test_pretraining_refuses_a_pooled_supervised_run_and_mim_without_patch_tokens(tmp_path, capsys):
    out = str(tmp_path / "w.safetensors")
    with pytest.raises(SystemExit):
        pretrain(["--dataset", "synthetic", "--dataset", "synthetic-seg", "--out", out])
    assert "--objective supervised trains one dataset's own task; 2 datasets" in capsys.readouterr().err
    resnet = ["--objective", "mim", "--backbone", "resnet18", "--patch-size", "0", "--size", "40", "--img-size", "16"]
    with pytest.raises(SystemExit):
        pretrain([*resnet, "--out", out])
    assert "--objective mim masks a ViT's patch tokens; a resnet backbone has none" in capsys.readouterr().err
