"""APPLE in FedKEI's protocol: the p update (momentum SGD with the decaying proximal term) and λ's schedule by hand,
the latest pooled task's modules, the protocol in process (what is sent, where fine-tuning starts, bytes), partial
participation, resume, and the option checks."""

import math

import numpy as np
import pytest
import torch
from helpers import TINY, extended_by_a_task, records, run_dir_of

from medflower.config import ExperimentConfig, defaults
from medflower.contract import unflatten
from medflower.inprocess import run_inprocess
from medflower.models import build_model
from medflower.options import ConfigError
from medflower.strategies.continual import apple as ap
from medflower.strategies.continual import bilevel as bl
from medflower.strategies.continual.knowledge_pool import KnowledgePool

TASKS = {"strategy": "apple", "num-tasks": 2, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01, "batch-size": 32}


# ----------------------------------------------------------------------------- the p update by hand
def test_the_proximal_weight_follows_the_authors_schedules():
    mu = 0.1
    # exponential: μ·0.001^(s/S') over the first S' = ⌈0.5·10⌉ = 5 steps, then 0
    got = [ap.reg_weight(s, 10, mu, 0.5, "exponential") for s in range(10)]
    assert got[:5] == pytest.approx([mu * 0.001 ** (s / 5) for s in range(5)]) and got[5:] == [0.0] * 5
    cosine = [ap.reg_weight(s, 10, mu, 0.5, "cosine") for s in range(6)]
    assert cosine == pytest.approx([mu * (math.cos(math.pi * s / 5) + 1) / 2 for s in range(5)] + [0.0])
    assert ap.reg_weight(0, 3, mu, 0.1, "exponential") == mu  # ⌈0.3⌉ = 1: the first step only
    assert ap.reg_weight(1, 3, mu, 0.1, "exponential") == 0.0
    assert ap.reg_weight(0, 10, 0.0, 1.0, "cosine") == 0.0


def test_p_steps_are_momentum_sgd_on_the_task_loss_plus_the_proximal_term_by_hand():
    """θ̃(p) = Σ_j p_j θ_j per part (one p for both parts), L = ½‖θ̃_a − y_a‖² + ½‖θ̃_h − y_h‖²; by hand:
    g = Σ_parts Θ (θ̃ − y) + 2λ_s (p − p_0), v ← 0.9 v + g (v = g at the first step), p ← p − lr·v."""
    rng = np.random.default_rng(0)
    modules = [rng.normal(size=(3, 5)), rng.normal(size=(3, 2))]  # N = 3 modules, adapter and head parts
    targets = [rng.normal(size=5), rng.normal(size=2)]
    p0 = np.array([0.2, 0.3, 0.5])
    lr, mu, steps = 0.05, 2.0, 4

    def loss_fn(thetas, _batch):
        return sum(0.5 * ((t - torch.as_tensor(y)) ** 2).sum() for t, y in zip(thetas, targets))

    result = ap.learn_relationships(
        loss_fn, [torch.as_tensor(m) for m in modules], [None] * steps, torch.as_tensor(p0), lr, steps, mu, 0.5
    )
    p, v, losses = p0.copy(), np.zeros(3), []
    for s in range(steps):
        thetas = [p @ m for m in modules]
        losses.append(sum(0.5 * ((t - y) ** 2).sum() for t, y in zip(thetas, targets)))
        lam = mu * 0.001 ** (s / 2) if s < 2 else 0.0  # S' = ⌈0.5·4⌉ = 2
        g = sum(m @ (t - y) for m, t, y in zip(modules, thetas, targets)) + 2 * lam * (p - p0)
        v = g if s == 0 else 0.9 * v + g
        p = p - lr * v
    np.testing.assert_allclose(result.p.numpy(), p, rtol=1e-10)
    assert result.steps == steps and result.mean_loss == pytest.approx(np.mean(losses))
    # the proximal term acts: without it p ends elsewhere (its gradient is 0 only at the first step, p = p_0)
    free = ap.learn_relationships(
        loss_fn, [torch.as_tensor(m) for m in modules], [None] * steps, torch.as_tensor(p0), lr, steps, 0.0, 0.5
    )
    assert not np.allclose(free.p.numpy(), p)


def test_p_moves_towards_the_module_that_solves_the_task():
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    modules = [torch.stack([target, torch.tensor([3.0, 1.0, -1.0], dtype=torch.float64)])]
    loss_fn = lambda thetas, _b: ((thetas[0] - target) ** 2).sum()  # noqa: E731
    result = ap.learn_relationships(loss_fn, modules, [None] * 40, torch.tensor([0.5, 0.5]).double(), 0.01, 40, 0, 1)
    assert result.p[0] > 0.9 and abs(result.p[1]) < 0.1


def test_the_latest_pooled_task_gives_the_modules(tmp_path):
    spec = {"backbone.a.lora_A.weight": ((2, 3), "float32"), "head.weight": ((2, 2), "float32")}
    pool = KnowledgePool(tmp_path, spec)
    assert ap.latest_modules(pool, 2) == ([], [])
    rng = np.random.default_rng(0)
    for task, client in [(1, "b"), (1, "a"), (2, "a"), (3, "c")]:
        pool.add(task, client, {k: rng.normal(size=s).astype(np.float32) for k, (s, _) in spec.items()}, 10.0)
    entries, modules = ap.latest_modules(pool, 3)
    assert [(e.task, e.client) for e in entries] == [(2, "a")] and len(modules) == 1
    assert [(e.task, e.client) for e in ap.latest_modules(pool, 2)[0]] == [(1, "a"), (1, "b")]
    assert [e.task for e in ap.latest_modules(pool, 5)[0]] == [3]  # task 4 had no module: task 3's


# ----------------------------------------------------------------------------- the protocol, in process
def messages(grid, task: int):
    return [m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.group_id == str(task)]


def test_apple_sends_every_module_and_p0_and_starts_from_the_learnt_combination(tiny, monkeypatch):
    starts = []
    original = ap.ContinualClient.finetune

    def spy(self, train, epochs, after_epoch, extra_loss, device):
        starts.append((self.rt.client, self.task, self.rt.model.get_trainable()))
        return original(self, train, epochs, after_epoch, extra_loss, device)

    monkeypatch.setattr(ap.ContinualClient, "finetune", spy)
    config = tiny(
        **{**TASKS, "run-name": "apple", "partition": "dirichlet", "dirichlet-alpha": 5.0, "apple-lr": 0.05},
    )
    summary, grid = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    assert not any(m.content.array_records for m in messages(grid, 1))  # task 1: fresh
    sent = messages(grid, 2)
    assert len(sent) == 3 and set(sent[0].content["arrays"]) == {"adapter", "head"}
    evals = records(run_dir, "eval")
    task1 = {r["client"]: r["num-examples"] for r in evals if r["task"] == 1}
    sizes = np.array([task1[c] for c in sorted(task1)], dtype=float)
    assert len(set(sizes)) > 1  # unequal sites, so p_0 is not uniform
    p0 = np.array(sent[0].content["config"][ap.P0])
    np.testing.assert_allclose(p0, sizes / sizes.sum(), rtol=1e-6)
    model = build_model(ExperimentConfig.from_run_config({**defaults(), **config}).model_spec(), 2)
    parts = bl.split_parts(model.trainable_spec())
    for message in sent:
        assert message.content["arrays"]["adapter"].numpy().shape[0] == 3
    # every site starts task 2 from Σ_j p_j θ_j of the modules sent and the p it reports; p moved from p_0
    for client, task, start in starts:
        if task != 2:
            continue
        record = next(r for r in evals if r["task"] == 2 and r["client"] == client)
        p = np.array(record["apple_p"], dtype=np.float32)
        assert record["apple_p0"] == pytest.approx(p0.tolist()) and not np.allclose(p, p0, atol=1e-4)
        assert record["apple_steps"] >= 1
        expected = {}
        for part, spec in parts.items():
            expected.update(unflatten(p @ sent[0].content["arrays"][part].numpy(), spec))
        assert list(start) == list(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(start[name], value, rtol=1e-5, atol=1e-6)
    # bytes: (N + 1)·|θ| per site in task 2 (N modules down, its own up)
    width = sum(bl.part_width(spec) for spec in parts.values())
    server = records(run_dir, "server")
    assert (server[1]["bytes_down"] + server[1]["bytes_up"]) / 3 == 4 * 4 * width
    assert server[1]["apple_clients"] == sorted(task1) and server[1]["apple_p0"] == pytest.approx(p0.tolist())
    assert set(summary["tasks"]) == {"1", "2"} and "variant" not in summary
    assert (run_dir / "summary.md").read_text().startswith("# apple on synthetic")


def test_a_task_without_every_site_downloads_the_modules_there_are(tiny):
    config = tiny(**{**TASKS, "run-name": "half", "num-tasks": 3, "fraction-train": 0.5})
    summary, grid = run_inprocess(config, num_nodes=2)
    for task in (2, 3):
        (message,) = messages(grid, task)
        assert message.content["arrays"]["head"].numpy().shape[0] == 1 and message.content["config"][ap.P0] == [1.0]
    assert set(summary["tasks"]) == {"1", "2", "3"}


def test_a_finished_run_extended_by_a_task_equals_an_uninterrupted_one(tiny):
    full, part = extended_by_a_task(tiny, TASKS)
    key = lambda d: [(r["task"], r["client"], r["auc_curve"], r.get("apple_p")) for r in records(d, "eval")]  # noqa: E731
    assert key(full) == key(part)


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("apple-lr", 0.0, "must be > 0"),
        ("apple-epochs", 0, "must be > 0"),
        ("apple-mu", -0.1, "must be >= 0"),
        ("apple-schedule", "linear", "exponential, cosine"),
        ("apple-reg-fraction", 0.0, r"must be in \(0, 1\]"),
        ("apple-reg-fraction", 1.5, r"must be in \(0, 1\]"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "apple", key: value})
