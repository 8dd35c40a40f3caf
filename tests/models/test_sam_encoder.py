"""SAM image encoders (timm ``samvit_*``) as the segmentation encoder: aliases, builds below 1024 px with resized
position tables, weights from a file at SAM's own size, Medical-SAM-Adapter placement of the bottleneck adapters,
LoRA on SAM's qkv, LAT's order, the parameter table of docs/models.md, and sgca/lat rounds in process.

A full SAM ViT-B is built only at 64 px; the rest uses a toy SAM registered with timm below (SAM's architecture at
width 32), which run configs can name like any timm model."""

import importlib.util

import numpy as np
import pytest
import timm
import torch
from helpers import ROOT, records, run_dir_of
from safetensors.torch import save_file
from timm.models import build_model_with_cfg, register_model
from timm.models import vision_transformer_sam as vts

from medflower.inprocess import run_inprocess
from medflower.models import (
    AdaptedSegmenter,
    ModelError,
    ModelSpec,
    PretrainedWeightsWarning,
    adapter_modules,
    build_model,
    lowest_adapter_names,
    resolve_backbone,
)
from medflower.models.backbones import _resize_sam_tables, backbone_family, create_backbone

TINY_SAM = "samvit_tinytest_patch16"
TINY_ARGS = dict(
    patch_size=16,
    embed_dim=32,
    depth=4,
    num_heads=2,
    global_attn_indexes=(1, 3),
    window_size=2,
    use_rel_pos=True,
    img_size=128,
    neck_chans=16,
)


def samvit_tinytest_patch16(pretrained=False, **kwargs):
    """SAM's encoder at toy width: 4 blocks, global attention in blocks 1 and 3 and 2x2 windows in 0 and 2, a
    16-channel neck; its own size is 128 px (SAM's is 1024)."""
    return build_model_with_cfg(
        vts.VisionTransformerSAM,
        TINY_SAM,
        pretrained,
        pretrained_filter_fn=vts.checkpoint_filter_fn,
        **dict(TINY_ARGS, **kwargs),
    )


# Registered under timm's SAM module, so that medflower sees the family 'samvit' and run configs can name it.
samvit_tinytest_patch16.__module__ = vts.__name__
if not timm.is_model(TINY_SAM):
    register_model(samvit_tinytest_patch16)

SEG = dict(weights="none", task="segmentation")


def _randomise_position_tables(model, seed=0):
    """Random absolute and relative position tables (SAM initialises both to zero), so resizing shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "pos_embed" or "rel_pos" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


# ------------------------------------------------------------------------------------------ aliases and builds


def test_sam_aliases_name_timm_sam_encoders_of_family_samvit():
    assert resolve_backbone("sam-b") == "samvit_base_patch16"
    assert resolve_backbone("sam-l") == "samvit_large_patch16"
    assert resolve_backbone("sam-h") == "samvit_huge_patch16"
    assert resolve_backbone("medsam") == "samvit_base_patch16"  # MedSAM: SAM ViT-B's architecture
    for name in ("samvit_base_patch16", "samvit_large_patch16", "samvit_huge_patch16", TINY_SAM):
        assert backbone_family(name) == "samvit"


@pytest.mark.parametrize("size", [64, 256])
def test_sam_b_builds_below_1024_px_with_its_position_tables_at_that_size(size):
    """timm builds the position embedding and the global blocks' relative tables for img_size; windowed blocks keep
    their 14x14 window tables (27 rows); global attention stays in blocks 2, 5, 8, 11."""
    model, source = create_backbone("samvit_base_patch16", img_size=size, patch_size=0, weights="none", seed=0)
    grid = size // 16
    assert source == "random" and tuple(model.patch_embed.grid_size) == (grid, grid)
    assert model.pos_embed.shape == (1, grid, grid, 768)
    global_blocks = [i for i, b in enumerate(model.blocks) if b.window_size == 0]
    assert global_blocks == [2, 5, 8, 11]
    for i, block in enumerate(model.blocks):
        rows = 2 * grid - 1 if i in global_blocks else 2 * 14 - 1
        assert block.attn.rel_pos_h.shape == block.attn.rel_pos_w.shape == (rows, 64)
    if size == 64:  # one forward of the full ViT-B (at 256 the narrow SAM-B geometry below runs instead)
        with torch.no_grad():
            assert model.forward_features(torch.randn(1, 3, size, size)).shape == (1, 256, grid, grid)


@pytest.mark.parametrize("size", [64, 256])
def test_resized_tables_compute_what_timm_computes_on_the_fly_at_sam_b_geometry(size):
    """SAM ViT-B's geometry (12 blocks, window 14, global 2/5/8/11, 1024 px) at width 32: the encoder built at
    1024 and run at ``size`` (timm resizes the tables on every forward) equals the one resized once."""
    geometry = dict(embed_dim=32, num_heads=2, neck_chans=16, num_classes=0)
    torch.manual_seed(0)
    native = timm.create_model("samvit_base_patch16", **geometry).eval()
    _randomise_position_tables(native)
    resized = timm.create_model("samvit_base_patch16", **geometry).eval()
    resized.load_state_dict(native.state_dict())
    _resize_sam_tables(resized, size)
    grid = size // 16
    assert resized.pos_embed.shape == (1, grid, grid, 32)
    assert resized.blocks[2].attn.rel_pos_h.shape == (2 * grid - 1, 16)
    assert resized.blocks[0].attn.rel_pos_h.shape == (27, 16)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(resized.forward_features(x), native.forward_features(x), rtol=1e-5, atol=1e-5)


def test_img_size_must_tile_into_16_px_patches():
    with pytest.raises(ModelError, match="multiple of the patch size 16"):
        create_backbone(TINY_SAM, img_size=72, patch_size=0, weights="none", seed=0)


# ---------------------------------------------------------------------------------------------- weights files


@pytest.mark.parametrize("layout", ["timm", "sam"])
def test_a_weights_file_at_sams_own_size_loads_and_is_resized(tmp_path, layout):
    """A checkpoint at the architecture's size (SAM: 1024 px; here 128) loads into an encoder for 64 px. ``sam`` is
    the layout of SAM's and MedSAM's own checkpoints (``image_encoder.*``, ``mlp.lin1``, plus prompt encoder and
    mask decoder keys), which timm's checkpoint filter renames."""
    torch.manual_seed(1)
    native = timm.create_model(TINY_SAM, num_classes=0).eval()
    _randomise_position_tables(native)
    state = {k: v for k, v in native.state_dict().items() if not k.startswith("head")}
    if layout == "sam":
        state = {"image_encoder." + k.replace("mlp.fc", "mlp.lin"): v for k, v in state.items()}
        state["mask_decoder.iou_token.weight"] = torch.zeros(1, 256)
        path = tmp_path / "medsam_like.pth"
        torch.save(state, path)
    else:
        path = tmp_path / "sam_like.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    model, source = create_backbone(TINY_SAM, img_size=64, patch_size=0, weights=str(path), seed=0)
    assert source == f"file:{path}"
    assert model.pos_embed.shape == (1, 4, 4, 32) and tuple(model.patch_embed.grid_size) == (4, 4)
    assert model.blocks[1].attn.rel_pos_h.shape == (7, 16)  # global block: 2 * 4 - 1 rows
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval().forward_features(x), native.forward_features(x), rtol=1e-5, atol=1e-5)


def test_auto_without_cached_weights_falls_back_to_the_same_random_encoder_as_none():
    with pytest.warns(PretrainedWeightsWarning, match="RANDOM"):
        auto, source = create_backbone(TINY_SAM, img_size=64, patch_size=0, weights="auto", seed=3)
    none, _ = create_backbone(TINY_SAM, img_size=64, patch_size=0, weights="none", seed=3)
    assert source == "random"
    a, b = auto.state_dict(), none.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_medsam_needs_its_weights_from_a_file():
    for task in ("segmentation", "classification"):  # a classifier would otherwise load SAM's under MedSAM's name
        with pytest.raises(ModelError, match="MedSAM's checkpoint as a local file"):
            build_model(ModelSpec(backbone="medsam", adapter="bottleneck", img_size=64, task=task), 1)
    from medflower.config import ConfigError, ExperimentConfig, defaults

    with pytest.raises(ConfigError, match="'backbone-weights' = 'auto' is invalid: backbone 'medsam'"):
        ExperimentConfig.from_run_config({**defaults(), "backbone": "medsam", "backbone-weights": "auto"})


# ----------------------------------------------------------------------------------------- the SAM segmenter


@pytest.fixture(scope="module")
def sam_b():
    return build_model(ModelSpec(backbone="sam-b", adapter="bottleneck", img_size=64, **SEG), 2)


def test_sam_b_segmenter_reads_the_neck_and_trains_only_adapters_and_decoder(sam_b):
    assert isinstance(sam_b, AdaptedSegmenter) and sam_b.family == "samvit"
    assert sam_b.decoder.proj.in_channels == 256  # the neck's 256 channels, SAM's image embedding
    assert len(sam_b.decoder.stages) == 4  # 1/16 -> full resolution
    with torch.no_grad():
        assert sam_b(torch.randn(2, 3, 64, 64)).shape == (2, 2, 64, 64)
    names = sam_b.trainable_names()
    assert all(".adapter_" in n or n.startswith("decoder.") for n in names)
    frozen = [n for n, p in sam_b.named_parameters() if not p.requires_grad]
    assert any(n.startswith("backbone.neck.") for n in frozen) and "backbone.pos_embed" in frozen
    trainable = {id(p) for p in sam_b.trainable_parameters().values()}
    assert all(p.requires_grad == (id(p) in trainable) for p in sam_b.parameters())


def test_lat_order_on_sam_b_is_block_depth_then_attention_before_mlp(sam_b):
    names = sam_b.trainable_names()
    groups = adapter_modules(names)
    expected = [f"backbone.blocks.{i}.adapter_{side}" for i in range(12) for side in ("attn", "mlp")]
    assert list(groups) == expected  # blocks.10 after blocks.9; neck and decoder are no adapter module
    lowest = lowest_adapter_names(names, 1)
    assert lowest == [f"backbone.blocks.0.adapter_attn.{p}.{t}" for p in ("down", "up") for t in ("weight", "bias")]
    assert set(lowest_adapter_names(names, "all")) == {n for n in names if not n.startswith("decoder.")}


def test_the_sam_adapter_table_in_docs_is_computed_from_the_model():
    spec = importlib.util.spec_from_file_location("backbone_speed", ROOT / "benchmarks" / "backbone_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    counts = bench.sam_adapter_counts(0.25)
    assert (counts["module"], counts["modules"], counts["lat"]) == (2 * 768 * 192 + 192 + 768, 24, counts["module"])
    assert bench.param_table(0.25) in (ROOT / "docs" / "models.md").read_text()


# ------------------------------------------------------------------------------ Medical-SAM-Adapter placement


def _tiny_pair(adapter):
    adapted = build_model(ModelSpec(backbone=TINY_SAM, adapter=adapter, img_size=64, **SEG), 1).eval()
    plain = build_model(ModelSpec(backbone=TINY_SAM, adapter="none", img_size=64, **SEG), 1).eval()
    theirs = {k.replace(".base_layer", ""): v for k, v in adapted.backbone.state_dict().items()}  # peft's wrapper
    assert all(torch.equal(v, theirs[k]) for k, v in plain.backbone.state_dict().items())  # same frozen encoder
    return adapted, plain


def _msa_encoder(plain_backbone, adapted_backbone, x):
    """Medical-SAM-Adapter's AdapterBlock.forward (2-D) on timm's SAM blocks, with the adapted model's adapters."""
    enc = plain_backbone
    x = enc.patch_embed(x) + enc.pos_embed
    x = enc.norm_pre(x)
    for block, adapted in zip(enc.blocks, adapted_backbone.blocks):
        space, mlp_adapter = adapted.adapter_attn, adapted.adapter_mlp
        b, h, w, _ = x.shape
        shortcut = x
        t = block.norm1(x)
        if block.window_size > 0:
            t, pad = vts.window_partition(t, block.window_size)
        t = block.attn(t)
        t = t + space(t)  # Space_Adapter: on the attention output, with its skip connection
        if block.window_size > 0:
            t = vts.window_unpartition(t, block.window_size, (h, w), pad)
        x = shortcut + t
        xn = block.norm2(x)
        x = x + block.mlp(xn) + 0.5 * mlp_adapter(xn)  # MLP_Adapter: beside the MLP, scale 0.5
    return enc.neck(x.permute(0, 3, 1, 2))


def test_bottleneck_adapters_sit_where_medical_sam_adapter_puts_them():
    adapted, plain = _tiny_pair("bottleneck")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(adapted.feature_grid(x), plain.feature_grid(x), rtol=0, atol=0)  # up = 0 at init
        gen = torch.Generator().manual_seed(0)
        for name, p in adapted.backbone.named_parameters():
            if ".adapter_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        got = adapted.feature_grid(x)
        assert not torch.allclose(got, plain.feature_grid(x), atol=1e-3)
        torch.testing.assert_close(got, _msa_encoder(plain.backbone, adapted.backbone, x), rtol=1e-5, atol=1e-5)
        for block in adapted.backbone.blocks:  # zero up-projections: exactly the plain encoder again
            for module in (block.adapter_attn, block.adapter_mlp):
                module.up.weight.zero_()
                module.up.bias.zero_()
        torch.testing.assert_close(adapted.feature_grid(x), plain.feature_grid(x), rtol=0, atol=0)


def test_only_adapters_and_decoder_get_gradients():
    model = build_model(ModelSpec(backbone=TINY_SAM, adapter="bottleneck", img_size=64, **SEG), 1).train()
    model(torch.randn(2, 3, 64, 64)).square().mean().backward()
    trainable = set(model.parameter_paths().values())
    for name, p in model.named_parameters():
        if name in trainable:
            assert p.grad is not None, name
        else:
            assert p.grad is None, name
    assert any(n.startswith("backbone.blocks.0.adapter_attn.") for n in trainable)


def test_lora_defaults_to_sams_qkv_and_starts_as_the_plain_encoder():
    adapted, plain = _tiny_pair("lora")
    groups = adapter_modules(adapted.trainable_names())
    assert list(groups) == [f"backbone.blocks.{i}.attn.qkv" for i in range(4)]
    assert lowest_adapter_names(adapted.trainable_names(), 1) == [
        "backbone.blocks.0.attn.qkv.lora_A.weight",
        "backbone.blocks.0.attn.qkv.lora_B.weight",
    ]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(adapted.feature_grid(x), plain.feature_grid(x))


# --------------------------------------------------------------------------------------- federated, in process


@pytest.mark.parametrize("strategy", ["sgca", "lat"])
def test_one_round_with_a_sam_encoder_sends_only_its_lowest_adapter(tiny, strategy):
    config = tiny(
        strategy=strategy,
        backbone=TINY_SAM,
        dataset="synthetic-seg",
        adapter="bottleneck",
        partition="natural",
        **{
            "img-size": 64,
            "synthetic-size": 96,
            "num-rounds": 1,
            "batch-size": 16,
            "sgca-solver": "closed-form",
            "run-name": strategy,
        },
    )
    summary, grid = run_inprocess(config, num_nodes=2)
    assert set(summary["per_client"]) == {"site-0", "site-1"}
    for values in summary["per_client"].values():
        assert 0.0 <= values["dice"] <= 1.0
    lowest = {f"backbone.blocks.0.adapter_attn.{p}.{t}" for p in ("down", "up") for t in ("weight", "bias")}
    sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert sent and all(set(m.content["arrays"].keys()) == lowest for m in sent)
    assert len(records(run_dir_of(config), "server")) == 1
    assert np.isfinite(summary["final"]["loss"])


def test_auto_loads_cached_weights_at_sams_own_size_then_resizes(tmp_path, monkeypatch):
    """timm's pretrained loading is strict at the built size and its SAM filter resizes nothing: ``auto`` builds at
    the architecture's size, loads, then resizes (as for SAM's sa1b weights in the local cache)."""
    from medflower.models import backbones

    torch.manual_seed(2)
    native = timm.create_model(TINY_SAM, num_classes=0).eval()
    _randomise_position_tables(native, seed=2)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in native.state_dict().items()}, str(path))
    cached = (str(path), {"file": str(path), "source": None, "custom_load": False})
    monkeypatch.setattr(backbones, "cached_pretrained_file", lambda name: cached if name == TINY_SAM else None)
    model, source = create_backbone(TINY_SAM, img_size=64, patch_size=0, weights="auto", seed=0)
    assert source == f"pretrained:{path}" and model.pos_embed.shape == (1, 4, 4, 32)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval().forward_features(x), native.forward_features(x), rtol=1e-5, atol=1e-5)
