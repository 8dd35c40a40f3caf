"""pFedMxF and its LoRA baselines: the spectral layer against peft's FourierFT, the frequency allocator,
exact union aggregation, orthogonality, FedAvg-LoRA's interference vs FedStack's exact sum, the AAC
router, the class-incremental data, and the protocol in process (faults, heterogeneous budgets; resume of every
strategy: tests/contract/test_contract.py)."""

import numpy as np
import pytest
import torch
from helpers import INCREMENTAL, VIT_TINY, records, run_dir_of, sent
from torch import nn

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.contract.checkpoint import Checkpointer
from medflower.data import DataSpec
from medflower.data.partition import partition_rows
from medflower.data.sources import open_source
from medflower.data.tasks import count_incremental_tasks, incremental_task
from medflower.inprocess import run_inprocess
from medflower.models import ModelSpec, build_model
from medflower.models.qk_delta import LoRAQK, SpectralQK, qk_modules, spectral_delta
from medflower.strategies.incremental import fedstack, heads, lora_merge, spectral
from medflower.strategies.incremental import pfedmxf as mx
from medflower.strategies.incremental.protocol import HEAD


@pytest.fixture
def tiny(tiny):
    """TINY on ViT-Tiny: the frequency budgets below (n-frequency, pfedmxf-n-frequency) count the coordinates of its
    192x192 q/k matrices, which timm's 64-wide test ViT has too few of."""
    return lambda **overrides: tiny(**{**VIT_TINY, **overrides})


def spectral_updates(coords_per_site, values_per_site, shape, scale=1.0):
    return [
        spectral_delta(torch.as_tensor(spectral.dense_spectrum(c, v, shape)), scale).double()
        for c, v in zip(coords_per_site, values_per_site)
    ]


# ----------------------------------------------------------------------------- the spectral layer
def test_spectral_layer_equals_peft_fourierft_on_the_q_slice():
    from peft import FourierFTConfig, inject_adapter_in_model

    torch.manual_seed(0)
    d, n, scale = 12, 20, 150.0
    qkv = nn.Linear(d, 3 * d)
    reference = nn.Sequential()
    reference.add_module("q", nn.Linear(d, d))
    with torch.no_grad():
        reference.q.weight.copy_(qkv.weight[:d])
        reference.q.bias.copy_(qkv.bias[:d])
    inject_adapter_in_model(
        FourierFTConfig(n_frequency=n, scaling=scale, target_modules=["q"], init_weights=False), reference
    )
    peft_layer = reference.q
    indices, spectrum = peft_layer.indices["default"], peft_layer.fourierft_spectrum["default"]

    ours = SpectralQK(d, d, n, scale)
    torch.testing.assert_close(ours.coords, indices[0] * d + indices[1])  # peft's default random locations
    with torch.no_grad():
        ours.coefficients[0].copy_(spectrum)
    qkv.register_forward_hook(ours.hook)
    torch.testing.assert_close(ours.delta()[0], peft_layer.get_delta_weight("default"), rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(ours.delta()[1]) == 0  # k has no coefficients here
    x = torch.randn(4, 5, d)
    out = qkv(x)
    torch.testing.assert_close(out[..., :d], reference(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[..., d:], nn.functional.linear(x, qkv.weight[d:], qkv.bias[d:]))


def test_fourier_and_lora_qk_adapters_train_only_their_own_parameters():
    spec = ModelSpec(adapter="fourier", weights="none", img_size=16, patch_size=8, n_frequency=30)
    model = build_model(spec, 4)
    assert all(n.endswith(".qk_delta.coefficients") or n.startswith("head.") for n in model.trainable_names())
    modules = qk_modules(model)
    assert len(modules) == 12 and all(m.coefficients.shape == (2, 30) for m in modules.values())
    x = torch.randn(2, 3, 16, 16)
    before = model(x)
    first = next(iter(modules.values()))
    with torch.no_grad():
        first.frozen[0, 0, 1] = 5.0  # a frozen coefficient changes the function but is not a parameter
    assert not torch.allclose(model(x), before)
    model(x).sum().backward()
    assert first.coefficients.grad is not None and first.coefficients.grad.abs().sum() > 0
    lora = build_model(ModelSpec(adapter="lora-qk", weights="none", img_size=16, patch_size=8, lora_rank=3), 4)
    block = next(iter(qk_modules(lora).values()))
    assert isinstance(block, LoRAQK) and block.lora_A.shape == (2, 3, 192) and block.lora_B.shape == (2, 192, 3)
    torch.testing.assert_close(block.delta(), torch.zeros(2, 192, 192))  # B = 0: starts as the backbone


@pytest.mark.parametrize("adapter", ["fourier", "lora-qk"])
def test_the_qk_adapters_also_train_under_fedavg(tiny, adapter):
    config = tiny(
        **{
            "strategy": "fedavg",
            "adapter": adapter,
            "n-frequency": 50,
            "lora-rank": 2,
            "num-rounds": 2,
            "run-name": adapter,
        }
    )
    summary, _ = run_inprocess(config, num_nodes=2)
    assert summary["rounds"] == 2 and summary["final"]["accuracy"] > 0.2
    losses = [r["train_loss"] for r in records(run_dir_of(config), "train")]
    assert losses[-1] < losses[0]


# ----------------------------------------------------------------------------- allocation and aggregation
@pytest.mark.parametrize("conjugate_aware", [True, False])
def test_allocated_blocks_are_disjoint_across_sites_and_tasks(conjugate_aware):
    shape = (16, 12)
    allocator = spectral.FrequencyAllocator([shape, shape], seed=0, conjugate_aware=conjugate_aware)
    blocks = {
        (t, c): allocator.coords(allocator.allocate(t, c, p, n), shape)
        for t in (1, 2)
        for p, (c, n) in enumerate([("a", 10), ("b", 7), ("c", 12)])
    }
    flat = np.concatenate(list(blocks.values()))
    assert len(np.unique(flat)) == len(flat) == 58
    assert [a.start for a in allocator.allocations] == [0, 10, 17, 29, 39, 46]  # lexicographic (task, site)
    if conjugate_aware:  # no coordinate's mirror image is held by anyone else
        classes = np.minimum(flat, spectral.conjugate(flat, shape))
        assert len(np.unique(classes)) == len(flat)
    again = spectral.FrequencyAllocator([shape], seed=0, conjugate_aware=conjugate_aware)
    again.restore(allocator.table())
    assert all(np.array_equal(again.coords(again.get(t, c), shape), v) for (t, c), v in blocks.items())


def test_shared_frequencies_reuse_one_block_per_task_and_capacity_is_checked():
    shape = (8, 8)
    allocator = spectral.FrequencyAllocator([shape], seed=1, conjugate_aware=True, shared=True)
    a, b = (allocator.coords(allocator.allocate(1, c, i, 6), shape) for i, c in enumerate("ab"))
    np.testing.assert_array_equal(a, b)
    c = allocator.coords(allocator.allocate(2, "a", 0, 6), shape)
    assert not set(c) & set(a)
    assert allocator.capacity == 34  # 64 coordinates, 4 self-conjugate: 4 + 60 / 2 classes
    with pytest.raises(ValueError, match="lower n-frequency"):
        allocator.allocate(3, "a", 0, 30)


def test_capacity_plan_of_the_papers_setting_and_the_largest_n_frequency_that_fits():
    """10 sites x 10 tasks x n-frequency 3000 on ViT-B's 768x768 q/k matrices (the paper's largest setting)."""
    shape = (768, 768)
    assert spectral.usable_coordinates(shape, True) == len(spectral.coordinate_order(shape, 0, True)) == 294_914
    assert spectral.usable_coordinates(shape, False) == 768 * 768
    for small in [(8, 8), (7, 9), (6, 5), (5, 5), (16, 12)]:  # odd sizes have fewer self-conjugate points
        for aware in (True, False):
            assert spectral.usable_coordinates(small, aware) == len(spectral.coordinate_order(small, 0, aware))
    plan = spectral.plan_capacity([shape] * 24, [3000] * 10, 10, conjugate_aware=True, shared=False)
    assert (plan.need, plan.capacity, plan.fits, plan.largest) == (300_000, 294_914, False, 2949)
    assert spectral.plan_capacity([shape], [2949] * 10, 10, True, False).fits  # 294,900
    assert not spectral.plan_capacity([shape], [2950] * 10, 10, True, False).fits  # 295,000
    paper = spectral.plan_capacity([shape], [3000] * 10, 10, conjugate_aware=False, shared=False)
    assert (paper.capacity, paper.fits, paper.largest) == (589_824, True, 5898)
    shared = spectral.plan_capacity([shape], [3000] * 9 + [5000], 10, True, shared=True)  # one block per task
    assert (shared.need, shared.fits, shared.largest) == (50_000, True, 29_491)
    mixed = spectral.plan_capacity([shape], [3000] * 5 + [2900] * 5, 10, True, False)
    assert (mixed.per_task, mixed.need, mixed.fits) == (29_500, 295_000, False)
    assert spectral.plan_capacity([shape, (192, 192)], [100], 1, True, False).shape == (192, 192)  # the smallest binds


def test_union_aggregation_reconstructs_the_sum_of_the_sites_updates_exactly():
    shape = (24, 20)
    rng = np.random.default_rng(0)
    allocator = spectral.FrequencyAllocator([shape], seed=2, conjugate_aware=False)
    coords = [
        allocator.coords(allocator.allocate(1, c, i, n), shape)
        for i, (c, n) in enumerate([("a", 30), ("b", 50), ("c", 20)])
    ]
    values = [rng.normal(size=(2, len(c))).astype(np.float32) for c in coords]
    union_coords, union_values = spectral.union_spectrum(coords, values, [3.0, 1.0, 7.0])
    aggregated = spectral_updates([union_coords], [union_values], shape)[0]
    total = sum(spectral_updates(coords, values, shape))
    torch.testing.assert_close(aggregated, total, rtol=0, atol=1e-6)
    # a shared coordinate gets the weighted mean of its holders' values
    shared_coords, shared_values = spectral.union_spectrum(
        [coords[0], coords[0]], [values[0], values[1][:, :30]], [1.0, 3.0]
    )
    np.testing.assert_array_equal(shared_coords, np.sort(coords[0]))
    order = np.argsort(coords[0])
    np.testing.assert_allclose(shared_values, ((values[0] + 3 * values[1][:, :30]) / 4)[:, order], rtol=1e-6)


def test_shared_block_mean_averages_this_rounds_replies_and_keeps_the_rest():
    previous = np.arange(10, dtype=np.float32).reshape(2, 5)
    a, b = np.ones((2, 3), np.float32), np.full((2, 2), 4.0, np.float32)
    merged = spectral.shared_block_mean(previous, [a, b], [1.0, 2.0])
    np.testing.assert_allclose(merged[:, :2], 3.0)  # (1 + 2 x 4) / 3
    np.testing.assert_array_equal(merged[:, 2], 1.0)  # only a holds position 2
    np.testing.assert_array_equal(merged[:, 3:], previous[:, 3:])  # no reply holds it: unchanged
    np.testing.assert_array_equal(spectral.shared_block_mean(previous, [], []), previous)


def test_conjugate_aware_updates_are_orthogonal_and_a_conjugate_pair_is_not():
    shape = (16, 16)
    rng = np.random.default_rng(1)
    allocator = spectral.FrequencyAllocator([shape], seed=3, conjugate_aware=True)
    coords = [allocator.coords(allocator.allocate(1, c, i, 60), shape) for i, c in enumerate("ab")]
    values = [rng.normal(size=(2, 60)).astype(np.float32) for _ in coords]
    da, db = spectral_updates(coords, values, shape)
    assert float((da * db).sum()) == pytest.approx(0.0, abs=1e-6 * float(da.norm() * db.norm()))
    # the paper's sampling can hand site b the mirror image of site a's coordinates: the same cosines
    mirrored = spectral.conjugate(coords[0], shape)
    assert not set(mirrored) & set(coords[0]) - {c for c in coords[0] if spectral.conjugate(c, shape) == c}
    da, db = spectral_updates([coords[0], mirrored], [values[0], values[0]], shape)
    cosine = float((da * db).sum() / (da.norm() * db.norm()))
    assert cosine == pytest.approx(1.0, abs=1e-5)


def test_fedavg_lora_has_an_interference_term_and_fedstack_is_exact():
    rng = np.random.default_rng(4)
    a = [rng.normal(size=(2, 3, 10)) for _ in range(3)]
    b = [rng.normal(size=(2, 8, 3)) for _ in range(3)]
    n = [10.0, 30.0, 60.0]
    p = np.array(n) / sum(n)
    exact = sum(pk * lora_merge.lora_product(ak, bk, 2.0).astype(np.float64) for pk, ak, bk in zip(p, a, b))
    stacked_a, stacked_b = lora_merge.stack_lora(a, b, n)
    assert stacked_a.shape == (2, 9, 10) and stacked_b.shape == (2, 8, 9)
    np.testing.assert_allclose(lora_merge.lora_product(stacked_a, stacked_b, 2.0), exact, rtol=1e-5, atol=1e-5)
    averaged = lora_merge.lora_product(sum(pk * ak for pk, ak in zip(p, a)), sum(pk * bk for pk, bk in zip(p, b)), 2.0)
    interference = sum(2.0 * p[i] * p[j] * b[i] @ a[j] for i in range(3) for j in range(3) if i != j)
    diagonal = sum(2.0 * p[i] ** 2 * b[i] @ a[i] for i in range(3))
    np.testing.assert_allclose(averaged, diagonal + interference, rtol=1e-5, atol=1e-5)  # Eq. 6
    assert np.abs(interference).max() > 0.1 and np.abs(averaged - exact).max() > 0.1


# ----------------------------------------------------------------------------- the AAC classifier
def test_router_sends_samples_to_the_task_with_the_nearest_prototype():
    torch.manual_seed(0)
    d, c, tasks = 6, 2, 3
    prototypes = 4 * torch.eye(d)[:tasks]
    weight = torch.randn(tasks * c, d)
    for t in range(tasks):
        heads.set_block_mean(weight, c, t + 1, prototypes[t])
    torch.testing.assert_close(heads.task_prototypes(weight, c, tasks), prototypes)
    features = prototypes[[2, 0, 1, 2]] + 0.1 * torch.randn(4, d)
    log_p, router = heads.aac_log_probs(features, weight, torch.zeros(tasks * c), c, tasks)
    assert router.argmax(dim=1).tolist() == [2, 0, 1, 2]
    torch.testing.assert_close(torch.logsumexp(log_p, dim=1), torch.zeros(4), atol=1e-5, rtol=0)
    assert set(log_p.argmax(dim=1).tolist()[:1]) <= {4, 5}  # the class comes from the routed task's block


def test_the_block_mean_is_invisible_to_the_within_task_softmax():
    """Why ``aac-prototype='feature-mean'``: the cross-entropy never moves μ_t, and setting it changes nothing
    the task's own classifier computes."""
    torch.manual_seed(1)
    weight = torch.randn(6, 5, requires_grad=True)
    features, labels = torch.randn(7, 5), torch.tensor([2, 3, 2, 3, 3, 2, 2])
    mask = heads.logit_mask("aac", 2, 2, 6)
    loss = nn.functional.cross_entropy((features @ weight.T).masked_fill(~mask, float("-inf")), labels)
    loss.backward()
    torch.testing.assert_close(weight.grad[2:4].sum(dim=0), torch.zeros(5), atol=1e-6, rtol=0)
    shifted = weight.detach().clone()
    heads.set_block_mean(shifted, 2, 2, torch.full((5,), 3.0))
    before = torch.log_softmax(features @ weight.detach()[2:4].T, dim=1)
    torch.testing.assert_close(torch.log_softmax(features @ shifted[2:4].T, dim=1), before)
    assert heads.logit_mask("unified", 2, 2, 6).tolist() == [True] * 4 + [False] * 2


# ----------------------------------------------------------------------------- class-incremental data
def test_qbli_gives_each_site_k_classes_of_every_task_and_splits_their_rows():
    spec = DataSpec(partition="qbli", qbli_classes=1, classes_per_task=2, synthetic_size=400)
    labels = open_source(spec).labels
    rows = partition_rows(spec, 4).rows
    assert sum(len(r) for r in rows) == len(labels)
    for group in ([0, 1], [2, 3], [4, 5], [6, 7]):
        held = [sorted(set(labels[r][np.isin(labels[r], group)].tolist())) for r in rows]
        assert all(len(h) == 1 for h in held) and {h[0] for h in held} == set(group)
    order = [4, 5, 0, 1, 2, 3]
    spec2 = DataSpec(
        partition="qbli", qbli_classes=2, classes_per_task=3, task_classes="4,5,0,1,2,3", synthetic_size=400
    )
    for r in partition_rows(spec2, 3).rows:
        assert len(set(labels[r][np.isin(labels[r], order[:3])].tolist())) == 2


def test_incremental_tasks_relabel_by_position_in_the_class_order():
    class Rows:
        labels = np.array([5, 2, 7, 0, 2, 5, 1])

        def __getitem__(self, i):
            return i, int(self.labels[i])

    order = [2, 5, 0, 7, 1, 3]
    assert count_incremental_tasks(order, 2, 0) == 3
    with pytest.raises(ValueError, match="needs 8 classes"):
        count_incremental_tasks(order, 2, 4)
    second = incremental_task(Rows(), order, 2, 2)
    assert second.positions.tolist() == [2, 3] and second.labels.tolist() == [3, 2]
    seen = incremental_task(Rows(), order, 2, 2, seen=True)
    assert seen.positions.tolist() == [0, 1, 2, 3, 4, 5] and seen.labels.tolist() == [1, 0, 3, 2, 0, 1]


def test_bad_incremental_config_is_refused_clearly():
    with pytest.raises(ConfigError, match="adapter.*'fourier'"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "pfedmxf", "adapter": "ia3"})
    with pytest.raises(ConfigError, match="one class order"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedstack", "task-order": "shuffled"})
    with pytest.raises(ConfigError, match="pfedmxf-n-frequency"):
        ExperimentConfig.from_run_config({**defaults(), "pfedmxf-n-frequency": "100,x"})
    cfg = ExperimentConfig.from_run_config({**defaults(), "strategy": "fedavg-lora"})
    assert cfg.model_spec().adapter == "lora-qk"


# ----------------------------------------------------------------------------- the protocol, in process
def test_pfedmxf_protocol_union_merge_bytes_and_summary(tiny, monkeypatch):
    captured = {}
    original = mx.PFedMxF.aggregate_updates

    def spy(self, rnd, task, replies):
        captured[rnd] = {r.client: r.arrays for r in replies}
        return original(self, rnd, task, replies)

    monkeypatch.setattr(mx.PFedMxF, "aggregate_updates", spy)
    config = tiny(**{**INCREMENTAL, "strategy": "pfedmxf", "run-name": "mx"})
    summary, grid = run_inprocess(config, num_nodes=3)
    key, module = "192x192", "backbone.blocks.3.attn.qk_delta"
    # own coordinates: 64 per site, disjoint within and across tasks
    owns = [from_record(m.content["arrays"])[f"freq.{key}.own"] for r in (1, 3) for m in sent(grid, "train", r)]
    assert all(len(o) == 64 for o in owns) and len(np.unique(np.concatenate(owns))) == 6 * 64
    # round 2 sends back exactly what every site uploaded in round 1, at its own coordinates
    for message in sent(grid, "train", 2):
        arrays = from_record(message.content["arrays"])
        position = {c: i for i, c in enumerate(arrays[f"freq.{key}.coords"].tolist())}
        for client, upload in captured[1].items():
            own = [m for m in sent(grid, "train", 1) if m.metadata.dst_node_id == int(client[-1]) + 1][0]
            coords = from_record(own.content["arrays"])[f"freq.{key}.own"]
            np.testing.assert_array_equal(
                arrays[f"{module}.spectrum"][:, [position[c] for c in coords.tolist()]],
                upload[f"{module}.coefficients"],
            )
    # task 2: the task-1 coordinates arrive tagged as past (merged), the new ones as current
    arrays = from_record(sent(grid, "train", 3)[0].content["arrays"])
    assert sorted(np.unique(arrays[f"freq.{key}.task"]).tolist()) == [1, 2]
    assert int((arrays[f"freq.{key}.task"] == 1).sum()) == 3 * 64
    # uplink per site and round: 2 x 64 coefficients in 12 blocks + the head (8 x 192 + 8), float32
    server = records(run_dir_of(config), "server")
    assert server[0]["bytes_up"] == 3 * 4 * (12 * 2 * 64 + 8 * 192 + 8)
    assert summary["rounds"] == 4 and set(summary["final"]) >= {"last", "avg", "router_accuracy"}
    assert list(summary["incremental"]) == ["1", "2"]
    evals = [r for r in records(run_dir_of(config), "eval") if r["task_end"]]
    assert {r["task"] for r in evals} == {1, 2} and all(r["n"] > 0 for r in evals)
    meta = Checkpointer(run_dir_of(config) / "checkpoint").load()[1]["strategy_meta"]
    assert len(meta["allocations"]) == 6
    markdown = (run_dir_of(config) / "summary.md").read_text()  # IncrementalReport's layout
    assert markdown.startswith("# pfedmxf (aac classifier) on synthetic\n\n4 rounds")
    assert "| | task 1 | task 2 | Last | Avg |" in markdown and "| client | accuracy |" in markdown


def test_sites_with_different_budgets_aggregate_together(tiny):
    config = tiny(
        **{
            **INCREMENTAL,
            "strategy": "pfedmxf",
            "run-name": "budgets",
            "pfedmxf-n-frequency": "40,90,64",
            "num-tasks": 1,
        }
    )
    summary, grid = run_inprocess(config, num_nodes=3, node_configs=[{}, {}, {"n-frequency": 17}])
    sizes = [len(from_record(m.content["arrays"])["freq.192x192.own"]) for m in sent(grid, "train", 1)]
    assert sizes == [40, 90, 17]
    assert summary["communication"]["rejected_replies"] == 0 and summary["communication"]["failed_replies"] == 0


@pytest.mark.parametrize(
    "overrides, node_configs, expected",
    [
        (
            {"n-frequency": 3100},
            None,
            [
                "run-config 'n-frequency' = 3100 is invalid: 3 sites x 2 tasks x 3100 = 18600 coordinates needed, "
                "but a 192x192 q/k matrix has 18434 usable conjugate classes (conjugate-aware=true); lower "
                "n-frequency to at most 3072"
            ],
        ),
        (
            {"pfedmxf-n-frequency": "6200,3100,64"},
            [{}, {}, {"n-frequency": 300}],  # without site-2's own budget the others still do not fit
            [
                "run-config 'pfedmxf-n-frequency' = '6200,3100,64' is invalid: the sites' budgets (site-0=6200, "
                "site-1=3100, site-2=300; a node-config n-frequency wins) sum to 9600 per task; 2 tasks x 9600 = "
                "19200 coordinates needed",
                "lower n-frequency to at most 3072 for every site, or make the budgets sum to at most 9217 per task",
            ],
        ),
        (
            {},
            [{"n-frequency": 3100}] * 3,  # every budget from node-config: not run-config n-frequency's 64
            [
                "run-config 'n-frequency' = 64 is invalid: the sites' budgets (site-0=3100, site-1=3100, "
                "site-2=3100; a node-config n-frequency wins) sum to 9300 per task",
                "lower n-frequency to at most 3072 for every site",
            ],
        ),
        (
            {"n-frequency": 9300, "frequency-sharing": "shared"},
            None,
            [
                "frequency-sharing='shared' takes one block per task as long as the largest budget: "
                "2 tasks x 9300 = 18600",
                "lower n-frequency to at most 9217",
            ],
        ),
        (
            {"n-frequency": 18500, "conjugate-aware": False},
            None,
            [
                "3 sites x 2 tasks x 18500 = 111000",
                "has 36864 usable coordinates (conjugate-aware=false); lower n-frequency to at most 6144",
            ],
        ),
    ],
)
def test_a_plan_that_does_not_fit_is_refused_before_any_training_message(tiny, overrides, node_configs, expected):
    """Before, the allocator ran out in the middle of the run (here: at task 2, after task 1 had trained)."""
    from medflower.client_app import app
    from medflower.inprocess import InProcessGrid
    from medflower.server_app import run_experiment

    config = {**defaults(), **tiny(**{**INCREMENTAL, "strategy": "pfedmxf", "run-name": "big", **overrides})}
    grid = InProcessGrid(app, 3, config, node_configs=node_configs)
    with pytest.raises(ConfigError) as refused:
        run_experiment(grid, config)
    assert all(part in str(refused.value) for part in expected), str(refused.value)
    assert {m.metadata.message_type for m in grid.sent} == {"query"}


def test_one_sites_own_budget_that_overflows_the_plan_refuses_that_site_only(tiny):
    """A node-config n-frequency that makes the blocks overflow (alone: 10^9; together: 300 beside 6000 + 3000) is
    one site's problem: that site is refused and counted, the others train."""
    from medflower.inprocess import run_inprocess

    for budget in (300, 10**9):
        config = tiny(**{**INCREMENTAL, "strategy": "pfedmxf", "run-name": f"own-{budget}"})
        config["pfedmxf-n-frequency"] = "6000,3000,64"
        summary, _ = run_inprocess(config, 3, node_configs=[{}, {}, {"n-frequency": budget}])
        first = records(run_dir_of(config), "server")[0]
        assert first["num_rejected"] == 1 and "n-frequency" in first["rejected"][0], first["rejected"]
        assert {r["client"] for r in records(run_dir_of(config), "train")} == {"site-0", "site-1"}
        assert summary["rounds"] == 4


def test_a_dropped_site_keeps_its_coefficients_in_the_union(tiny, monkeypatch):
    captured = {}
    original = mx.PFedMxF.aggregate_updates

    def spy(self, rnd, task, replies):
        captured[rnd] = [r.client for r in replies]
        return original(self, rnd, task, replies)

    monkeypatch.setattr(mx.PFedMxF, "aggregate_updates", spy)

    def drop(node_id, message):
        return node_id == 2 and message.metadata.message_type == "train" and message.metadata.group_id == "2"

    config = tiny(**{**INCREMENTAL, "strategy": "pfedmxf", "run-name": "drop", "num-tasks": 1})
    summary, grid = run_inprocess(config, num_nodes=3, drop=drop)
    assert captured[2] == ["site-0", "site-2"] and summary["communication"]["failed_replies"] == 1
    round2 = from_record(sent(grid, "train", 2)[1].content["arrays"])
    state = Checkpointer(run_dir_of(config) / "checkpoint").load()[0]
    coords = round2["freq.192x192.own"]
    position = {c: i for i, c in enumerate(round2["freq.192x192.coords"].tolist())}
    name = "backbone.blocks.0.attn.qk_delta"
    np.testing.assert_array_equal(
        state[f"coef/1/site-1/{name}"], round2[f"{name}.spectrum"][:, [position[c] for c in coords.tolist()]]
    )


@pytest.mark.parametrize("classifier, optimizer", [("aac", "adamw"), ("unified", "adam")])
def test_weight_decay_leaves_the_frozen_head_rows_bit_identical(tiny, monkeypatch, classifier, optimizer):
    """Rows outside a task's softmax get no gradient; AdamW's decoupled decay (and Adam's L2 term) moved them."""
    captured = {}
    original = mx.PFedMxF.aggregate_updates

    def spy(self, rnd, task, replies):
        captured[rnd] = replies
        return original(self, rnd, task, replies)

    monkeypatch.setattr(mx.PFedMxF, "aggregate_updates", spy)
    config = tiny(
        **{
            **INCREMENTAL,
            "strategy": "pfedmxf",
            "run-name": "wd",
            "classifier": classifier,
            "optimizer": optimizer,
            "weight-decay": 0.1,
            "rounds-per-task": 1,
        }
    )
    _, grid = run_inprocess(config, num_nodes=2)
    c = INCREMENTAL["classes-per-task"]
    assert sorted(captured) == [1, 2]  # round = task
    for task, replies in captured.items():
        received = from_record(sent(grid, "train", task)[0].content["arrays"])
        trained = np.zeros(len(received["head.bias"]), bool)
        trained[(task - 1) * c if classifier == "aac" else 0 : task * c] = True
        assert len(replies) == 2 and (~trained).any()
        for reply in replies:
            for name in HEAD:
                np.testing.assert_array_equal(reply.arrays[name][~trained], received[name][~trained])
                assert not np.array_equal(reply.arrays[name][trained], received[name][trained])


def test_shared_frequencies_average_only_this_rounds_replies(tiny, monkeypatch):
    """frequency-sharing='shared' with fraction-train < 1: a site not sampled this round adds no stale block."""
    captured = {}
    original = mx.PFedMxF.aggregate_updates

    def spy(self, rnd, task, replies):
        original(self, rnd, task, replies)
        block = [self.allocator.coords(a, (192, 192)) for a in self.allocator.allocations if a.task == task]
        captured[rnd] = (replies, self.union(task), block)

    monkeypatch.setattr(mx.PFedMxF, "aggregate_updates", spy)
    # seed 5 samples sites 1, 2 in round 1 and sites 0, 2 in round 2 (2 of 3 nodes)
    config = tiny(
        **{
            **INCREMENTAL,
            "strategy": "pfedmxf",
            "run-name": "shared",
            "frequency-sharing": "shared",
            "fraction-train": 0.67,
            "num-tasks": 1,
            "seed": 5,
        }
    )
    run_inprocess(config, num_nodes=3)
    assert [sorted(r.client for r in captured[rnd][0]) for rnd in (1, 2)] == [
        ["site-1", "site-2"],
        ["site-0", "site-2"],
    ]
    name, key = "backbone.blocks.4.attn.qk_delta", "192x192"
    for rnd in (1, 2):
        replies, union, block = captured[rnd]
        assert all(np.array_equal(b, block[0]) for b in block)  # one block for every site of the task
        coords = block[0]
        position = {c: i for i, c in enumerate(union[f"freq.{key}.coords"].tolist())}
        weights = np.array([r.num_examples for r in replies])
        expected = sum(w * r.arrays[f"{name}.coefficients"].astype(np.float64) for w, r in zip(weights, replies))
        np.testing.assert_allclose(
            union[f"{name}.spectrum"][:, [position[c] for c in coords.tolist()]],
            expected / weights.sum(),
            rtol=1e-6,
            atol=1e-7,
        )


def test_fedstack_merges_the_exact_weighted_sum_every_round(tiny, monkeypatch):
    captured = {}
    original = fedstack.FedStack.aggregate_updates

    def spy(self, rnd, task, replies):
        before = {k: v.copy() for k, v in self.merged.items()}
        original(self, rnd, task, replies)
        captured[rnd] = (replies, before, {k: v.copy() for k, v in self.merged.items()})

    monkeypatch.setattr(fedstack.FedStack, "aggregate_updates", spy)
    config = tiny(**{**INCREMENTAL, "strategy": "fedstack", "run-name": "stack", "num-tasks": 1})
    _, grid = run_inprocess(config, num_nodes=3)
    replies, before, after = captured[1]
    name = "backbone.blocks.5.attn.qk_delta"
    weights = np.array([r.num_examples for r in replies]) / sum(r.num_examples for r in replies)
    scale = 16.0 / 2  # lora-alpha / lora-rank
    expected = sum(
        w * scale * r.arrays[f"{name}.lora_B"].astype(np.float64) @ r.arrays[f"{name}.lora_A"]
        for w, r in zip(weights, replies)
    )
    np.testing.assert_allclose(after[name] - before[name], expected, rtol=1e-4, atol=1e-7)
    round2 = from_record(sent(grid, "train", 2)[0].content["arrays"])
    np.testing.assert_array_equal(round2[f"{name}.merged"], after[name])
    assert not np.any(round2[f"{name}.lora_B"])  # a fresh LoRA every round
