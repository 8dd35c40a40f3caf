"""FedCurv and EWC (medflower/training/regularisers.py, medflower/strategies/continual/fedcurv.py,
medflower/strategies/incremental/fedcurv_lora.py): the diagonal Fisher against logistic regression's closed form and
per-row autograd on the ViT, the penalty from u, v, c against the sum over sites (value, gradient, finite
differences), ``fedcurv`` in FedKEI's protocol (its start is fedavg-init's, its penalty the other sites', its bytes,
the 'modules' downlink, resume) and ``fedcurv-lora`` in the class-incremental one (the federated Fisher, one LoRA
across tasks, the penalty holding the past task's module), and bad config."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import INCREMENTAL, records, run_dir_of

from medflower.config import ConfigError, ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.contract.checkpoint import Checkpointer
from medflower.contract.messaging import Reply
from medflower.inprocess import run_inprocess
from medflower.models import build_model
from medflower.strategies.continual import fedcurv as fc
from medflower.strategies.incremental import fedcurv_lora as ewc
from medflower.training import regularisers as reg

TASKS = {"num-tasks": 3, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01}


# ----------------------------------------------------------------------------- the Fisher
class LogisticRegression(torch.nn.Module):
    """A linear softmax classifier with the trainable-array API ``diagonal_fisher`` reads."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.head = torch.nn.Linear(features, classes)

    def forward(self, x):
        return self.head(x)

    def parameter_paths(self):
        return OrderedDict((k, k) for k in ("head.weight", "head.bias"))

    def trainable_parameters(self):
        return OrderedDict(self.named_parameters())

    def trainable_spec(self):
        return OrderedDict((k, (tuple(p.shape), "float32")) for k, p in self.named_parameters())


def batches(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(y), size)]


def test_fisher_of_logistic_regression_is_the_closed_form_mean_of_squared_row_gradients():
    """∂(−log p_y)/∂W_c = (p_c − 1[y=c]) x, so F_W[c, k] = mean_i (p_ic − y_ic)² x_ik², F_b[c] = mean (p_ic − y_ic)²."""
    torch.manual_seed(0)
    model = LogisticRegression(5, 3)
    x, y = torch.randn(23, 5), torch.randint(0, 3, (23,))
    fisher = reg.diagonal_fisher(model, batches(x, y, 7), torch.device("cpu"))
    with torch.no_grad():
        residual = (torch.softmax(model(x), dim=1) - torch.nn.functional.one_hot(y, 3)).double()
    expected_w = (residual[:, :, None] ** 2 * x.double()[:, None, :] ** 2).mean(dim=0)
    np.testing.assert_allclose(fisher["head.weight"], expected_w.numpy(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(fisher["head.bias"], (residual**2).mean(dim=0).numpy(), rtol=1e-5, atol=1e-8)
    batch_square = (residual.mean(dim=0) ** 2).numpy()  # the square of the mean gradient is something else
    assert not np.allclose(fisher["head.bias"], batch_square, rtol=0.1)
    # a task's softmax over classes 1 and 2: class 0's row has no gradient, the others the 2-class closed form
    mask = torch.tensor([False, True, True])
    keep = y > 0
    masked = reg.diagonal_fisher(model, batches(x[keep], y[keep], 4), torch.device("cpu"), mask)
    with torch.no_grad():
        p = torch.softmax(model(x[keep])[:, 1:], dim=1)
        r = (p - torch.nn.functional.one_hot(y[keep] - 1, 2)).double()
    np.testing.assert_array_equal(masked["head.weight"][0], 0.0)
    np.testing.assert_allclose(masked["head.bias"][1:], (r**2).mean(dim=0).numpy(), rtol=1e-5, atol=1e-8)
    assert model.training  # the mode is restored


def test_fisher_of_the_vit_with_lora_equals_per_row_autograd():
    cfg = ExperimentConfig.from_run_config({**defaults(), "img-size": 16, "patch-size": 8, "backbone-weights": "none"})
    torch.manual_seed(0)
    model = build_model(cfg.model_spec(), 2)
    with torch.no_grad():  # B = 0 at initialisation would leave A without gradient
        for name, p in model.trainable_parameters().items():
            if "lora_B" in name:
                p.normal_(std=0.1)
    x, y = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 1, 0, 1, 0])
    fisher = reg.diagonal_fisher(model, batches(x, y, 4), torch.device("cpu"))
    params = model.trainable_parameters()
    expected = {k: torch.zeros_like(p) for k, p in params.items()}
    model.eval()
    for i in range(len(y)):
        loss = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        for k, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
            expected[k] += g**2 / len(y)
    assert list(fisher) == list(model.trainable_spec())
    for k, value in expected.items():
        np.testing.assert_allclose(fisher[k], value.numpy(), rtol=1e-4, atol=1e-10)
    assert all(fisher[k].any() for k in fisher)


# ----------------------------------------------------------------------------- the penalty from u, v, c
def sites(seed=0, count=3):
    rng = np.random.default_rng(seed)
    shapes = {"a": (4, 3), "b": (5,)}
    return [
        (
            OrderedDict((k, rng.normal(size=s).astype(np.float32)) for k, s in shapes.items()),
            OrderedDict((k, rng.exponential(size=s).astype(np.float32)) for k, s in shapes.items()),
        )
        for _ in range(count)
    ], shapes


def direct(theta, anchors):
    """Σ_j (θ − θ_j)ᵀ diag(F_j) (θ − θ_j), the FedCurv penalty as written."""
    return sum(
        float((f[k].astype(np.float64) * (theta[k].astype(np.float64) - t[k]) ** 2).sum())
        for t, f in anchors
        for k in theta
    )


def test_the_penalty_from_u_v_c_equals_the_sum_over_sites_in_value_and_gradient():
    anchors, shapes = sites()
    rng = np.random.default_rng(1)
    theta = OrderedDict((k, rng.normal(size=s)) for k, s in shapes.items())
    quadratic = reg.Quadratic.of(anchors)
    assert quadratic.value(theta) == pytest.approx(direct(theta, anchors), rel=1e-12)
    # the same from what travels (float32 u and v) and from every site's module and Fisher ('modules')
    wire = reg.Quadratic.from_arrays(quadratic.arrays())
    assert wire.value(theta) == pytest.approx(direct(theta, anchors), rel=1e-5)
    modules = OrderedDict()
    for j, (t, f) in enumerate(anchors):
        modules.update((f"theta/{j}/{k}", v) for k, v in t.items())
        modules.update((f"fisher/{j}/{k}", v) for k, v in f.items())
    assert reg.Quadratic.from_arrays(modules).value(theta) == pytest.approx(direct(theta, anchors), rel=1e-12)
    # EWC: adding a task's quadratic adds its term
    more, _ = sites(seed=2, count=1)
    assert quadratic.plus(reg.Quadratic.of(more)).value(theta) == pytest.approx(direct(theta, anchors + more))
    # the training term: λ times the value; gradient 2λ Σ_j F_j (θ − θ_j), also by finite differences
    lam = 0.3
    params = OrderedDict((k, torch.tensor(v, dtype=torch.float64, requires_grad=True)) for k, v in theta.items())
    term = quadratic.penalty(params, lam)(None, None, None)
    assert float(term.detach()) == pytest.approx(lam * direct(theta, anchors), rel=1e-6)
    term.backward()
    for k, p in params.items():
        expected = sum(2 * lam * f[k] * (theta[k] - t[k]) for t, f in anchors)
        np.testing.assert_allclose(p.grad.numpy(), expected, rtol=1e-5, atol=1e-6)
    eps, direction = 1e-6, {k: rng.normal(size=s) for k, s in shapes.items()}
    plus = {k: theta[k] + eps * d for k, d in direction.items()}
    minus = {k: theta[k] - eps * d for k, d in direction.items()}
    numeric = lam * (direct(plus, anchors) - direct(minus, anchors)) / (2 * eps)
    analytic = sum(float((params[k].grad.numpy() * d).sum()) for k, d in direction.items())
    assert analytic == pytest.approx(numeric, rel=1e-5)


def test_the_penalty_has_no_cancellation_near_the_anchor():
    """θ = θ_j + tiny: λ(θᵀuθ − 2θᵀv + c) in float32 would be rounding noise; the completed square is not."""
    anchors, _ = sites(count=1)
    theta = OrderedDict((k, (v.astype(np.float64) + 1e-4)) for k, v in anchors[0][0].items())
    params = OrderedDict((k, torch.tensor(v, dtype=torch.float32)) for k, v in theta.items())
    term = float(reg.Quadratic.of(anchors).penalty(params, 1.0)(None, None, None))
    assert term == pytest.approx(direct(theta, anchors), rel=1e-2)


# ----------------------------------------------------------------------------- fedcurv in FedKEI's protocol
def sent(grid, action: str, rnd: int):
    return {
        m.metadata.dst_node_id: m
        for m in grid.sent
        if m.metadata.message_type == action and m.metadata.group_id == str(rnd)
    }


def spy_fishers(monkeypatch) -> dict:
    """Every accepted fine-tuning reply's module and Fisher, by (task, site)."""
    seen, original = {}, fc.FedCurv.finetuned

    def spy(self, task, reply):
        seen[(task, reply.client)] = (
            OrderedDict((k, reply.arrays[k]) for k in self.spec),
            OrderedDict((k, reply.arrays[reg.FISHER + k]) for k in self.spec),
            reply.num_examples,
        )
        return original(self, task, reply)

    monkeypatch.setattr(fc.FedCurv, "finetuned", spy)
    return seen


def test_fedcurv_starts_from_the_pool_mean_and_penalises_toward_the_other_sites(tiny, monkeypatch):
    seen = spy_fishers(monkeypatch)
    config = tiny(
        **TASKS, **{"strategy": "fedcurv", "run-name": "fc", "partition": "dirichlet", "dirichlet-alpha": 5.0}
    )
    summary, grid = run_inprocess(config, num_nodes=3)
    assert all(not m.content.array_records for m in sent(grid, "train", 1).values())  # task 1: fresh, no penalty
    spec = list(seen[(1, "site-0")][0])
    for node, message in sent(grid, "train", 2).items():
        client = f"site-{node - 1}"
        start = from_record(message.content["arrays"])
        task1 = [seen[(1, f"site-{i}")] for i in range(3)]
        total = sum(n for _, _, n in task1)
        for k in spec:  # fedavg-init's start: the n_i-weighted mean of the pool
            np.testing.assert_allclose(start[k], sum(n * t[k] for t, _, n in task1) / total, rtol=1e-5, atol=1e-7)
        others = [seen[(1, c)][:2] for c in ("site-0", "site-1", "site-2") if c != client]
        got = reg.Quadratic.from_arrays(from_record(message.content[fc.RECORD]))
        expected = reg.Quadratic.of(others)
        for k in spec:
            np.testing.assert_allclose(got.u[k], expected.u[k], rtol=1e-6)
            np.testing.assert_allclose(got.v[k], expected.v[k], rtol=1e-5, atol=1e-9)
        assert got.c == pytest.approx(expected.c)
    # task 3's penalty is over the others' task-2 modules and Fishers
    got = reg.Quadratic.from_arrays(from_record(sent(grid, "train", 3)[1].content[fc.RECORD]))
    np.testing.assert_allclose(got.u[spec[-1]], seen[(2, "site-1")][1][spec[-1]] + seen[(2, "site-2")][1][spec[-1]])
    # bytes per task and site: down the start + u + v (+ c), up the module + its Fisher
    size = sum(v.size for v in seen[(1, "site-0")][0].values())
    server = records(run_dir_of(config), "server")
    assert server[1]["bytes_down"] == 3 * (3 * 4 * size + 8) and server[1]["bytes_up"] == 3 * 2 * 4 * size
    assert set(server[1]["fisher_mean"]["site-0"]) == {"adapter", "head"}
    evals = records(run_dir_of(config), "eval")
    assert all(r["fedcurv_penalty"] >= 0 for r in evals if r["task"] > 1)
    assert not any("fedcurv_penalty" in r for r in evals if r["task"] == 1)
    assert set(summary["tasks"]) == {"1", "2", "3"} and "variant" not in summary
    assert (run_dir_of(config) / "summary.md").read_text().startswith("# fedcurv on synthetic")


def test_fedcurv_with_lambda_zero_is_fedavg_init(tiny):
    """Same start, same schedule: the penalty is the only difference from fedkei-variant='fedavg-init'."""
    common = {**TASKS, "num-tasks": 2}
    curv = tiny(**common, **{"strategy": "fedcurv", "fedcurv-lambda": 0.0, "run-name": "zero"})
    init = tiny(**common, **{"strategy": "fedkei", "fedkei-variant": "fedavg-init", "run-name": "init"})
    run_inprocess(curv, num_nodes=2)
    run_inprocess(init, num_nodes=2)
    key = lambda d: [(r["task"], r["client"], r["auc_curve"], r["train_loss"]) for r in records(d, "eval")]  # noqa: E731
    assert key(run_dir_of(curv)) == key(run_dir_of(init))
    penalised = tiny(**common, **{"strategy": "fedcurv", "fedcurv-lambda": 10.0, "run-name": "ten"})
    run_inprocess(penalised, num_nodes=2)
    assert key(run_dir_of(penalised))[:2] == key(run_dir_of(init))[:2]  # task 1 has no penalty
    assert key(run_dir_of(penalised))[2:] != key(run_dir_of(init))[2:]


def test_the_modules_downlink_sends_every_other_sites_module_and_fisher(tiny):
    common = {**TASKS, "num-tasks": 2, "strategy": "fedcurv"}
    sums, modules = tiny(**common, **{"run-name": "sums"}), tiny(**common, **{"run-name": "mods"})
    modules["fedcurv-downlink"] = "modules"
    _, grid_sums = run_inprocess(sums, num_nodes=3)
    _, grid_mods = run_inprocess(modules, num_nodes=3)
    message = sent(grid_mods, "train", 2)[1]
    names = set(message.content[fc.RECORD])
    assert {n.split("/")[1] for n in names} == {"0", "1"} and {n.split("/")[0] for n in names} == {"theta", "fisher"}
    a = reg.Quadratic.from_arrays(from_record(message.content[fc.RECORD]))
    b = reg.Quadratic.from_arrays(from_record(sent(grid_sums, "train", 2)[1].content[fc.RECORD]))
    for k in a.u:
        np.testing.assert_allclose(a.u[k], b.u[k], rtol=1e-6)
    # (2N − 1)·|θ| down per site (the start and the N − 1 others' modules and Fishers), 2|θ| up
    server = records(run_dir_of(modules), "server")
    size = server[1]["bytes_up"] // (3 * 2)
    assert server[1]["bytes_down"] == 3 * 5 * size
    penalty = lambda d: [r["fedcurv_penalty"] for r in records(d, "eval") if r["task"] == 2]  # noqa: E731
    np.testing.assert_allclose(penalty(run_dir_of(modules)), penalty(run_dir_of(sums)), rtol=1e-3)


def test_a_resumed_fedcurv_run_gets_its_fishers_back(tiny):
    full = tiny(**{**TASKS, "strategy": "fedcurv", "run-name": "full"})
    part = tiny(**{**TASKS, "strategy": "fedcurv", "run-name": "part", "num-tasks": 2})
    run_inprocess(full, num_nodes=2)
    run_inprocess(part, num_nodes=2)
    meta = Checkpointer(run_dir_of(part) / "checkpoint").load()[1]["strategy_meta"]
    assert meta["fisher_tasks"] == {"site-0": 2, "site-1": 2}
    _, grid = run_inprocess({**part, "num-tasks": 3, "resume-from": str(run_dir_of(part))}, num_nodes=2)
    resumed = {n: from_record(m.content[fc.RECORD]) for n, m in sent(grid, "train", 3).items()}
    assert set(resumed) == {1, 2}
    key = lambda d: [
        (r["task"], r["client"], r["auc_curve"], r["fedcurv_penalty"]) for r in records(d, "eval") if r["task"] == 3
    ]  # noqa: E501, E731
    assert key(run_dir_of(full)) == key(run_dir_of(part))


# ----------------------------------------------------------------------------- fedcurv-lora, class-incremental
def spy_exchange(monkeypatch, action: str) -> dict:
    seen, original = {}, ewc.FedCurvLoRA.exchange

    def spy(self, grid, message_type, contents, rnd, *args, **kwargs):
        replies = original(self, grid, message_type, contents, rnd, *args, **kwargs)
        if message_type == action:
            seen[rnd] = replies
        return replies

    monkeypatch.setattr(ewc.FedCurvLoRA, "exchange", spy)
    return seen


def test_fedcurv_lora_averages_the_sites_fishers_and_keeps_one_lora(tiny, monkeypatch):
    fishers = spy_exchange(monkeypatch, "train.fedcurv_fisher")
    config = tiny(**INCREMENTAL, **{"strategy": "fedcurv-lora", "run-name": "ewc"})
    summary, grid = run_inprocess(config, num_nodes=3)
    assert sorted(fishers) == [2, 4]  # after each task's last round, every site
    assert len(fishers[2]) == 3
    assert all(not any(ewc.RECORD in m.content for m in sent(grid, "train", r).values()) for r in (1, 2))
    round3 = sent(grid, "train", 3)[1]
    arrays = from_record(round3.content["arrays"])
    assert not any(k.endswith(".merged") for k in arrays)  # nothing merged: one LoRA for the whole run
    assert any(arrays[k].any() for k in arrays if k.endswith("lora_B"))  # task 1's LoRA carries on
    got = reg.Quadratic.from_arrays(from_record(round3.content[ewc.RECORD]))
    replies = fishers[2]
    weights = np.array([r.num_examples for r in replies]) / sum(r.num_examples for r in replies)
    for k in arrays:  # u = the n_k-weighted Fisher of task 1, v = u ⊙ θ*_1 (the module round 3 starts from)
        expected = sum(w * r.arrays[reg.FISHER + k].astype(np.float64) for w, r in zip(weights, replies))
        np.testing.assert_allclose(got.u[k], expected, rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(got.v[k], got.u[k] * arrays[k], rtol=1e-5, atol=1e-12)
    assert not got.u["head.weight"][2:].any()  # aac: task 1's softmax never reaches task 2's rows
    assert got.u["head.weight"][:2].any()
    # bytes of round 2: training + evaluation + the Fisher phase (the module down, a Fisher up)
    server = records(run_dir_of(config), "server")
    size = server[0]["bytes_up"] // 3
    assert server[1]["bytes_up"] == 2 * 3 * size and server[1]["bytes_down"] == 3 * 3 * size
    assert server[2]["bytes_down"] == 2 * 3 * size + 3 * (2 * size + 8)  # u, v and c with every training message
    assert set(server[1]["fisher_mean"]) == {"lora", "head"}
    meta = Checkpointer(run_dir_of(config) / "checkpoint").load()
    assert meta[1]["strategy_meta"]["fisher_tasks"] == [1, 2]
    assert any(k.startswith("fedcurv/u/") for k in meta[0])
    assert {"last", "avg"} <= set(summary["final"])


def test_the_ewc_penalty_holds_the_past_tasks_module(tiny, monkeypatch):
    """The Fisher-weighted distance of the final module from task 1's falls as λ grows."""
    ends = {}
    original = ewc.FedCurvLoRA.fisher_phase

    def spy(self, grid, rnd):
        original(self, grid, rnd)
        ends[(self.cfg.fedcurv_lambda, rnd)] = (self.quadratic, OrderedDict(self.global_arrays))

    monkeypatch.setattr(ewc.FedCurvLoRA, "fisher_phase", spy)
    for lam in (0.0, 1e6):
        run_inprocess(
            tiny(**INCREMENTAL, **{"strategy": "fedcurv-lora", "fedcurv-lambda": lam, "run-name": f"l{lam}"}), 2
        )
    drift = {}
    for lam in (0.0, 1e6):
        quadratic, _ = ends[(lam, 2)]
        _, final = ends[(lam, 4)]
        drift[lam] = quadratic.value(final)
    assert drift[1e6] < 0.2 * drift[0.0]


# ----------------------------------------------------------------------------- bad config and bad replies
def test_bad_config_and_a_negative_fisher_are_refused():
    with pytest.raises(ConfigError, match="fedcurv-lambda.*must be >= 0"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedcurv", "fedcurv-lambda": -1.0})
    with pytest.raises(ConfigError, match="fedcurv-downlink.*sums, modules"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedcurv", "fedcurv-downlink": "all"})
    with pytest.raises(ConfigError, match="one class order"):
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedcurv-lora", "task-order": "shuffled"})
    assert (
        ExperimentConfig.from_run_config({**defaults(), "strategy": "fedcurv-lora"}).model_spec().adapter == "lora-qk"
    )
    arrays = OrderedDict([("head.bias", np.zeros(2, np.float32)), (reg.FISHER + "head.bias", np.array([0.1, -1e-3]))])
    assert "negative" in reg.fisher_problem(arrays)
    assert reg.fisher_problem(OrderedDict([("head.bias", -np.ones(2))])) is None  # a module may be negative
    reply = Reply(1, "site-0", arrays, {}, {})
    assert reg.fisher_problem(reply.arrays) == f"{reg.FISHER}head.bias has negative values; a Fisher's diagonal is >= 0"
