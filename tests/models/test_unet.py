"""U-Net and ResU-Net baselines (models/unet.py): smp builds, the model contract, LAT's stages, one round each."""

import numpy as np
import pytest
import torch

from medflower.config import ConfigError, ExperimentConfig
from medflower.inprocess import run_inprocess
from medflower.models import ModelError, ModelSpec, adapter_modules, build_model, lowest_adapter_names
from medflower.models.unet import UNET_BACKBONES, UNetSegmenter
from medflower.training import bce_dice_loss
from medflower.training.loops import OptimizerSpec, train_epochs


def spec(backbone="unet", **overrides):
    return ModelSpec(**{"backbone": backbone, "adapter": "full", "img_size": 32, "weights": "none", **overrides})


def seg_spec(backbone="unet", **overrides):
    return spec(backbone, task="segmentation", **overrides)


# smp encoder, trainable parameters with K = 2 structures (docs/models.md#u-net-baselines), first stage's modules
BUILDS = {
    "unet": ("vgg13_bn", 18_444_578, ["features.0", "features.1", "features.3", "features.4"]),
    "resunet": ("resnet34", 24_436_514, ["conv1", "bn1"]),
}


@pytest.mark.parametrize("backbone", list(BUILDS))
def test_builds_one_logit_map_per_structure_at_the_input_size(backbone):
    encoder, count, _ = BUILDS[backbone]
    model = build_model(seg_spec(backbone), 2)
    assert isinstance(model, UNetSegmenter) and model.encoder_name == encoder and model.task == "segmentation"
    assert sum(p.numel() for p in model.parameters()) == count
    assert all(p.requires_grad for p in model.parameters())  # adapter 'full': every parameter trains
    model.eval()
    for size in (32, 64):
        out = model(torch.randn(2, 3, size, size))
        assert out.shape == (2, 2, size, size)  # K sigmoid channels, no background channel
    one = build_model(seg_spec(backbone), 1).eval()
    assert one.num_classes == 1 and one(torch.randn(1, 3, 32, 32)).shape == (1, 1, 32, 32)
    masks = torch.zeros(2, 32, 32, dtype=torch.int64)
    masks[:, 4:12, 4:12] = 1
    masks[1, 20:, 20:] = 2
    assert bce_dice_loss(model(torch.randn(2, 3, 32, 32)), masks).item() > 0  # the project's BCE + Dice applies


@pytest.mark.parametrize("backbone", list(BUILDS))
def test_build_is_deterministic_for_a_seed_and_arrays_round_trip(backbone):
    a, b = build_model(seg_spec(backbone), 2), build_model(seg_spec(backbone), 2)
    other = build_model(seg_spec(backbone, seed=1), 2)
    arrays_a, arrays_other = a.get_trainable(), other.get_trainable()
    assert list(arrays_a) == a.trainable_names() == list(a.trainable_spec())
    for (ka, va), (kb, vb) in zip(arrays_a.items(), b.get_trainable().items()):
        assert ka == kb
        np.testing.assert_array_equal(va, vb)
    assert any(not np.array_equal(arrays_a[k], arrays_other[k]) for k in arrays_a)
    assert {k: (v.shape, "float32") for k, v in arrays_a.items()} == dict(a.trainable_spec())
    # forward order: encoder stages by depth, decoder, head, then the BatchNorm statistics (docs/models.md)
    names = list(arrays_a)
    kinds = [n.split(".", 1)[0] for n in names]
    assert kinds == sorted(kinds, key=["backbone", "decoder", "head", "statistics"].index)
    stages = [int(n.split(".")[2]) for n in names if n.startswith("backbone.")]
    assert stages == sorted(stages) and set(stages) == {0, 1, 2, 3, 4}
    assert all(n.endswith((".running_mean", ".running_var")) for n in names if n.startswith("statistics."))
    assert any(n.startswith("statistics.backbone.") for n in names) and any(n.startswith("head.") for n in names)
    # parameter_paths name real parameters (what torch.func.functional_call takes)
    params = dict(a.named_parameters())
    assert set(a.parameter_paths().values()) == set(params)
    for clean, raw in a.parameter_paths().items():
        assert arrays_a[clean].shape == tuple(params[raw].shape)
    # round trip: another seed's model given a's arrays (statistics included) computes a's function
    x = torch.randn(2, 3, 32, 32)
    a.eval(), other.eval()
    assert not torch.allclose(a(x), other(x))
    other.set_trainable(arrays_a)
    torch.testing.assert_close(other(x), a(x))
    for k, v in other.get_trainable().items():
        np.testing.assert_array_equal(v, arrays_a[k])
    with pytest.raises(ModelError, match="missing"):
        other.set_trainable({k: v for k, v in arrays_a.items() if k != names[0]})


def test_batchnorm_statistics_train_and_travel():
    model = build_model(seg_spec("resunet-18"), 1)
    before = model.get_trainable()
    data = [(torch.randn(4, 3, 32, 32), torch.randint(0, 2, (4, 32, 32)))]
    train_epochs(model, data, epochs=1, optimizer=OptimizerSpec("adam", 1e-3), device=torch.device("cpu"))
    after = model.get_trainable()
    stat = "statistics.backbone.bn1.running_mean"
    assert stat in after and not np.allclose(after[stat], before[stat])  # BatchNorm trained in train mode
    model.set_trainable(before)
    np.testing.assert_array_equal(model.get_trainable()[stat], before[stat])  # and every message sets them back


def test_img_size_not_divisible_by_32_is_refused():
    for size in (48, 16, 100):
        with pytest.raises(ModelError, match="divisible by 32"):
            seg_spec(img_size=size)
    model = build_model(seg_spec("resunet-18"), 1)
    with pytest.raises(ModelError, match="32"):
        model(torch.randn(1, 3, 48, 48))


def test_other_adapters_tasks_and_weights_are_refused():
    for adapter in ("lora", "bottleneck", "none"):
        with pytest.raises(ModelError, match="adapter is 'full'"):
            seg_spec(adapter=adapter)
    with pytest.raises(ModelError, match="segmentation"):
        spec("resunet", task="classification")
    with pytest.raises(ModelError, match="'none' or 'auto'"):
        seg_spec(weights=__file__)
    with pytest.raises(ModelError, match="ViTs only"):
        seg_spec(patch_size=8)
    seg_spec(weights="auto")  # 'auto' is the run config's default: random init as well


def test_run_config_selects_the_baselines_by_backbone(tiny):
    for backbone in UNET_BACKBONES:
        cfg = ExperimentConfig.from_run_config(
            tiny(backbone=backbone, dataset="synthetic-seg", partition="natural", **{"img-size": 32})
        )
        model_spec = cfg.model_spec()
        assert (model_spec.backbone, model_spec.adapter, model_spec.patch_size) == (backbone, "full", 0)
    with pytest.raises(Exception, match="unet, resunet, resunet-18"):
        ExperimentConfig.from_run_config(tiny(backbone="resunet-20"))
    with pytest.raises(ConfigError, match="backbone 'unet' trains every parameter; leave adapter unset or set 'full'"):
        ExperimentConfig.from_run_config(
            tiny(
                backbone="unet", dataset="synthetic-seg", partition="natural", adapter="bottleneck", **{"img-size": 32}
            )
        )


@pytest.mark.parametrize("backbone", list(BUILDS))
def test_lat_modules_are_the_encoder_stages_shallowest_first(backbone):
    model = build_model(seg_spec(backbone), 2)
    names = model.trainable_names()
    groups = adapter_modules(names)
    assert list(groups) == [f"backbone.stages.{s}" for s in range(5)]
    first = lowest_adapter_names(names, 1)
    assert first == model.stage_names(0) == groups["backbone.stages.0"]
    # exactly the parameters of the encoder's first stage
    _, _, modules = BUILDS[backbone]
    paths = model.parameter_paths()
    expected = {f"backbone.{m}.{n}" for m in modules for n, _ in model.backbone.get_submodule(m).named_parameters()}
    assert {paths[n] for n in first} == expected
    assert lowest_adapter_names(names, 2) == [*first, *model.stage_names(1)]
    assert not any(n.startswith(("decoder.", "head.", "statistics.")) for n in lowest_adapter_names(names, "all"))


# ----------------------------------------------------------------------------- one round in process
def seg_round(tiny, strategy, **extra):
    return tiny(
        **{
            "strategy": strategy,
            "dataset": "synthetic-seg",
            "partition": "natural",
            "backbone": "resunet-18",
            "img-size": 32,
            "num-rounds": 1,
            "synthetic-size": 160,
            "lr": 3e-3,
            "run-name": strategy,
            **extra,
        }
    )


def train_messages(grid):
    return [m for m in grid.sent if m.metadata.message_type == "train"]


@pytest.mark.parametrize(
    "strategy, extra", [("fedavg", {}), ("fedprox", {"proximal-mu": 0.01}), ("local", {}), ("lat", {"lat-layers": 1})]
)
def test_one_round_of_each_baseline_segments_and_reports_dice(tiny, strategy, extra):
    summary, grid = run_inprocess(seg_round(tiny, strategy, **extra), num_nodes=2)
    assert set(summary["per_client"]) == {"site-0", "site-1"}
    assert summary["communication"]["failed_replies"] == 0 and summary["communication"]["rejected_replies"] == 0
    for values in summary["per_client"].values():
        assert 0.0 <= values["dice"] <= 1.0 and 0.0 <= values["iou"] <= 1.0
    model = build_model(seg_spec("resunet-18"), 2)
    sent = [list(m.content["arrays"].keys()) for m in train_messages(grid) if "arrays" in m.content.array_records]
    if strategy == "lat":
        # only the first encoder stage travels (conv1 + bn1 of the stem); BatchNorm statistics stay on the site
        assert sent and all(names == model.stage_names(0) for names in sent)
        stem = ["conv1/weight", "bn1/weight", "bn1/bias"]
        assert model.stage_names(0) == [f"backbone.stages.0.{n}" for n in stem]
        assert summary["communication"]["bytes_up"] == 2 * 4 * (64 * 3 * 7 * 7 + 64 + 64)
    elif strategy in ("fedavg", "fedprox"):
        assert sent and all(names == model.trainable_names() for names in sent)  # statistics included


def test_the_vgg_unet_runs_a_fedavg_round(tiny):
    summary, _ = run_inprocess(seg_round(tiny, "fedavg", backbone="unet", **{"synthetic-size": 96}), num_nodes=2)
    assert all(0.0 <= v["dice"] <= 1.0 for v in summary["per_client"].values())


def test_run_config_refuses_a_u_net_for_transformer_only_strategies_and_lets_lat_share_stages():
    from medflower.config import defaults

    def config(**overrides):
        base = {**defaults(), "dataset": "synthetic-seg", "partition": "natural", "img-size": 32}
        base = {**base, "backbone": "resunet-18", **overrides}
        return ExperimentConfig.from_run_config(base)

    assert config(strategy="lat", adapter="full").backbone == "resunet-18"  # a U-Net's only adapter is 'full'
    with pytest.raises(ConfigError, match="'backbone' = 'resunet-18' is invalid: strategy 'fedbkd' builds 'full'"):
        config(strategy="fedbkd", **{"site-datasets": ""})
    with pytest.raises(ConfigError, match="'adapter' = 'bottleneck' is invalid: backbone 'resunet-18' trains every"):
        config(strategy="fedavg", adapter="bottleneck")
