"""FedBKD's building blocks: saliency and the kept neurons, the sub-encoder's forward pass, the covered merge
and CKA (docs/methods/fedbkd.md)."""

import re
from collections import OrderedDict

import numpy as np
import pytest
import timm
import torch
from helpers import ROOT

from medflower.models import ModelError
from medflower.models.ffn_slices import (
    covered_merge,
    extract_subnetwork,
    feature_spread,
    ffn_modules,
    ffn_saliency,
    kept_count,
    linear_cka,
    select_neurons,
)


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, num_classes=0, depth=3).eval()


def test_saliency_is_mean_squared_plus_variance_of_the_gelu_activations(vit):
    x = torch.randn(6, 3, 16, 16)
    psi = ffn_saliency(vit, [x[:4], x[4:]])  # batching does not matter
    assert list(psi) == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    captured = {}
    mlp = vit.blocks[1].mlp
    handle = mlp.act.register_forward_hook(lambda m, i, o: captured.setdefault("a", o.detach()))
    with torch.no_grad():
        vit(x)
    handle.remove()
    a = captured["a"].reshape(-1, captured["a"].shape[-1]).double()
    expected = a.mean(0) ** 2 + a.var(0, unbiased=False)
    np.testing.assert_allclose(psi["blocks.1.mlp"], expected.numpy(), rtol=1e-5, atol=1e-9)


def test_the_kept_neurons_are_the_top_saliency_ones_and_the_other_selections_are_what_they_claim():
    psi = np.array([0.1, 5.0, 0.3, 2.0, 0.0, 4.0, 1.0, 0.2])
    np.testing.assert_array_equal(select_neurons(8, 0.375, "saliency", saliency=psi), [1, 3, 5])
    assert kept_count(768, 1 / 16) == 48 and kept_count(10, 0.25) == 3 and kept_count(3, 0.01) == 1
    np.testing.assert_array_equal(select_neurons(8, 0.5, "prefix"), [0, 1, 2, 3])
    np.testing.assert_array_equal(select_neurons(8, 0.5, "rolling", round_index=6), [0, 1, 6, 7])
    random = select_neurons(8, 0.5, "random", seed=3)
    assert len(set(random)) == 4 and list(random) == sorted(random)
    np.testing.assert_array_equal(random, select_neurons(8, 0.5, "random", seed=3))
    with pytest.raises(ModelError, match=r"\(0, 1\]"):
        select_neurons(8, 0.0, "prefix")


def test_a_full_capacity_sub_encoder_is_the_global_one_and_a_narrow_one_matches_the_masked_global(vit):
    x = torch.randn(3, 3, 16, 16)
    names = list(ffn_modules(vit))
    full = extract_subnetwork(vit, {n: np.arange(768) for n in names})
    with torch.no_grad():
        torch.testing.assert_close(full(x), vit(x), rtol=0, atol=0)
    kept = {n: select_neurons(768, 0.25, "random", seed=i) for i, n in enumerate(names)}
    sub = extract_subnetwork(vit, kept)
    assert sub.blocks[0].mlp.fc1.weight.shape == (192, 192) and sub.blocks[0].mlp.fc2.weight.shape == (192, 192)
    masked = extract_subnetwork(vit, {})
    with torch.no_grad():
        for n, mlp in ffn_modules(masked).items():
            drop = np.setdiff1d(np.arange(768), kept[n])
            mlp.fc2.weight[:, torch.as_tensor(drop)] = 0.0  # the global model with the other neurons silenced
        torch.testing.assert_close(sub(x), masked(x), rtol=1e-5, atol=1e-5)
    assert vit.blocks[0].mlp.fc1.out_features == 768  # the global model is untouched


def _arrays(model):
    return OrderedDict((k, v.detach().numpy().copy()) for k, v in model.state_dict().items())


def test_merge_with_full_capacity_everywhere_is_weighted_fedavg(vit):
    names = list(ffn_modules(vit))
    rng = np.random.default_rng(0)
    g = _arrays(vit)
    parts = [OrderedDict((k, v + rng.normal(size=v.shape).astype(v.dtype)) for k, v in g.items()) for _ in range(3)]
    kept = [{n: np.arange(768) for n in names}] * 3
    merged = covered_merge(g, parts, kept, [0.2, 0.5, 0.3], names)
    for k in g:
        np.testing.assert_allclose(
            merged[k], 0.2 * parts[0][k] + 0.5 * parts[1][k] + 0.3 * parts[2][k], rtol=1e-5, atol=1e-5
        )


def test_merge_averages_each_entry_over_the_clients_that_cover_it_and_leaves_uncovered_entries():
    g = OrderedDict(
        [
            ("b.mlp.fc1.weight", np.zeros((4, 2), np.float32)),
            ("b.mlp.fc1.bias", np.full(4, 9.0, np.float32)),
            ("b.mlp.fc2.weight", np.zeros((2, 4), np.float32)),
            ("b.mlp.fc2.bias", np.zeros(2, np.float32)),
        ]
    )
    kept = [{"b.mlp": np.array([0, 1])}, {"b.mlp": np.array([1, 2])}]
    parts = [
        OrderedDict(
            [
                ("b.mlp.fc1.weight", np.full((2, 2), 1.0, np.float32)),
                ("b.mlp.fc1.bias", np.array([1.0, 1.0], np.float32)),
                ("b.mlp.fc2.weight", np.full((2, 2), 1.0, np.float32)),
                ("b.mlp.fc2.bias", np.ones(2, np.float32)),
            ]
        ),
        OrderedDict(
            [
                ("b.mlp.fc1.weight", np.full((2, 2), 4.0, np.float32)),
                ("b.mlp.fc1.bias", np.array([4.0, 4.0], np.float32)),
                ("b.mlp.fc2.weight", np.full((2, 2), 4.0, np.float32)),
                ("b.mlp.fc2.bias", np.full(2, 4.0, np.float32)),
            ]
        ),
    ]
    merged = covered_merge(g, parts, kept, [1.0, 3.0], ["b.mlp"])
    np.testing.assert_allclose(merged["b.mlp.fc1.bias"], [1.0, (1 + 12) / 4, 4.0, 9.0])  # neuron 3: nobody, kept 9
    np.testing.assert_allclose(merged["b.mlp.fc1.weight"][:, 0], [1.0, 3.25, 4.0, 0.0])
    np.testing.assert_allclose(merged["b.mlp.fc2.weight"][0], [1.0, 3.25, 4.0, 0.0])  # columns of W2
    np.testing.assert_allclose(merged["b.mlp.fc2.bias"], [3.25, 3.25])  # b2 is covered by everyone


def test_cka_is_one_for_identical_features_scale_invariant_and_in_the_unit_interval():
    torch.manual_seed(0)
    f = torch.randn(32, 8)
    assert linear_cka(f, f).item() == pytest.approx(1.0, abs=1e-6)
    g = torch.randn(32, 5)
    assert linear_cka(3.7 * f, g).item() == pytest.approx(linear_cka(f, g).item(), rel=1e-5)
    assert linear_cka(f @ torch.linalg.qr(torch.randn(8, 8))[0], f).item() == pytest.approx(1.0, abs=1e-5)  # rotation
    for _ in range(20):
        value = linear_cka(torch.randn(16, 6), torch.randn(16, 4)).item()
        assert 0.0 <= value <= 1.0


def test_feature_spread_is_the_covariance_trace_or_its_top_eigenvalue():
    x = np.random.default_rng(1).normal(size=(50, 6)) * np.arange(1, 7)
    cov = np.cov(x.T, bias=True)
    assert feature_spread(x, "trace") == pytest.approx(np.linalg.eigvalsh(cov).sum())
    assert feature_spread(x, "top") == pytest.approx(np.linalg.eigvalsh(cov).max())
    with pytest.raises(ModelError, match="trace or top"):
        feature_spread(x, "max")


def test_the_non_ffn_count_on_the_fedbkd_page_is_the_one_the_code_gives():
    """The page's "7.49 M of ViT-S's 21.67 M" stays whole at every capacity: counted from timm's ViT-S/16."""
    model = timm.create_model("vit_small_patch16_224", num_classes=0)
    total = sum(p.numel() for p in model.parameters())
    ffn = sum(p.numel() for m in ffn_modules(model).values() for p in m.parameters())
    page = (ROOT / "docs" / "methods" / "fedbkd.md").read_text()
    stated = re.search(r"([0-9.]+) M of ViT-S's ([0-9.]+) M", page)
    assert stated, "the FedBKD page no longer states the non-FFN share of ViT-S"
    assert (stated.group(1), stated.group(2)) == (f"{(total - ffn) / 1e6:.2f}", f"{total / 1e6:.2f}")
