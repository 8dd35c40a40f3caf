"""Client-level differential privacy (docs/privacy.md): clipping, the noise's calibration, the accountant against
an independent library and the closed-form RDP bound, bad run configs, and whole runs in both modes."""

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from helpers import records, run_dir_of
from safetensors.numpy import load_file

from medflower.config import ConfigError, ExperimentConfig
from medflower.inprocess import run_inprocess
from medflower.privacy import (
    PrivacyLedger,
    PrivateTraining,
    clipped,
    dp_sgd_epsilon,
    noised_mean,
    privatise_train_reply,
    privatise_update,
    update_norm,
)
from medflower.privacy.accounting import max_rounds_within, min_noise_within, planned_epsilon
from medflower.privacy.dp_sgd import batches_per_epoch
from medflower.records import from_record, to_record


def _arrays(rng, scale=1.0):
    return OrderedDict(
        (("a", rng.normal(0, scale, (4, 5)).astype(np.float32)), ("b", rng.normal(0, scale, 7).astype(np.float32)))
    )


# ----------------------------------------------------------------------------- clipping and noise
def test_clipping_bounds_the_whole_update_and_keeps_its_direction():
    rng = np.random.default_rng(0)
    update = _arrays(rng, scale=3.0)
    out = clipped(update, 0.5)
    assert update_norm(out) == pytest.approx(0.5)
    flat_in = np.concatenate([v.ravel() for v in update.values()])
    flat_out = np.concatenate([v.ravel() for v in out.values()])
    assert np.allclose(flat_out / np.linalg.norm(flat_out), flat_in / np.linalg.norm(flat_in), atol=1e-6)
    small = clipped(update, 1e6)  # within the bound: unchanged
    assert all(np.allclose(small[k], update[k]) for k in update)
    zero = clipped(OrderedDict(a=np.zeros(3)), 1.0)  # a site whose arrays did not move: no division by zero
    assert np.array_equal(zero["a"], np.zeros(3))


def test_site_noise_has_the_calibrated_standard_deviation():
    received = OrderedDict(w=np.zeros(400_000, dtype=np.float32))
    out = privatise_update(received, received, clipping_norm=0.2, noise_std=1.5 * 0.2, rng=np.random.default_rng(1))
    assert out["w"].dtype == np.float32
    assert np.std(out["w"]) == pytest.approx(0.3, rel=0.01)
    assert abs(np.mean(out["w"])) < 0.003


def test_site_reply_is_received_plus_clipped_update():
    rng = np.random.default_rng(2)
    received, sent = _arrays(rng), _arrays(rng, scale=10.0)
    out = privatise_update(received, sent, clipping_norm=1.0, noise_std=0.0)
    moved = OrderedDict((k, out[k].astype(np.float64) - received[k]) for k in received)
    assert update_norm(moved) == pytest.approx(1.0, rel=1e-5)
    # without a generator the noise comes from the OS's entropy: two privatisations never agree
    a = privatise_update(received, sent, 1.0, 0.1)
    b = privatise_update(received, sent, 1.0, 0.1)
    assert not np.array_equal(a["a"], b["a"])


def test_site_reply_that_updates_nothing_received_is_refused():
    rng = np.random.default_rng(3)
    received = _arrays(rng)
    with pytest.raises(ValueError, match="'c' updates nothing the site received"):
        privatise_update(received, OrderedDict(c=np.zeros(2, dtype=np.float32)), 1.0, 0.0)
    with pytest.raises(ValueError, match="shape"):
        privatise_update(received, OrderedDict(a=np.zeros(3, dtype=np.float32)), 1.0, 0.0)


def test_train_reply_hook_clips_in_site_mode_and_leaves_metrics_only_replies():
    rng = np.random.default_rng(4)
    received, trained = _arrays(rng), _arrays(rng, scale=5.0)
    message = RecordDict({"arrays": to_record(received), "config": ConfigRecord({"round": 1})})
    cfg = ExperimentConfig.from_run_config(
        {"dp": "site", "dp-clipping-norm": 0.1, "dp-noise-multiplier": 1e-9}, check_paths=False
    )
    out = privatise_train_reply(message, RecordDict({"arrays": to_record(trained)}), cfg)
    sent = from_record(out["arrays"])
    assert update_norm(OrderedDict((k, sent[k].astype(np.float64) - received[k]) for k in sent)) <= 0.1 + 1e-6
    metrics_only = RecordDict({})
    assert privatise_train_reply(message, metrics_only, cfg) is metrics_only


def test_server_mean_has_the_fixed_denominator_and_clips_every_reply():
    """dp='server': sent + Σ clip(Δ_k)/m + noise with m the sites asked; a site that sends an unclipped update gets
    clipped by the server anyway."""
    rng = np.random.default_rng(5)
    sent = _arrays(rng)
    honest = OrderedDict((k, v + 0.01) for k, v in sent.items())  # ‖Δ‖ = 0.01·√27 < C
    rogue = OrderedDict((k, v + 1e3) for k, v in sent.items())  # far beyond C
    out = noised_mean(sent, [honest, rogue], num_asked=3, clipping_norm=0.5, noise_multiplier=1e-12)
    rogue_dir = 1.0 / math.sqrt(27)  # the unit update of +1 everywhere
    for k in sent:
        expected = sent[k].astype(np.float64) + (0.01 + 0.5 * rogue_dir) / 3
        assert np.allclose(out[k], expected, atol=1e-6)
    big = OrderedDict(w=np.zeros(300_000, dtype=np.float32))
    noised = noised_mean(
        big, [big, big], num_asked=4, clipping_norm=2.0, noise_multiplier=1.0, rng=np.random.default_rng(6)
    )
    assert np.std(noised["w"]) == pytest.approx(2.0 / 4, rel=0.01)


# ----------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("z", [0.7, 1.0, 2.5])
@pytest.mark.parametrize("rounds", [1, 10, 60])
def test_accountant_agrees_with_opacus_and_the_closed_form_bound(z, rounds):
    """Flower's RDP accountant (dp-accounting) against Opacus's, an independent implementation, and against the
    classic conversion ε ≤ min_α T·α/(2z²) + log(1/δ)/(α−1) of the Gaussian mechanism's RDP (Mironov 2017),
    which the accountants' tighter conversion may only improve on."""
    from opacus.accountants import RDPAccountant

    delta = 1e-5
    ours = planned_epsilon(z, rounds, delta)
    opacus = RDPAccountant()
    opacus.history = [(z, 1.0, rounds)]
    assert ours == pytest.approx(opacus.get_epsilon(delta), rel=1e-3)
    alphas = np.linspace(1.01, 400, 200_000)
    classic = np.min(rounds * alphas / (2 * z**2) + math.log(1 / delta) / (alphas - 1))
    assert ours <= classic + 1e-9
    assert ours >= 0.5 * classic  # the same order: a broken accountant reporting ~0 would fail here
    assert planned_epsilon(z, rounds + 1, delta) > ours
    assert planned_epsilon(z * 1.5, rounds, delta) < ours


def test_the_suggested_noise_and_rounds_meet_the_target():
    target, delta = 4.0, 1e-5
    z = min_noise_within(target, 20, delta)
    assert planned_epsilon(z, 20, delta) <= target < planned_epsilon(z * 0.99, 20, delta)
    r = max_rounds_within(target, 2.0, delta)
    assert planned_epsilon(2.0, r, delta) <= target < planned_epsilon(2.0, r + 1, delta)


@pytest.mark.parametrize("mode, sensitivity", [("server", 1.0), ("site", 2.0)])
def test_ledger_stops_before_the_round_that_would_exceed_the_target(mode, sensitivity):
    z, delta = 1.0, 1e-5
    target = (planned_epsilon(z, 3, delta, sensitivity) + planned_epsilon(z, 4, delta, sensitivity)) / 2
    cfg = ExperimentConfig.from_run_config(
        {"dp": mode, "dp-noise-multiplier": z, "dp-target-epsilon": target, "num-rounds": 3}, check_paths=False
    )
    ledger = PrivacyLedger(cfg)
    for rnd in range(1, 4):
        assert ledger.allows_next_round()
        assert ledger.after_round({})["dp_epsilon"] == pytest.approx(planned_epsilon(z, rnd, delta, sensitivity))
    assert not ledger.allows_next_round()


# ----------------------------------------------------------------------------- bad run configs
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"dp": "site", "dp-noise-multiplier": 0.0}, r"'dp-noise-multiplier' = 0.0 is invalid: must be > 0"),
        ({"dp": "site", "dp-noise-multiplier": -1.0}, r"'dp-noise-multiplier' = -1.0 is invalid: must be > 0"),
        ({"dp": "site", "dp-noise-multiplier": float("inf")}, r"'dp-noise-multiplier' = inf .*finite"),
        ({"dp": "site", "dp-clipping-norm": float("nan")}, r"'dp-clipping-norm' = nan .*finite"),
        ({"dp": "server", "dp-clipping-norm": 0}, r"'dp-clipping-norm' = 0.0 is invalid: must be > 0"),
        ({"dp": "site", "dp-delta": 1.0}, r"'dp-delta' = 1.0 is invalid: must be in \(0, 1\)"),
        ({"dp": "laplace"}, r"'dp' = 'laplace' is invalid: valid choices are none, site, server"),
        (
            {"dp": "site", "strategy": "fedkei"},
            r"'dp' = 'site' is invalid: strategy 'fedkei' cannot use it.*"
            r"dp='site' works with fedavg, fedprox.*sgca",
        ),
        (
            {"dp": "server", "strategy": "sgca"},
            r"strategy 'sgca' cannot use it.*dp='server' works with fedavg, fedprox",
        ),
        (
            {"dp-target-epsilon": 2.0},
            r"'dp-target-epsilon' = 2.0 is invalid: a target ε needs dp='site', dp='server' or dp-sgd",
        ),
        (
            {"dp-sgd": True, "strategy": "fedbkd"},
            r"'dp-sgd' = True is invalid: strategy 'fedbkd' cannot use it.*"
            r"dp-sgd works with fedavg, fedprox, local",
        ),
        ({"dp-sgd": True, "dp-sgd-max-grad-norm": 0.0}, r"'dp-sgd-max-grad-norm' = 0.0 is invalid: must be > 0"),
        ({"dp-sgd": True, "dp-sgd-noise-multiplier": float("nan")}, r"'dp-sgd-noise-multiplier' = nan .*finite"),
        (
            {"dp": "server", "dp-target-epsilon": 5.0, "num-rounds": 10},
            r"'dp-target-epsilon' = 5.0 is invalid: the plan spends ε = 19.1 at dp-delta = 1e-05 \(10 rounds at "
            r"dp-noise-multiplier = 1, dp='server': sensitivity 1·C\); within the target: dp-noise-multiplier >= "
            r"3\.\d+, or num-rounds <= 1",
        ),
        (
            {"dp": "site", "dp-target-epsilon": 5.0, "num-rounds": 10},
            r"'dp-target-epsilon' = 5.0 is invalid: the plan spends ε = 48.8 at dp-delta = 1e-05 \(10 rounds at "
            r"dp-noise-multiplier = 1, dp='site': sensitivity 2·C\); within the target: dp-noise-multiplier >= "
            r"6\.\d+ \(not one round fits at this noise multiplier\)",
        ),
    ],
)
def test_bad_privacy_config_is_refused_before_round_1(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ExperimentConfig.from_run_config(overrides, check_paths=False)


# ----------------------------------------------------------------------------- whole runs
def test_site_mode_run_reports_epsilon_every_round_and_in_the_summary(tiny, caplog):
    z = 2.0
    config = tiny(**{"run-name": "dp-site", "dp": "site", "dp-noise-multiplier": z, "dp-clipping-norm": 0.5})
    summary, _ = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    server = records(run_dir, "server")
    # dp='site': replace-one (any two datasets of a site), sensitivity 2C against noise z·C
    assert [r["dp_epsilon"] for r in server] == pytest.approx([planned_epsilon(z, r, 1e-5, 2.0) for r in (1, 2, 3)])
    privacy = json.loads((run_dir / "summary.json").read_text())["privacy"]
    assert privacy == summary["privacy"]
    level = privacy["client_level"]
    assert level["epsilon"] == pytest.approx(planned_epsilon(z, 3, 1e-5, 2.0)) and level["rounds"] == 3
    assert level["neighbouring"].startswith("replace-one")
    assert f"ε = {level['epsilon']:.3f}** at δ = 1e-05 after 3 rounds" in (run_dir / "summary.md").read_text()
    assert "epsilon=" in caplog.text


def test_server_mode_moves_the_model_by_at_most_the_clipping_norm(tiny):
    config = tiny(
        **{
            "run-name": "dp-server",
            "dp": "server",
            "dp-noise-multiplier": 1e-9,
            "dp-clipping-norm": 0.05,
            "num-rounds": 2,
            "lr": 0.5,
        }
    )
    run_inprocess(config, num_nodes=3)
    ckpt = run_dir_of(config) / "checkpoint"
    first, second = (load_file(str(ckpt / f"round-00000{r}" / "arrays.safetensors")) for r in (1, 2))
    step = update_norm(OrderedDict((k, second[k].astype(np.float64) - first[k]) for k in first))
    assert 0.0 < step <= 0.05 + 1e-6  # the mean of three clipped updates (lr 0.5 moves each far beyond C)


def test_resumed_run_goes_on_counting_epsilon(tiny):
    z = 1.5
    common = {"dp": "site", "dp-noise-multiplier": z}
    part = tiny(**{"run-name": "dp-part", "num-rounds": 2, **common})
    run_inprocess(part, num_nodes=2)
    resumed = tiny(**{"run-name": "dp-resumed", "num-rounds": 3, "resume-from": str(run_dir_of(part)), **common})
    summary, _ = run_inprocess(resumed, num_nodes=2)
    assert summary["privacy"]["client_level"]["rounds"] == 3
    assert summary["privacy"]["client_level"]["epsilon"] == pytest.approx(planned_epsilon(z, 3, 1e-5, 2.0))


# ----------------------------------------------------------------------------- DP-SGD
def test_dp_sgd_step_is_the_mean_of_clipped_per_sample_gradients_plus_the_extra_term():
    """θ ← θ − lr·(Σ_i clip_C(∇ℓ_i)/B + ∇extra), with the per-sample gradients computed one sample at a time here."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, y = torch.randn(5, 4) * 3, torch.tensor([0, 1, 2, 1, 0])
    anchor = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    expected_grad = [torch.zeros_like(p) for p in params]
    for i in range(5):
        loss_i = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss_i, params)
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        for acc, g in zip(expected_grad, grads):
            acc += g * min(1.0, 0.3 / norm.item()) / 5
    mu = 0.7  # FedProx-style term: touches no sample
    for acc, (n, p) in zip(expected_grad, model.named_parameters()):
        acc += mu * (p.detach() - anchor[n])
    private = PrivateTraining(noise_multiplier=1e-9, max_grad_norm=0.3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    net, opt, _ = private.attach(model, torch.optim.SGD(params, lr=1.0), loader, torch.device("cpu"))
    task = torch.nn.functional.cross_entropy(net(x), y)
    extra = 0.5 * mu * sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
    private.step(opt, task, extra, params)
    private.close()
    for p, b, g in zip(params, before, expected_grad):
        assert torch.allclose(p.detach(), b - g, atol=1e-6)
    assert private.steps == 1 and private.sample_rate == 1.0
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())  # hooks gone


class _Masks(torch.utils.data.Dataset):
    """Six (uint8 HxWx3 image, uint8 HxW mask) items, as a site's segmentation split gives them."""

    img_size = 16

    def __len__(self):
        return 6

    def __getitem__(self, i):
        mask = np.zeros((16, 16), dtype=np.uint8)
        mask[i : i + 4, 2:8] = 1
        return np.full((16, 16, 3), 10 * i, dtype=np.uint8), mask


@pytest.mark.parametrize("encoded", [True, False])
def test_an_empty_first_poisson_batch_has_the_loaders_shapes_and_torch_dtypes(encoded):
    """Opacus builds an empty batch from the first one it collated, or, when the very first draw is empty, from the
    dataset's first item, whose numpy dtype (float16 for a cached encoder output) torch.zeros refused: a site's
    round failed with a TypeError (chance (1 - q)^n: 1 % for 21 images at q = 1/5). The DP loader has the loader's
    own empty batch now."""
    from medflower.data.encoded import EncodedDataset
    from medflower.data.transforms import make_loader

    split = _Masks()
    if encoded:
        split = EncodedDataset(split, np.random.default_rng(0).normal(size=(6, 4, 2, 2)).astype(np.float16))
    loader = make_loader(split, batch_size=2, shuffle=True, seed=0)
    model = torch.nn.Conv2d(4 if encoded else 3, 1, 1)
    private = PrivateTraining(noise_multiplier=1.0, max_grad_norm=1.0)
    _, _, dp_loader = private.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, torch.device("cpu"))
    x, y = dp_loader.collate_fn([])
    full_x, full_y = next(iter(make_loader(split, batch_size=2, shuffle=False, seed=0)))
    assert (x.dtype, y.dtype) == (full_x.dtype, full_y.dtype) == (torch.float32, torch.int64)
    assert x.shape == (0, *full_x.shape[1:]) and y.shape == (0, *full_y.shape[1:])
    batch = dp_loader.collate_fn([split[0], split[3]])  # a drawn batch is the loader's own
    assert all(torch.equal(a, b) for a, b in zip(batch, loader.collate_fn([split[0], split[3]])))
    private.close()


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"adapter": "ia3"}, r"ia3_l.default \(torch.nn.modules.container.ParameterDict\)"),
        ({"backbone": "resnet18", "adapter": "full"}, "BatchNorm"),
    ],
)
def test_dp_sgd_refuses_models_without_per_sample_gradients(tiny, overrides, named):
    config = tiny(**{"run-name": "dp-sgd-bad", "dp-sgd": True, **overrides})
    with pytest.raises(
        ConfigError, match=rf"'dp-sgd' = True is invalid: Opacus computes no per-sample gradient.*{named}"
    ):
        run_inprocess(config, num_nodes=2)


def test_dp_sgd_run_reports_each_sites_epsilon(tiny, caplog):
    z, batch = 1.2, 32
    config = tiny(**{"run-name": "dp-sgd", "dp-sgd": True, "dp-sgd-noise-multiplier": z, "num-rounds": 2})
    summary, _ = run_inprocess(config, num_nodes=2)
    train = records(run_dir_of(config), "train")
    for r in train:
        batches = batches_per_epoch(r["num-examples"], batch)  # as the site's training loader counts them
        assert r["dp_sgd_epsilon"] == pytest.approx(dp_sgd_epsilon(z, 1 / batches, r["round"] * batches, 1e-5))
    server = records(run_dir_of(config), "server")
    assert server[-1]["dp_sgd_epsilon"] == pytest.approx(max(r["dp_sgd_epsilon"] for r in train if r["round"] == 2))
    sgd = summary["privacy"]["dp_sgd"]
    assert set(sgd["epsilon_per_site"]) == {r["client"] for r in train}
    assert "DP-SGD (noise multiplier 1.2" in (run_dir_of(config) / "summary.md").read_text()
    assert "dp-sgd epsilon<=" in caplog.text
    assert math.isfinite(summary["final"]["auc"])


def test_dp_sgd_plan_beyond_the_target_is_refused_before_round_1(tiny):
    config = tiny(**{"run-name": "dp-sgd-target", "dp-sgd": True, "dp-target-epsilon": 0.5, "num-rounds": 3})
    with pytest.raises(ConfigError, match=r"'dp-target-epsilon' = 0.5 is invalid: with DP-SGD, site .* spends ε = "):
        run_inprocess(config, num_nodes=2)
    assert not (run_dir_of(config) / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize(
    "overrides",
    [{}, {"adapter": "bottleneck"}, {"adapter": "full"}, {"dataset": "synthetic-seg", "partition": "iid"}],
)
def test_dp_sgd_supports_the_vit_adapters_and_the_segmenter(overrides):
    """Every trainable parameter of these models gets a per-sample gradient from Opacus's hooks."""
    import dataclasses

    from opacus import GradSampleModule

    from medflower.models import build_model
    from medflower.privacy.dp_sgd import unsupported_layers

    cfg = ExperimentConfig.from_run_config(
        {"img-size": 16, "patch-size": 8, "backbone-weights": "none", **overrides}, check_paths=False
    )
    task = "segmentation" if "dataset" in overrides else "classification"
    model = build_model(dataclasses.replace(cfg.model_spec(["a", "b"]), task=task), 2)
    assert unsupported_layers(model, 16) == []
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(3, 3, 16, 16)).float().sum().backward()
    assert all(p.grad_sample.shape[0] == 3 for p in model.parameters() if p.requires_grad)
    wrapped._close()


def test_dp_sgd_trains_litemedsams_decoder_on_cached_encoder_outputs(tiny, tiny_litemedsam, tmp_path, monkeypatch):
    """The frozen-encoder mode's model takes encoder outputs: the per-sample-gradient probe feeds it those (it fed
    images and crashed), and SAM's mask-token table, read whole for every image so that no hook can split its
    gradient by image, keeps its pretrained values while the rest of the decoder trains under DP-SGD."""
    monkeypatch.setenv("MEDFLOWER_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny(
        **{"run-name": "dp-sgd-sam", "dp-sgd": True, "dataset": "synthetic-seg", "synthetic-size": 64},
        **{"strategy": "fedprox"},  # an extra loss term, whose plain gradient skips the kept table too
        **{"backbone": "litemedsam", "backbone-weights": str(tiny_litemedsam), "img-size": 32, "adapter": "none"},
        **{"frozen-encoder": "on", "num-rounds": 2, "batch-size": 4, "lr": 0.05},
    )
    run_inprocess(config, num_nodes=2)
    run_dir = run_dir_of(config)
    assert [r["num_failed"] for r in records(run_dir, "server")] == [0, 0]
    assert all(r["dp_sgd_epsilon"] > 0 for r in records(run_dir, "train"))
    rounds = sorted((run_dir / "checkpoint").glob("round-*"))
    first, last = (load_file(str(r / "arrays.safetensors")) for r in (rounds[0], rounds[-1]))
    tokens = [k for k in first if k.endswith("mask_tokens.weight")]
    assert len(tokens) == 1 and np.array_equal(first[tokens[0]], last[tokens[0]])
    assert any(not np.array_equal(first[k], last[k]) for k in first if k not in tokens)
