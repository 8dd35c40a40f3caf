"""FedKEI: the bi-level gradients (exact vs finite differences, first-order vs the paper's closed form),
the β step, k-means++ clusters, the knowledge pool, the protocol in process, faults and resume."""

import numpy as np
import pytest
import torch
from helpers import TINY_BLOCKS, records, run_dir_of
from safetensors.numpy import load_file

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record, unflatten
from medflower.contract.checkpoint import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.models import build_model
from medflower.strategies.continual import bilevel as bl
from medflower.strategies.continual import fedkei as fk
from medflower.strategies.continual import protocol
from medflower.strategies.continual.knowledge_pool import KnowledgePool

TASKS = {"strategy": "fedkei", "num-tasks": 2, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01, "batch-size": 32}


# ----------------------------------------------------------------------------- client math on a real model
@pytest.fixture(scope="module")
def tiny_problem():
    """A ViT-Tiny + LoRA module in float64, random cluster modules, fixed inner and outer batches."""
    cfg = ExperimentConfig.from_run_config({**defaults(), "img-size": 16, "patch-size": 8, "backbone-weights": "none"})
    model = build_model(cfg.model_spec(), 2).double().train()
    parts = bl.split_parts(model.trainable_spec())
    loss_fn = bl.module_loss(model, parts, model.parameter_paths())
    gen = torch.Generator().manual_seed(0)
    widths = [bl.part_width(spec) for spec in parts.values()]
    clusters = [
        0.05 * torch.randn(2, widths[0], generator=gen, dtype=torch.float64),
        0.3 * torch.randn(3, widths[1], generator=gen, dtype=torch.float64),
    ]

    def batch(n):
        return torch.randn(n, 3, 16, 16, generator=gen, dtype=torch.float64), torch.randint(0, 2, (n,), generator=gen)

    inner = [batch(6) for _ in range(3)]
    outer = [(batch(5), 5), (batch(3), 3)]
    return loss_fn, clusters, inner, outer


def outer_loss_at(loss_fn, clusters, inner, outer, eta1):
    loop = bl.inner_loop(loss_fn, clusters, inner, eta1)
    return bl.outer_gradient(loss_fn, [a @ c for a, c in zip(loop.alphas, clusters)], outer)[1]


def test_exact_gradient_equals_central_finite_differences(tiny_problem):
    loss_fn, clusters, inner, outer = tiny_problem
    eta1, eps = 0.5, 1e-6
    exact, loop, _ = bl.cluster_gradients(loss_fn, clusters, inner, outer, eta1, "exact")
    first, _, _ = bl.cluster_gradients(loss_fn, clusters, inner, outer, eta1, "first-order")
    assert loop.steps == 3 and not torch.allclose(loop.alphas[0].detach(), torch.full((2,), 0.5, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        direction = [torch.randn(c.shape, generator=gen, dtype=torch.float64) for c in clusters]
        plus = outer_loss_at(loss_fn, [c + eps * d for c, d in zip(clusters, direction)], inner, outer, eta1)
        minus = outer_loss_at(loss_fn, [c - eps * d for c, d in zip(clusters, direction)], inner, outer, eta1)
        numeric = (plus - minus) / (2 * eps)
        analytic = sum(float((g * d).sum()) for g, d in zip(exact, direction))
        assert abs(analytic - numeric) / abs(numeric) < 1e-4
        first_order = sum(float((g * d).sum()) for g, d in zip(first, direction))
        assert abs(first_order - numeric) / abs(numeric) > 1e-3  # the Hessian term the closed form drops is real


def test_first_order_equals_the_papers_closed_form_for_one_inner_step(tiny_problem):
    """(∇_{θ_c} θ̃)ᵀ g' = (α'_c I − η1 θ_c gᵀ)ᵀ g' = α'_c g' − η1 g (θ_cᵀ g'), per part (Section III-D)."""
    loss_fn, clusters, inner, outer = tiny_problem
    eta1 = 0.5
    got, _, _ = bl.cluster_gradients(loss_fn, clusters, inner[:1], outer, eta1, "first-order")
    alpha0 = [torch.full((c.shape[0],), 1.0 / c.shape[0], dtype=torch.float64) for c in clusters]
    theta = [(a @ c).requires_grad_(True) for a, c in zip(alpha0, clusters)]
    g = torch.autograd.grad(loss_fn(theta, inner[0]), theta)
    alpha1 = [a - eta1 * (c @ gp) for a, c, gp in zip(alpha0, clusters, g)]
    g_out, _ = bl.outer_gradient(loss_fn, [a @ c for a, c in zip(alpha1, clusters)], outer)
    for part, (a1, c, gp, go) in enumerate(zip(alpha1, clusters, g, g_out)):
        expected = torch.stack([a1[k] * go - eta1 * gp * (c[k] @ go) for k in range(c.shape[0])])
        torch.testing.assert_close(got[part], expected, rtol=1e-10, atol=1e-12)


def test_exact_equals_first_order_when_the_loss_is_linear_in_the_module():
    """With a zero Hessian the dropped term vanishes: exact and first-order agree over several inner steps."""
    gen = torch.Generator().manual_seed(0)
    clusters = [
        torch.randn(3, 7, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, generator=gen, dtype=torch.float64),
    ]
    batches = [
        (torch.randn(7, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64))
        for _ in range(4)
    ]
    loss_fn = lambda thetas, b: thetas[0] @ b[0] + thetas[1] @ b[1]  # noqa: E731
    exact, _, _ = bl.cluster_gradients(loss_fn, clusters, batches, [(batches[0], 1)], 0.3, "exact")
    first, _, _ = bl.cluster_gradients(loss_fn, clusters, batches, [(batches[0], 1)], 0.3, "first-order")
    direct, _, _ = bl.cluster_gradients(loss_fn, clusters, batches, [(batches[0], 1)], 0.3, "direct")
    for e, f, d in zip(exact, first, direct):
        torch.testing.assert_close(e, f, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(e, d)  # variant C leaves out the inner loop's dependence altogether


def test_inner_loop_moves_alpha_toward_the_cluster_that_solves_the_task():
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    clusters = [torch.stack([target, torch.tensor([3.0, 1.0, -1.0], dtype=torch.float64)])]
    loss_fn = lambda thetas, _b: ((thetas[0] - target) ** 2).sum()  # noqa: E731
    loop = bl.inner_loop(loss_fn, clusters, [None] * 20, eta1=0.02)
    alpha = loop.alphas[0]
    assert alpha[0] > 0.9 and abs(alpha[1]) < 0.1
    uniform = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert loss_fn([alpha @ clusters[0]], None) < 0.05 * loss_fn([uniform @ clusters[0]], None)


# ----------------------------------------------------------------------------- server math
def test_beta_step_equals_pool_transpose_times_gradients_summed_over_clients():
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(5, 9))  # M = 5 modules of 9 parameters
    beta = bl.normalised(np.array([[1, 0, 1, 0, 0], [0, 1, 0, 1, 1.0]]))
    grads = [rng.normal(size=(2, 9)) for _ in range(3)]
    got = bl.beta_step(beta, pool, grads, eta2=0.05)
    theta_matrix = pool.T  # Θ = [θ_1 .. θ_M] as columns, Eq. 9's first factor
    for c in range(2):
        expected = beta[c] - 0.05 * sum(theta_matrix.T @ g[c] for g in grads)
        np.testing.assert_allclose(got[c], expected, rtol=1e-12)
    np.testing.assert_allclose(bl.cluster_modules(got, pool), got @ pool, rtol=1e-6)


def test_k_equal_to_the_pool_size_makes_every_cluster_one_past_module():
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(6, 20)).astype(np.float32)
    for k in (6, 10):  # K = min(K, M)
        members = bl.kmeans_membership(pool, k, seed=3)
        assert members.shape == (6, 6) and (members.sum(axis=1) == 1).all() and (members.sum(axis=0) == 1).all()
        modules = bl.cluster_modules(bl.normalised(members), pool)
        assert sorted(map(tuple, modules.round(5))) == sorted(map(tuple, pool.round(5)))
    np.testing.assert_array_equal(bl.kmeans_membership(pool, 3, seed=3), bl.kmeans_membership(pool, 3, seed=3))


def test_kmeans_groups_modules_that_are_alike_and_drops_empty_clusters():
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(3, 12)) * 10
    pool = np.concatenate([c + 0.01 * rng.normal(size=(4, 12)) for c in centres])
    members = bl.kmeans_membership(pool, 3, seed=0)
    groups = sorted(tuple(np.flatnonzero(row)) for row in members)
    assert groups == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    duplicates = np.repeat(pool[:1], 4, axis=0)
    assert bl.kmeans_membership(duplicates, 3, seed=0).shape == (1, 4)  # one distinct point: one cluster
    assert bl.group_membership(["b", "a", "b"]).tolist() == [[0, 1, 0], [1, 0, 1]]


def test_pool_files_reload_and_a_missing_file_is_named(tmp_path):
    spec = {"backbone.a.lora_A.weight": ((2, 3), "float32"), "head.weight": ((2, 2), "float32")}
    pool = KnowledgePool(tmp_path / "pool", spec)
    rng = np.random.default_rng(0)
    modules = {
        (t, c): {k: rng.normal(size=s).astype(np.float32) for k, (s, _) in spec.items()}
        for t in (1, 2)
        for c in ("site-b", "site-a")
    }
    for (t, c), arrays in modules.items():
        pool.add(t, c, arrays, 10.0 + t)
    pool.add(2, "site-a", modules[(2, "site-a")], 12.0)  # a redone task replaces its entry
    assert [(e.task, e.client) for e in pool.entries] == [(1, "site-a"), (1, "site-b"), (2, "site-a"), (2, "site-b")]
    again = KnowledgePool(tmp_path / "pool", spec)
    again.restore(pool.index())
    np.testing.assert_array_equal(again.matrix(spec), pool.matrix(spec))
    (tmp_path / "pool" / pool.entries[0].file).unlink()
    with pytest.raises(FileNotFoundError, match="task-001/site-a.safetensors"):
        KnowledgePool(tmp_path / "pool", spec).restore(pool.index())


# ----------------------------------------------------------------------------- the protocol, in process
def messages(grid, action: str, task: int):
    return [m for m in grid.sent if m.metadata.message_type == action and m.metadata.group_id == str(task)]


def flat(record, part):
    return record[part].numpy()


def spy_gradient_settings(monkeypatch) -> list[tuple[float, str]]:
    """Record the (η1, gradient mode) every site's bi-level phase runs with."""
    settings, original = [], fk.cluster_gradients

    def spy(loss_fn, clusters, inner_batches, outer_batches, eta1, mode="exact"):
        settings.append((eta1, mode))
        return original(loss_fn, clusters, inner_batches, outer_batches, eta1, mode)

    monkeypatch.setattr(fk, "cluster_gradients", spy)
    return settings


def test_full_protocol_beta_step_bytes_and_outputs(tiny, monkeypatch):
    captured = []
    original = fk.beta_step

    def spy(beta, pool, grads, eta2):
        grads = list(grads)
        out = original(beta, pool, grads, eta2)
        captured.append((beta, pool, grads, out))
        return out

    monkeypatch.setattr(fk, "beta_step", spy)
    settings = spy_gradient_settings(monkeypatch)
    config = tiny(
        **{**TASKS, "run-name": "full", "num-tasks": 3, "fedkei-k-adapter": 2, "fedkei-k-head": 1, "run-figures": True}
    )
    summary, grid = run_inprocess(config, num_nodes=3)
    run_dir = run_dir_of(config)
    assert messages(grid, "train.fedkei_inner", 1) == []  # task 1 has no pool yet
    inner2 = messages(grid, "train.fedkei_inner", 2)
    assert len(inner2) == 3
    # static settings come from each site's run config; the messages carry only what the server decides
    assert settings == [(0.05, "exact")] * 6  # tasks 2 and 3, three sites each
    for message in [*inner2, *messages(grid, "train", 2)]:
        assert not {"eta1", "grad", "init"} & set(message.content["config"])
    assert flat(inner2[0].content["arrays"], "adapter").shape[0] == 2
    assert flat(inner2[0].content["arrays"], "head").shape[0] == 1
    # β step over the three clients' gradients; the fine-tune message carries θ_c(β) of the updated β
    beta_a, pool_a, grads_a, new_a = captured[0]  # task 2, adapters
    assert len(grads_a) == 3 and pool_a.shape[0] == 3
    sent = flat(messages(grid, "train", 2)[0].content["arrays"], "adapter")
    np.testing.assert_allclose(sent, new_a @ pool_a, rtol=1e-4, atol=1e-6)
    assert not np.allclose(new_a, beta_a)
    # bytes: (3K+1)|θ| per client and task, adapters and heads counted with their own K
    model = build_model(ExperimentConfig.from_run_config({**defaults(), **config}).model_spec(), 2)
    widths = {p: bl.part_width(spec) for p, spec in bl.split_parts(model.trainable_spec()).items()}
    server = records(run_dir, "server")
    task3 = server[2]
    per_client = (task3["bytes_down"] + task3["bytes_up"]) / 3
    assert per_client == 4 * ((3 * 2 + 1) * widths["adapter"] + (3 * 1 + 1) * widths["head"])
    assert set(task3["bytes"]) == {"bilevel_gradients", "finetune"} and task3["pool_size"] == 6
    # outputs: per task and client final AUC, LCA and the curve; summary and the Table-I-like markdown
    evals = records(run_dir, "eval")
    assert sorted((r["task"], r["client"]) for r in evals) == [(t, f"site-{i}") for t in (1, 2, 3) for i in range(3)]
    assert all(len(r["auc_curve"]) == 2 and r["auc"] == r["auc_curve"][-1] for r in evals)
    assert set(summary["tasks"]) == {"1", "2", "3"}
    assert summary["final"]["lca"] == pytest.approx(np.mean([summary["tasks"][t]["lca"] for t in "123"]))
    markdown = (run_dir / "summary.md").read_text()
    assert summary["variant"] == "full" and markdown.startswith("# fedkei (variant full) on synthetic")
    assert "| metric | task 1 | task 2 | task 3 | overall |" in markdown and "| LCA |" in markdown
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert len(list((run_dir / "checkpoint" / "pool").glob("task-*/*.safetensors"))) == 9


def test_fine_tuning_starts_exactly_from_the_alpha_weighted_cluster_modules(tiny, monkeypatch):
    """θ̃ = Σ_c α̂_c θ_c(β) (Eq. 5): the module the site fine-tunes from is built from the cluster modules the
    server sent and the α̂ the site reports, adapter and head parts each with their own α̂."""
    starts, replies = {}, {}
    original_epochs, original_train = protocol.train_epochs, fk.FedKEIClient.train

    def spy_epochs(model, *args, **kwargs):
        starts[len(starts)] = model.get_trainable()
        return original_epochs(model, *args, **kwargs)

    def spy_train(self, message):
        first = len(starts)
        content = original_train(self, message)
        replies[(int(message.metadata.group_id), self.rt.client)] = (starts[first], message, content)
        return content

    monkeypatch.setattr(protocol, "train_epochs", spy_epochs)
    monkeypatch.setattr(fk.FedKEIClient, "train", spy_train)
    config = tiny(**{**TASKS, "run-name": "init", "fedkei-k-adapter": 2, "fedkei-k-head": 2})
    run_inprocess(config, num_nodes=2)
    parts = bl.split_parts(
        build_model(ExperimentConfig.from_run_config({**defaults(), **config}).model_spec(), 2).trainable_spec()
    )
    task2 = {client: value for (task, client), value in replies.items() if task == 2}
    assert len(task2) == 2
    for start, message, content in task2.values():
        assert set(message.content["arrays"]) == {"adapter", "head"}  # cluster modules to start from
        expected = {}
        for part, spec in parts.items():
            alpha = np.array(content["metrics"][f"alpha_{part}"])
            clusters = message.content["arrays"][part].numpy()
            assert alpha.shape == (clusters.shape[0],) and not np.allclose(alpha, 1 / len(alpha))  # α moved
            expected.update(unflatten(alpha.astype(np.float32) @ clusters, spec))
        assert list(start) == list(expected)  # every trainable array comes from the clusters
        for name, value in expected.items():
            np.testing.assert_allclose(start[name], value, rtol=1e-5, atol=1e-7)


def test_a_site_starts_from_what_the_server_sent_as_its_variant_says():
    assert fk.start_from("full", sent=False) == fk.start_from("fedavg-init", sent=False) == "fresh"  # task 1
    assert fk.start_from("fedavg-init", sent=True) == "module"
    assert {fk.start_from(v, sent=True) for v in ("full", "A", "B", "C")} == {"clusters"}


@pytest.mark.parametrize("variant", ["rand", "fedavg-init", "A", "B", "C"])
def test_variants_send_what_they_say_and_give_the_same_outputs(tiny, monkeypatch, variant):
    settings = spy_gradient_settings(monkeypatch)
    config = tiny(**{**TASKS, "run-name": variant, "fedkei-variant": variant})
    summary, grid = run_inprocess(config, num_nodes=2)
    inner, train = messages(grid, "train.fedkei_inner", 2), messages(grid, "train", 2)
    assert not any({"eta1", "grad", "init"} & set(m.content["config"]) for m in [*inner, *train])
    if variant == "rand":
        assert not any(m.content.array_records for m in train)  # the sites start fresh
    elif variant == "fedavg-init":
        assert len(from_record(train[0].content["arrays"])) == 2 * TINY_BLOCKS + 2  # the module: A, B + head
    else:
        assert set(train[0].content["arrays"]) == {"adapter", "head"}  # cluster modules
        k = flat(train[0].content["arrays"], "adapter").shape[0]
        assert k == 2  # A: one per client; B and C: K = min(3, M = 2)
    assert len(inner) == (2 if variant == "C" else 0)
    if variant == "C":
        assert settings == [(0.05, "direct")] * 2  # variant C's gradient, whatever fedkei-grad says
    assert set(summary["tasks"]) == {"1", "2"} and {"auc", "lca", "auc_init"} <= set(summary["final"])


def test_fedavg_init_sends_the_size_weighted_mean_of_the_pool(tiny):
    config = tiny(
        **{**TASKS, "run-name": "fa", "fedkei-variant": "fedavg-init", "partition": "dirichlet", "dirichlet-alpha": 5.0}
    )
    _, grid = run_inprocess(config, num_nodes=2)
    pool_dir = run_dir_of(config) / "checkpoint" / "pool"
    state = Checkpointer(run_dir_of(config) / "checkpoint").load()[1]["strategy_meta"]["pool"]
    task1 = [(e["num_examples"], load_file(str(pool_dir / e["file"]))) for e in state if e["task"] == 1]
    assert len(task1) == 2 and task1[0][0] != task1[1][0]
    sent = from_record(messages(grid, "train", 2)[0].content["arrays"])
    total = sum(n for n, _ in task1)
    for name, value in sent.items():
        np.testing.assert_allclose(value, sum(n * a[name] for n, a in task1) / total, rtol=1e-5, atol=1e-7)


def test_a_client_that_drops_out_of_the_bilevel_phase_is_left_out_of_the_beta_step(tiny, monkeypatch):
    captured = []
    original = fk.beta_step

    def count_and_step(beta, pool, grads, eta2):
        grads = list(grads)
        captured.append(len(grads))
        return original(beta, pool, grads, eta2)

    monkeypatch.setattr(fk, "beta_step", count_and_step)

    def drop(node_id, message):
        return (
            node_id == 2 and message.metadata.message_type == "train.fedkei_inner" and message.metadata.group_id == "2"
        )

    config = tiny(**{**TASKS, "run-name": "drop", "num-tasks": 3})
    summary, grid = run_inprocess(config, num_nodes=3, drop=drop)
    assert captured[:2] == [2, 2] and captured[2:] == [3, 3]  # task 2 without node 2 (adapter, head), task 3 with it
    server = records(run_dir_of(config), "server")
    assert server[1]["bilevel_clients"] == ["site-0", "site-2"] and server[1]["num_failed"] == 1
    # node 2 still gets task 2's updated cluster modules, the same as the others, and finishes the task
    train2 = {m.metadata.dst_node_id: flat(m.content["arrays"], "adapter") for m in messages(grid, "train", 2)}
    np.testing.assert_array_equal(train2[2], train2[1])
    finished = sorted(r["client"] for r in records(run_dir_of(config), "eval") if r["task"] == 2)
    assert finished == ["site-0", "site-1", "site-2"]
    assert 2 in {m.metadata.dst_node_id for m in messages(grid, "train.fedkei_inner", 3)}


def test_a_finished_run_extended_by_a_task_reloads_the_pool_from_disk(tiny):
    """num-tasks raised on resume (a run killed mid-way, on fresh nodes: tests/contract/test_contract.py)."""
    common = {**TASKS, "fedkei-grad": "first-order"}
    full = tiny(**{**common, "run-name": "full", "num-tasks": 3})
    run_inprocess(full, num_nodes=2)
    part = tiny(**{**common, "run-name": "part", "num-tasks": 2})
    run_inprocess(part, num_nodes=2)
    # the server restarts between tasks: only the run folder on disk carries the pool over
    summary, grid = run_inprocess(tiny(**{**common, "num-tasks": 3, "resume-from": str(run_dir_of(part))}), num_nodes=2)
    assert summary["rounds"] == 3
    assert [m.metadata.group_id for m in grid.sent if m.metadata.message_type == "train"] == ["3", "3"]
    key = lambda d: [(r["task"], r["client"], r["auc_curve"], r["train_loss"]) for r in records(d, "eval")]  # noqa: E731
    assert key(run_dir_of(full)) == key(run_dir_of(part))
    for path in sorted((run_dir_of(full) / "checkpoint" / "pool").glob("task-*/*.safetensors")):
        other = run_dir_of(part) / "checkpoint" / "pool" / path.parent.name / path.name
        x, y = load_file(str(path)), load_file(str(other))
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def test_fraction_train_samples_the_sites_of_each_task(tiny):
    config = tiny(**{**TASKS, "run-name": "half", "num-tasks": 3, "fraction-train": 0.5})
    summary, grid = run_inprocess(config, num_nodes=2)
    server = records(run_dir_of(config), "server")
    assert [r["pool_size"] for r in server] == [0, 1, 2]  # one module per task joins the pool
    for task in (1, 2, 3):
        assert len(messages(grid, "train", task)) == 1
    assert set(summary["tasks"]) == {"1", "2", "3"}
    assert all(len(t["per_client"]) == 1 for t in summary["tasks"].values())


def test_a_site_lacking_a_class_takes_its_own_class_order(tiny, monkeypatch):
    """fedkei-site-classes: site 1 learns class 3 where the run's order has class 2 (as FedKEI's Derm7pt takes VASC
    for AK); the other site keeps the run's order, and a list of another length is refused before task 1."""
    seen = []
    original = protocol.binary_task

    def spy(dataset, order, task):
        seen.append((tuple(order), task))
        return original(dataset, order, task)

    monkeypatch.setattr(protocol, "binary_task", spy)
    common = {**TASKS, "task-classes": "0,1,2", "num-tasks": 2}
    run_inprocess(tiny(**common, **{"run-name": "own", "fedkei-site-classes": "1=0,1,3"}), num_nodes=2)
    orders = {order for order, task in seen if task == 2}
    assert orders == {(0, 1, 2), (0, 1, 3)}
    with pytest.raises(Exception, match="fedkei-site-classes.*lists 2 classes but the run's task order has 3"):
        run_inprocess(tiny(**common, **{"run-name": "short", "fedkei-site-classes": "1=0,3"}), num_nodes=2)


def test_site_class_lists_are_parsed_and_checked():
    from medflower.data import DataError
    from medflower.data.tasks import parse_site_task_classes, site_class_order

    assert parse_site_task_classes("a=MEL,NV; 2 = NV,MEL") == {"a": "MEL,NV", "2": "NV,MEL"}
    for text in ("a", "a=", "a=x;a=y"):
        with pytest.raises(ValueError):
            parse_site_task_classes(text)
    assert site_class_order([0, 1, 2], "MEL,VASC,NV", ["MEL", "NV", "AK", "VASC"], "here") == [0, 3, 1]
    with pytest.raises(DataError, match="here: task-classes: 'SCC' is neither"):
        site_class_order([0, 1], "MEL,SCC", ["MEL", "NV"], "here")
