"""Backbone checkpoint files in the layouts the papers' backbones are distributed in (medflower/models/checkpoints.py).

Each test builds a small model with random weights, writes a checkpoint in the layout the official repository saves,
loads it through the path ``backbone-weights=<file>`` takes (``create_backbone(..., weights=path)`` ->
``load_weights_file``) and checks that every backbone tensor arrived.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import warnings
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed_nhwc
from timm.models.vision_transformer_sam import VisionTransformerSAM
from torch import nn

from medflower.config import _weights_check
from medflower.models import ModelError, PretrainedWeightsWarning, backbones
from medflower.models.backbones import create_backbone, load_weights_file
from medflower.models.checkpoints import read_checkpoint

VIT = "vit_tiny_patch16_224"
VIT_KW = dict(img_size=32, patch_size=8, seed=0)
# A two-block SAM image encoder: block 0 windowed, block 1 global (SAM ViT-B: 12 blocks, global 2, 5, 8, 11).
SAM_KW = dict(patch_size=8, embed_dim=32, depth=2, num_heads=2, window_size=2, global_attn_indexes=(1,))
SAM_KW.update(use_rel_pos=True, neck_chans=16, num_classes=0)


def randomized(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict random (zero-initialised ones too), loaded and returned."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            state[k] = torch.randint(0, 100, v.shape, generator=g).to(v.dtype)
        elif k.endswith("running_var"):
            state[k] = torch.rand(v.shape, generator=g) + 0.5
        else:
            state[k] = torch.randn(v.shape, generator=g)
    model.load_state_dict(state)
    return state


def vit_state(seed: int = 1, **kw) -> dict[str, torch.Tensor]:
    """A ViT-Tiny (32 px, patch 8) state dict in timm's names, with its 1000-class head."""
    return randomized(timm.create_model(VIT, img_size=32, patch_size=8, **kw), seed)


def assert_arrived(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of the backbone equals the saved one under the same (timm) name."""
    loaded = model.state_dict()
    assert set(loaded) <= set(expected), sorted(set(loaded) - set(expected))[:4]
    for k, v in loaded.items():
        assert torch.equal(v, expected[k]), k


def medflower_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("medflower") and r.levelno >= logging.WARNING]


def load_vit(path) -> nn.Module:
    model, source = create_backbone(VIT, weights=str(path), **VIT_KW)
    assert source == f"file:{path}"
    return model


# ------------------------------------------------------------------------------------------------------- timm


def test_timm_state_dict_wrapped_and_prefixed(tmp_path):
    state = vit_state()
    save_file(state, str(tmp_path / "vit.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, tmp_path / "vit.pth")
    torch.save({"model": state}, tmp_path / "vit.bin")
    for name in ("vit.safetensors", "vit.pth", "vit.bin"):
        assert_arrived(load_vit(tmp_path / name), state)
    assert read_checkpoint(tmp_path / "vit.pth").format == "timm"


# -------------------------------------------------------------------------------------------------------- SAM


def sam_original_layout(timm_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's samvit names -> segment-anything's (inverse of timm's checkpoint_filter_fn), with the prompt encoder
    and mask decoder the original file holds."""
    state = {"image_encoder." + k.replace("mlp.fc", "mlp.lin"): v for k, v in timm_state.items()}
    state["prompt_encoder.point_embeddings.0.weight"] = torch.randn(1, 256)
    state["prompt_encoder.mask_downscaling.0.weight"] = torch.randn(4, 1, 2, 2)
    state["mask_decoder.iou_token.weight"] = torch.randn(1, 256)
    state["mask_decoder.transformer.layers.0.self_attn.q_proj.weight"] = torch.randn(256, 256)
    return state


def test_sam_checkpoint(tmp_path):
    saved = randomized(VisionTransformerSAM(img_size=32, **SAM_KW), seed=1)
    original = sam_original_layout(saved)
    assert "image_encoder.blocks.0.mlp.lin1.weight" in original
    torch.save(original, tmp_path / "sam_vit_b_01ec64.pth")

    target = VisionTransformerSAM(img_size=32, **SAM_KW)
    checkpoint = load_weights_file(target, tmp_path / "sam_vit_b_01ec64.pth")
    assert checkpoint.format == "sam"
    assert set(checkpoint.dropped) == {k for k in original if not k.startswith("image_encoder.")}
    assert_arrived(target, saved)


def test_sam_checkpoint_at_another_size_is_resized(tmp_path):
    saved = randomized(VisionTransformerSAM(img_size=64, **SAM_KW), seed=1)
    torch.save(sam_original_layout(saved), tmp_path / "medsam_vit_b.pth")
    target = VisionTransformerSAM(img_size=32, **SAM_KW)
    load_weights_file(target, tmp_path / "medsam_vit_b.pth")
    loaded = target.state_dict()
    resized = {"pos_embed", "blocks.1.attn.rel_pos_h", "blocks.1.attn.rel_pos_w"}  # block 1 attends globally
    assert loaded["pos_embed"].shape == (1, 4, 4, 32) and loaded["blocks.1.attn.rel_pos_h"].shape == (7, 16)
    assert torch.equal(loaded["pos_embed"], resample_abs_pos_embed_nhwc(saved["pos_embed"], [4, 4]))
    assert all(torch.equal(v, saved[k]) for k, v in loaded.items() if k not in resized)


def test_medsam_file_through_create_backbone(tmp_path):
    """A full-size SAM ViT-B file (as medsam_vit_b.pth) into the samvit_base_patch16 backbone at 64 px."""
    reference = timm.create_model("samvit_base_patch16", num_classes=0)
    g = torch.Generator().manual_seed(3)
    saved = {k: torch.randn(v.shape, generator=g) for k, v in reference.state_dict().items()}
    del reference
    torch.save(sam_original_layout(saved), tmp_path / "medsam_vit_b.pth")
    model, _ = create_backbone(
        "samvit_base_patch16", img_size=64, patch_size=0, weights=str(tmp_path / "medsam_vit_b.pth"), seed=0
    )
    for k, v in model.state_dict().items():
        if k == "pos_embed" or ("rel_pos" in k and v.shape != saved[k].shape):  # resized to the 4x4 grid
            assert v.shape[-1] == saved[k].shape[-1], k
        else:
            assert torch.equal(v, saved[k]), k


def test_sam_checkpoint_needs_a_sam_backbone(tmp_path):
    saved = randomized(VisionTransformerSAM(img_size=32, **SAM_KW), seed=1)
    torch.save(sam_original_layout(saved), tmp_path / "sam.pth")
    with pytest.raises(ModelError, match=r"sam\.pth.*format sam.*samvit_base_patch16"):
        load_vit(tmp_path / "sam.pth")


# ------------------------------------------------------------------------------------------------ MAE / RETFound


def mae_decoder(dim: int = 16) -> dict[str, torch.Tensor]:
    """The decoder tensors MAE's models_mae.MaskedAutoencoderViT saves next to the encoder."""
    return {
        "mask_token": torch.randn(1, 1, dim),
        "decoder_embed.weight": torch.randn(dim, 192),
        "decoder_embed.bias": torch.randn(dim),
        "decoder_pos_embed": torch.randn(1, 17, dim),
        "decoder_blocks.0.norm1.weight": torch.randn(dim),
        "decoder_blocks.0.attn.qkv.weight": torch.randn(3 * dim, dim),
        "decoder_norm.weight": torch.randn(dim),
        "decoder_pred.weight": torch.randn(8 * 8 * 3, dim),
    }


def test_mae_retfound_checkpoint(tmp_path):
    encoder = {k: v for k, v in vit_state().items() if not k.startswith("head.")}  # MAE has no head
    checkpoint = {
        "model": {**encoder, **mae_decoder()},
        "optimizer": {"state": {}, "param_groups": [{"lr": 1.5e-4, "params": [0, 1]}]},
        "epoch": 799,
        "scaler": {"scale": 65536.0},
        "args": argparse.Namespace(model="mae_vit_large_patch16", mask_ratio=0.75, output_dir="./out"),
    }
    torch.save(checkpoint, tmp_path / "RETFound_mae_natureCFP.pth")
    assert_arrived(load_vit(tmp_path / "RETFound_mae_natureCFP.pth"), encoder)
    read = read_checkpoint(tmp_path / "RETFound_mae_natureCFP.pth")
    assert read.format == "mae" and set(read.dropped) == set(mae_decoder())


def test_finetuned_checkpoint_with_fc_norm_loads_with_a_warning(tmp_path, caplog):
    """A RETFound fine-tuned file (global pooling: fc_norm instead of norm, and a head): the tolerated kind."""
    state = vit_state()
    state["fc_norm.weight"], state["fc_norm.bias"] = state.pop("norm.weight"), state.pop("norm.bias")
    torch.save({"model": state}, tmp_path / "RETFound_finetuned.pth")
    with caplog.at_level(logging.WARNING, logger="medflower"):
        model = load_vit(tmp_path / "RETFound_finetuned.pth")
    assert re.search(r"2 backbone tensor\(s\) not in the file .*norm\.weight, norm\.bias", caplog.text)
    random_norm = {"norm.weight": model.norm.weight, "norm.bias": model.norm.bias}  # keeps its random init
    assert_arrived(model, {**state, **random_norm})


# ------------------------------------------------------------------------------------------------------- DINO


def test_dino_backbone_file(tmp_path):
    encoder = {k: v for k, v in vit_state().items() if not k.startswith("head.")}
    torch.save(encoder, tmp_path / "dino_vitbase16_pretrain.pth")
    assert_arrived(load_vit(tmp_path / "dino_vitbase16_pretrain.pth"), encoder)


@pytest.mark.parametrize("teacher_prefix", ["backbone.", "module.backbone."])
def test_dino_training_checkpoint_takes_the_teacher(tmp_path, teacher_prefix):
    teacher = {k: v for k, v in vit_state(seed=1).items() if not k.startswith("head.")}
    student = {k: v for k, v in vit_state(seed=2).items() if not k.startswith("head.")}
    head = {"head.mlp.0.weight": torch.randn(64, 192), "head.last_layer.weight_g": torch.randn(65536, 1)}
    head_prefix = teacher_prefix.replace("backbone.", "")
    checkpoint = {
        "student": {
            **{f"module.backbone.{k}": v for k, v in student.items()},
            **{f"module.{k}": v for k, v in head.items()},
        },
        "teacher": {
            **{teacher_prefix + k: v for k, v in teacher.items()},
            **{head_prefix + k: v for k, v in head.items()},
        },
        "optimizer": {"state": {}, "param_groups": []},
        "epoch": 100,
        "args": argparse.Namespace(arch="vit_base", patch_size=16, out_dim=65536),
        "dino_loss": {"center": torch.zeros(1, 65536)},
    }
    torch.save(checkpoint, tmp_path / "checkpoint.pth")
    assert_arrived(load_vit(tmp_path / "checkpoint.pth"), teacher)
    read = read_checkpoint(tmp_path / "checkpoint.pth")
    assert read.format == "dino" and set(read.dropped) == set(head)


# ------------------------------------------------------------------------------------------- torchvision ResNet


@pytest.mark.parametrize("counters", [True, False], ids=["current", "without-num-batches-tracked"])
def test_torchvision_resnet_file(tmp_path, caplog, counters):
    state = randomized(torchvision.models.resnet18(), seed=4)
    if not counters:  # the old resnet50-19c8e357.pth style
        state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "resnet18-f37072fd.pth")
    with caplog.at_level(logging.WARNING, logger="medflower"):
        model, _ = create_backbone(
            "resnet18", img_size=32, patch_size=0, weights=str(tmp_path / "resnet18-f37072fd.pth"), seed=0
        )
    assert not medflower_records(caplog)  # a clean fit: no warning
    loaded = model.state_dict()
    for k, v in loaded.items():
        if counters or not k.endswith("num_batches_tracked"):
            assert torch.equal(v, state[k]), k
    assert not any(k.startswith("fc.") for k in loaded)


# ------------------------------------------------------------------------------------------- Hugging Face cache


def hf_cache(root: Path, repo_id: str, state: dict[str, torch.Tensor]) -> Path:
    """A hub cache as huggingface_hub writes it: the file in blobs/, a relative link in snapshots/<hash>/."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    save_file(state, str(repo / "blobs" / "e3b0c442"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    os.symlink("../../blobs/e3b0c442", repo / "snapshots" / "abc" / "model.safetensors")
    return repo


def test_hugging_face_cache_folder(tmp_path):
    state = vit_state()
    repo_id = timm.models.get_pretrained_cfg(VIT).hf_hub_id  # timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k
    repo = hf_cache(tmp_path / "hf" / "hub", repo_id, state)
    hf_cache(tmp_path / "hf" / "hub", "timm/resnet18.a1_in1k", {"conv1.weight": torch.zeros(1)})  # another model
    for folder in (tmp_path / "hf", tmp_path / "hf" / "hub", repo, repo / "snapshots" / "abc"):
        assert _weights_check(str(folder)) is None, folder
        assert_arrived(load_vit(folder), state)
    (tmp_path / "empty").mkdir()
    assert "holds no weights file" in _weights_check(str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="holds no weights file"):
        load_vit(tmp_path / "empty")


def test_hugging_face_cache_picks_the_architecture(tmp_path, caplog):
    state = vit_state()
    hf_cache(tmp_path, "timm/vit_tiny_patch16_224.augreg_in21k", state)  # another tag than the backbone's default
    with caplog.at_level(logging.WARNING, logger="medflower"):
        assert_arrived(load_vit(tmp_path), state)
    assert "another pretrained tag" in caplog.text
    hf_cache(tmp_path, "timm/vit_tiny_patch16_224.orig_in21k", state)
    with pytest.raises(ModelError, match=r"2 repos of architecture 'vit_tiny_patch16_224'"):
        load_vit(tmp_path)
    (tmp_path / "blobs-lost").mkdir()
    repo = hf_cache(tmp_path / "blobs-lost", "timm/x", state)
    for blob in (repo / "blobs").iterdir():
        blob.unlink()
    assert "link whose target is missing" in _weights_check(str(repo))


# ------------------------------------------------------------------------------------------------- mismatches


def test_mismatched_files_name_format_missing_unexpected_and_shapes(tmp_path):
    shallow = vit_state(depth=10)  # two blocks short
    save_file(shallow, str(tmp_path / "shallow.safetensors"))
    with pytest.raises(ModelError) as err:
        load_vit(tmp_path / "shallow.safetensors")
    message = str(err.value)
    assert "shallow.safetensors" in message and "format timm" in message
    assert "24 of 150 backbone tensors missing from the file (blocks.10.norm1.weight, blocks.10.norm1.bias" in message
    assert "(19 more)" in message and "0 file tensors the backbone lacks" in message

    deep = vit_state(depth=13)
    deep.pop("norm.weight")
    torch.save({"model": {**deep, **mae_decoder()}}, tmp_path / "deep_mae.pth")
    with pytest.raises(ModelError) as err:
        load_vit(tmp_path / "deep_mae.pth")
    message = str(err.value)
    assert "deep_mae.pth" in message and "format mae" in message and "'model' entry" in message
    assert "1 of 150 backbone tensors missing from the file (norm.weight)" in message
    assert "12 file tensors the backbone lacks (blocks.12.norm1.weight" in message

    small = vit_state()
    small["blocks.3.mlp.fc1.weight"] = torch.zeros(10, 192)
    torch.save(small, tmp_path / "shape.pth")
    with pytest.raises(
        ModelError,
        match=r"1 with the wrong shape: blocks\.3\.mlp\.fc1\.weight: file \(10, 192\) vs backbone \(768, 192\)",
    ):
        load_vit(tmp_path / "shape.pth")


def test_unsafe_pickle_is_refused_with_a_remedy(tmp_path):
    torch.save({"model": nn.Linear(2, 2)}, tmp_path / "module.pth")
    with pytest.raises(ModelError, match=r"module\.pth.*Python objects.*re-save its tensors"):
        load_vit(tmp_path / "module.pth")


# ---------------------------------------------------------------------------------------------------- warnings


def test_random_init_warning_once_per_process(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(backbones, "_WARNED_RANDOM", set())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="medflower"):
        warnings.simplefilter("always")
        for _ in range(3):
            create_backbone(VIT, weights="auto", **VIT_KW)
    random_warnings = [w for w in caught if issubclass(w.category, PretrainedWeightsWarning)]
    assert len(random_warnings) == 1 and "RANDOM INITIALISATION" in str(random_warnings[0].message)
    assert not medflower_records(caplog)  # not also logged: it used to print twice
