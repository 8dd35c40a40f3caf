"""InfLoRA in the class-incremental protocol: the designed A (orthonormal rows, orthogonal to the DualGPM memory, so an
update B A leaves old-task outputs in the memory's span unchanged), the memory's energy criterion by hand, the pooled
covariance against the pooled data, B averaging against Σ p_k B_k A, and the protocol in process (a tiny run,
resume, bad config). Faults and resume after a task boundary: tests/contract/test_contract.py's ``inflora`` case."""

import numpy as np
import pytest
import torch
from helpers import INCREMENTAL, TINY_BLOCKS, records, restart_processes, run_dir_of, sent

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.contract.checkpoint import Checkpointer
from medflower.data import make_loader
from medflower.inprocess import run_inprocess
from medflower.models import ModelSpec, build_model
from medflower.models.qk_delta import qk_modules
from medflower.strategies.incremental import inflora as inf
from medflower.strategies.incremental.lora_merge import lora_product


def orthonormal(rng, d: int, k: int) -> np.ndarray:
    return np.linalg.qr(rng.normal(size=(d, k)))[0]


# ----------------------------------------------------------------------------- the maths
def test_the_memory_keeps_the_fewest_directions_that_reach_the_threshold():
    cov = np.diag([5.0, 3.0, 1.0, 1.0])  # energy 10
    memory = inf.update_memory(np.zeros((4, 0)), cov, 0.8)  # 5 < 8, 5 + 3 = 8 >= 8: two directions
    np.testing.assert_allclose(np.abs(memory), np.eye(4)[:, :2], atol=1e-12)
    assert inf.update_memory(memory, cov, 0.8) is memory  # it already holds 80 %: unchanged
    later = inf.update_memory(memory, np.diag([1.0, 1.0, 4.0, 4.0]), 0.9)  # holds 2 of 10; +4 = 6, +4 = 10 >= 9
    assert later.shape == (4, 4)
    np.testing.assert_allclose(later.T @ later, np.eye(4), atol=1e-12)
    assert inf.update_memory(memory, np.diag([1.0, 1.0, 4.0, 4.0]), 0.5).shape == (4, 3)  # 2 + 4 = 6 >= 5
    assert inf.threshold(0.95, 1.0, 1, 10) == 0.95 and inf.threshold(0.95, 1.0, 3, 10) == pytest.approx(0.96)


def test_designed_a_is_orthonormal_orthogonal_to_the_memory_and_spans_the_new_tasks_top_directions():
    rng = np.random.default_rng(0)
    d, r = 24, 4
    memory = orthonormal(rng, d, 10)
    complement = inf.complement_basis(memory)
    strong = complement @ orthonormal(rng, d - 10, r)  # the new task's dominant directions, off the memory
    h = strong @ rng.normal(size=(r, 500)) * 10 + rng.normal(size=(d, 500))  # input matrix H (d x tokens)
    a = inf.design_reduction(h @ h.T / 500, memory, r)
    np.testing.assert_allclose(a @ a.T, np.eye(r), atol=1e-10)  # orthonormal rows
    np.testing.assert_allclose(a @ memory, 0, atol=1e-10)  # orthogonal to the memorised subspace
    assert np.linalg.svd(a @ strong, compute_uv=False).min() > 0.99  # the projected input's top-r subspace
    # the complement smaller than r: its whole basis, then zero rows
    tight = inf.design_reduction(h @ h.T, orthonormal(rng, d, d - 2), r)
    np.testing.assert_allclose(tight[:2] @ tight[:2].T, np.eye(2), atol=1e-10)
    assert not tight[2:].any()


def test_an_update_b_a_leaves_old_task_outputs_unchanged_up_to_the_threshold():
    """Interference-free: after DualGPM memorised task 1's inputs, any B with task 2's A changes task 1's outputs
    W x + B A x only by B A (I - M Mᵀ) x, whose energy is at most (1 - ε) of the inputs'."""
    rng = np.random.default_rng(1)
    d, r, eps = 32, 6, 0.95
    shared = orthonormal(rng, d, 8)  # directions both tasks use
    old = shared @ rng.normal(size=(8, 400)) * 5 + 0.3 * rng.normal(size=(d, 400))
    memory = inf.update_memory(np.zeros((d, 0)), old @ old.T / 400, eps)
    assert 0 < memory.shape[1] < d
    new = shared @ rng.normal(size=(8, 300)) * 3 + rng.normal(size=(d, 300))
    a = inf.design_reduction(new @ new.T / 300, memory, r)
    b = rng.normal(size=(d, r)) * 3
    in_span = memory @ rng.normal(size=(memory.shape[1], 50))  # old inputs inside the memory's span
    np.testing.assert_allclose(b @ a @ in_span, 0, atol=1e-9)
    assert np.linalg.norm(a @ old) ** 2 <= (1 - eps) * np.linalg.norm(old) ** 2 + 1e-9  # the rest: below threshold
    unprotected = inf.design_reduction(new @ new.T / 300, np.zeros((d, 0)), r)  # A without the memory interferes
    assert np.linalg.norm(unprotected @ old) ** 2 > 0.5 * np.linalg.norm(old) ** 2


def test_the_aggregated_covariance_is_the_covariance_of_the_pooled_data():
    torch.manual_seed(0)
    model = build_model(ModelSpec(adapter="lora-qk", weights="none", img_size=16, patch_size=8, lora_rank=2), 4)
    modules = qk_modules(model)
    with torch.no_grad():  # a merged update in every block, so deeper inputs depend on it
        for m in modules.values():
            m.merged.normal_(0, 0.05)
    images = [torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8) for n in (5, 9)]  # HWC, as sources give
    sites = [torch.utils.data.TensorDataset(x, torch.zeros(len(x), dtype=torch.long)) for x in images]
    per_site = [inf.input_covariances(model, modules, s, 4, torch.device("cpu")) for s in sites]
    pooled = inf.input_covariances(model, modules, torch.utils.data.ConcatDataset(sites), 4, torch.device("cpu"))
    first = next(iter(modules))
    x, _ = next(iter(make_loader(torch.utils.data.ConcatDataset(sites), 14, False, 0)))  # all 14 images at once
    tokens = []
    hook = model.get_submodule(first.rsplit(".", 1)[0]).qkv.register_forward_pre_hook(
        lambda _m, args: tokens.append(args[0].reshape(-1, args[0].shape[-1]).double())
    )
    with torch.no_grad():
        model.eval()(x)
    hook.remove()
    by_hand = (tokens[0].T @ tokens[0] / len(tokens[0])).numpy()  # mean of x xᵀ over all tokens of all images
    np.testing.assert_allclose(pooled[first], by_hand, rtol=1e-5, atol=1e-6)
    for name in modules:
        aggregated = inf.pooled_covariance([c[name] for c in per_site], [5, 9])
        np.testing.assert_allclose(aggregated, pooled[name], rtol=1e-5, atol=1e-6)
    assert inf.pooled_covariance([per_site[0][first]], [0]) is None


# ----------------------------------------------------------------------------- the protocol, in process
@pytest.fixture
def captured(monkeypatch):
    """Each round's accepted training replies and the B the server holds after aggregating them."""
    seen = {}
    original = inf.InfLoRA.aggregate_updates

    def spy(self, rnd, task, replies):
        original(self, rnd, task, replies)
        seen[rnd] = (replies, {k: self.global_arrays[k].copy() for k in self.b_names})

    monkeypatch.setattr(inf.InfLoRA, "aggregate_updates", spy)
    return seen


def test_a_tiny_run_learns_with_frozen_designed_a_and_exact_b_averaging(tiny, captured):
    config = tiny(**{**INCREMENTAL, "strategy": "inflora", "run-name": "run"})
    summary, grid = run_inprocess(config, num_nodes=3)  # QBLI: a class held by 2 sites or 1, so n_k differ
    run_dir = run_dir_of(config)
    assert summary["rounds"] == 4 and summary["final"]["avg"] > 0.5
    stats = records(run_dir, "inflora_stats")
    assert [r["round"] for r in stats] == [1, 1, 1, 3, 3, 3]  # once per task, every site
    assert all(("inflora-old-examples" in r) == (r["round"] == 3) for r in stats)
    server = {r["round"]: r for r in records(run_dir, "server")}
    assert server[1]["inflora_memory"] == [0] * TINY_BLOCKS and min(server[3]["inflora_memory"]) > 0  # one per block
    scale = INCREMENTAL["lora-rank"] and defaults()["lora-alpha"] / INCREMENTAL["lora-rank"]
    arrays, _ = Checkpointer(run_dir / "checkpoint").load()
    for rnd, (replies, b_mean) in captured.items():
        received = from_record(sent(grid, "train", rnd)[0].content["arrays"])
        p = np.array([r.num_examples for r in replies]) / sum(r.num_examples for r in replies)
        assert len(set(p)) > 1
        for name in [k.removesuffix(".lora_B") for k in b_mean]:
            a = received[f"{name}.lora_A"]
            for reply in replies:  # A went out frozen: replies carry B only
                assert set(reply.arrays) == {k for k in reply.arrays if k.endswith(".lora_B") or k.startswith("head.")}
            mean_b = sum(pk * r.arrays[f"{name}.lora_B"].astype(np.float64) for pk, r in zip(p, replies))
            np.testing.assert_allclose(b_mean[f"{name}.lora_B"], mean_b, rtol=1e-6, atol=1e-8)
            exact = sum(
                pk * lora_product(a, r.arrays[f"{name}.lora_B"], scale).astype(np.float64) for pk, r in zip(p, replies)
            )
            np.testing.assert_allclose(lora_product(a, b_mean[f"{name}.lora_B"], scale), exact, atol=1e-6)
            if rnd == 2:  # the end of task 1: B A went into the merged weights task 2 starts from
                merged = from_record(sent(grid, "train", 3)[0].content["arrays"])[f"{name}.merged"]
                np.testing.assert_allclose(merged, lora_product(a, b_mean[f"{name}.lora_B"], scale), atol=1e-6)
            if rnd == 3:  # task 2's A: orthonormal rows, orthogonal to the memory of task 1
                memory = arrays[f"memory/{name}"]
                np.testing.assert_allclose(a[0] @ a[0].T, np.eye(a.shape[1]), atol=1e-5)
                np.testing.assert_allclose(a[0] @ memory, 0, atol=1e-5)
                np.testing.assert_array_equal(a[0], a[1])  # one A for q and k
    assert sorted(captured) == [1, 2, 3, 4] and all(len(r) == 3 for r, _ in captured.values())


def test_resume_inside_a_task_equals_the_uninterrupted_run(tiny, monkeypatch):
    config = tiny(**{**INCREMENTAL, "strategy": "inflora", "run-name": "full"})
    restart_processes()
    run_inprocess(config, num_nodes=2)
    original = inf.InfLoRA.run_round

    def dies_in_round_4(self, grid, rnd):
        if rnd == 4:
            raise KeyboardInterrupt("the server dies")
        return original(self, grid, rnd)

    stopped = {**config, "run-name": "stopped"}
    monkeypatch.setattr(inf.InfLoRA, "run_round", dies_in_round_4)
    restart_processes()
    with pytest.raises(KeyboardInterrupt):
        run_inprocess(stopped, num_nodes=2)
    monkeypatch.setattr(inf.InfLoRA, "run_round", original)
    restart_processes()
    run_inprocess({**stopped, "resume-from": str(run_dir_of(stopped))}, num_nodes=2)
    a, meta_a = Checkpointer(run_dir_of(config) / "checkpoint").load()
    b, meta_b = Checkpointer(run_dir_of(stopped) / "checkpoint").load()
    assert list(a) == list(b) and any(k.startswith("memory/") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert meta_a["strategy_meta"] == meta_b["strategy_meta"] == {"designed": 2}


def test_bad_config_is_refused_clearly(tiny):
    with pytest.raises(ConfigError, match="inflora-epsilon.*must be in"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "inflora", "inflora-epsilon": 0.0})
    with pytest.raises(ConfigError, match="inflora-epsilon-end.*must be in"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "inflora", "inflora-epsilon-end": 1.5})
    with pytest.raises(ConfigError, match="at most inflora-epsilon-end"):
        ExperimentConfig.from_run_config(
            {**defaults(), "strategy": "inflora", "inflora-epsilon": 0.99, "inflora-epsilon-end": 0.9}
        )
    with pytest.raises(ConfigError, match="one class order"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "inflora", "task-order": "shuffled"})
    with pytest.raises(ConfigError, match="lora-rank.*64-wide"):  # TINY's test ViT is 64 wide
        run_inprocess(tiny(**{**INCREMENTAL, "strategy": "inflora", "run-name": "wide", "lora-rank": 100}), 1)
