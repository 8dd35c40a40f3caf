"""LwF in the two continual protocols: the distillation loss and its gradient by hand, the teachers (the previous
task's module; the end of task t−1's global model without the current LoRA), λ = 0 equal to the plain baselines
array for array, what the servers send, resume, and bad option values."""

import numpy as np
import pytest
import torch
from helpers import INCREMENTAL, TINY, TINY_WIDTH, records, run_dir_of
from safetensors.numpy import load_file

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record
from medflower.contract.checkpoint import Checkpointer
from medflower.inprocess import run_inprocess
from medflower.models import ModelSpec, build_model
from medflower.models.qk_delta import qk_modules
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.continual import flwf
from medflower.strategies.incremental import lwf_lora
from medflower.strategies.incremental.heads import MaskedLogits, logit_mask
from medflower.training import regularisers as reg

TASKS = {"num-tasks": 2, "task-epochs": 2, "optimizer": "sgd", "lr": 0.05, "batch-size": 32}


def messages(grid, message_type: str, rnd: int):
    return [m for m in grid.sent if m.metadata.message_type == message_type and m.metadata.group_id == str(rnd)]


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("temperature, blocks", [(2.0, 1), (1.0, 1), (3.0, 2)])
def test_the_distillation_loss_and_its_gradient_by_hand(temperature, blocks):
    """T²/n Σ_i Σ_b KL(p_ib ‖ q_ib), p = softmax(teacher/T), q = softmax(student/T) per block; ∂/∂student =
    (T/n)(q − p)."""
    rng = np.random.default_rng(0)
    n, width = 5, 4
    student, teacher = rng.normal(size=(n, width)) * 3, rng.normal(size=(n, width)) * 3
    s = torch.tensor(student, requires_grad=True)
    loss = reg.distillation_loss(s, torch.tensor(teacher), temperature, blocks)
    loss.backward()
    q = softmax(student.reshape(n, blocks, -1) / temperature)
    p = softmax(teacher.reshape(n, blocks, -1) / temperature)
    expected = temperature**2 * (p * (np.log(p) - np.log(q))).sum() / n
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(s.grad.numpy(), (temperature / n * (q - p)).reshape(n, width), rtol=1e-5, atol=1e-7)
    # equal logits: no loss, no gradient; blocks are separate softmaxes (a shift of one block changes nothing)
    shifted = teacher.reshape(n, blocks, -1) + np.arange(blocks)[None, :, None] * 5.0
    assert float(
        reg.distillation_loss(torch.tensor(shifted.reshape(n, width)), torch.tensor(teacher), 2.0, blocks)
    ) == (pytest.approx(0.0, abs=1e-6))


# ----------------------------------------------------------------------------- the teachers on real models
def test_flwf_teacher_is_the_sent_module_and_the_auxiliary_head_starts_on_it():
    cfg = ExperimentConfig.from_run_config({**defaults(), **TINY})
    torch.manual_seed(0)
    model = build_model(cfg.model_spec(), 2).eval()
    sent = {
        k: v + np.random.default_rng(1).normal(scale=0.05, size=v.shape).astype(np.float32)
        for k, v in model.get_trainable().items()
    }
    model.set_trainable(sent)
    paths = model.parameter_paths()
    distiller = flwf.ModuleDistiller(model, {paths[k]: torch.as_tensor(v) for k, v in sent.items()}, 2.0, 1.0)
    x = torch.randn(3, 3, 16, 16)
    logits = distiller(x)
    old, target = distiller.pair
    torch.testing.assert_close(target, model(x))
    torch.testing.assert_close(old, target)  # θ_o starts as the sent head on the sent features
    torch.testing.assert_close(logits, model(x))
    assert distiller.loss(model, logits, None).item() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():  # training moves the module; the teacher stays the sent one
        for p in model.trainable_parameters().values():
            p.add_(0.1)
    distiller(x)
    old, target2 = distiller.pair
    torch.testing.assert_close(target2, target)
    assert not torch.allclose(old, target) and distiller.loss(model, logits, None).item() > 0
    assert {n for n, p in distiller.named_parameters() if p.requires_grad} >= {"aux_head.weight", "aux_head.bias"}


@pytest.mark.parametrize("classifier", ["aac", "unified"])
def test_lwf_lora_teacher_is_the_merged_model_without_lora_under_the_old_rows(classifier):
    torch.manual_seed(0)
    model = build_model(ModelSpec(adapter="lora-qk", weights="none", img_size=16, patch_size=8, lora_rank=3), 6).eval()
    with torch.no_grad():
        for module in qk_modules(model).values():
            module.merged.normal_(std=0.05)  # the finished tasks' ΔW
        model.head.weight.normal_()
    k = 4  # task 3 of 2 classes: rows 0-3 are the old classes
    old_head = {
        "head.weight": model.head.weight[:k].detach().clone(),
        "head.bias": model.head.bias[:k].detach().clone(),
    }
    mask = logit_mask(classifier, 2, 3, 6)
    distiller = lwf_lora.OldClassDistiller(
        MaskedLogits(model, mask), old_head, 2 if classifier == "aac" else 1, 2.0, 1.0
    )
    x = torch.randn(3, 3, 16, 16)
    logits = distiller(x)  # a fresh LoRA (B = 0): the model is the teacher
    old, target = distiller.pair
    torch.testing.assert_close(target, model(x)[:, :k])
    torch.testing.assert_close(old, target)
    torch.testing.assert_close(logits, MaskedLogits(model, mask)(x))
    with torch.no_grad():
        for module in qk_modules(model).values():
            module.lora_B.normal_(std=0.5)
        model.head.weight.add_(0.3)
    model.zero_grad()
    logits = distiller(x)
    old, target2 = distiller.pair
    torch.testing.assert_close(target2, target)  # the teacher ignores the current LoRA and the current head
    distiller.loss(model, logits, None).backward()
    lora_grad = next(iter(qk_modules(model).values())).lora_B.grad
    assert lora_grad is not None and lora_grad.abs().sum() > 0  # the distillation trains the LoRA
    grad = model.head.weight.grad
    row_grad = 0.0 if grad is None else float(grad[:k].abs().sum())
    assert (row_grad > 0) == (classifier == "unified")  # aac keeps old rows frozen: no gradient into them


# ----------------------------------------------------------------------------- runs: flwf
def test_flwf_sends_the_mean_of_the_previous_tasks_modules_and_distils(tiny):
    config = tiny(
        **{
            **TASKS,
            "num-tasks": 3,
            "strategy": "flwf",
            "run-name": "f",
            "partition": "dirichlet",
            "dirichlet-alpha": 5.0,
        }
    )
    summary, grid = run_inprocess(config, num_nodes=2)
    assert not any(m.content.array_records for m in messages(grid, "train", 1))
    pool_dir = run_dir_of(config) / "checkpoint" / "pool"
    state = Checkpointer(run_dir_of(config) / "checkpoint").load()[1]["strategy_meta"]["pool"]
    for task in (2, 3):
        previous = [(e["num_examples"], load_file(str(pool_dir / e["file"]))) for e in state if e["task"] == task - 1]
        total = sum(n for n, _ in previous)
        sent = from_record(messages(grid, "train", task)[0].content["arrays"])
        for name, value in sent.items():
            np.testing.assert_allclose(value, sum(n * a[name] for n, a in previous) / total, rtol=1e-5, atol=1e-7)
    evals = records(run_dir_of(config), "eval")
    assert [r["lwf_teacher"] for r in evals] == [0, 0, 1, 1, 1, 1]
    assert all(r["lwf_distill"] > 0 for r in evals if r["task"] > 1)
    server = records(run_dir_of(config), "server")
    size = sum(v.size * 4 for v in sent.values())
    assert [r["bytes"]["finetune"]["down"] for r in server] == [0, 2 * size, 2 * size]  # |θ| down, |θ| up
    assert [r["bytes"]["finetune"]["up"] for r in server] == [2 * size] * 3
    assert "variant" not in summary and summary["final"]["auc"] > 0.5


def test_flwf_with_lambda_zero_is_fedavg_init_exactly(tiny):
    """With the pool holding task 1 only, fedavg-init's start is task 1's mean: λ = 0 must give the same arrays."""
    runs = {
        "base": {"strategy": "fedkei", "fedkei-variant": "fedavg-init"},
        "zero": {"strategy": "flwf", "lwf-lambda": 0.0},
        "lwf": {"strategy": "flwf", "lwf-lambda": 1.0},
    }
    pools = {}
    for name, extra in runs.items():
        config = tiny(**{**TASKS, **extra, "run-name": name})
        run_inprocess(config, num_nodes=2)
        files = sorted((run_dir_of(config) / "checkpoint" / "pool").glob("task-002/*.safetensors"))
        pools[name] = [load_file(str(f)) for f in files]
    for a, b, c in zip(pools["base"], pools["zero"], pools["lwf"]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
        assert not all(np.array_equal(a[k], c[k]) for k in a)


# ----------------------------------------------------------------------------- runs: lwf-lora
def test_lwf_lora_sends_the_old_head_rows_and_lambda_zero_is_fedavg_lora_exactly(tiny):
    base = {**INCREMENTAL, "rounds-per-task": 2}
    ends = {}
    for name, extra in {
        "base": {"strategy": "fedavg-lora"},
        "zero": {"strategy": "lwf-lora", "lwf-lambda": 0.0},
        "lwf": {"strategy": "lwf-lora"},
    }.items():
        config = tiny(**{**base, **extra, "run-name": name})
        _, grid = run_inprocess(config, num_nodes=2)
        ends[name] = Checkpointer(run_dir_of(config) / "checkpoint").load()[0]
        if name == "lwf":
            assert not any(k.startswith("lwf.") for m in messages(grid, "train", 2) for k in m.content["arrays"])
            head_end_task1 = from_record(messages(grid, "evaluate", 2)[0].content["arrays"])
            for rnd in (3, 4):  # every training message of task 2 carries task 1's rows as task 1 ended
                sent = from_record(messages(grid, "train", rnd)[0].content["arrays"])
                for key in ("head.weight", "head.bias"):
                    np.testing.assert_array_equal(sent["lwf." + key], head_end_task1[key][:2])
            assert all("lwf." not in k for m in messages(grid, "evaluate", 3) for k in m.content["arrays"])
            train = records(run_dir_of(config), "train")
            # one local step per round here: task 2's first round starts from the teacher (fresh LoRA, old rows)
            assert [r["lwf_distill"] for r in train if r["round"] == 3] == [0.0, 0.0]
            assert all(r["lwf_distill"] > 0 for r in train if r["round"] == 4)
            assert not any("lwf_distill" in r for r in train if r["task"] == 1)
    shared = list(ends["base"])
    assert all(np.array_equal(ends["base"][k], ends["zero"][k]) for k in shared)
    assert not all(np.array_equal(ends["base"][k], ends["lwf"][k]) for k in shared)


def test_lwf_lora_resumes_with_the_old_head_from_its_checkpoint(tiny):
    base = {**INCREMENTAL, "strategy": "lwf-lora", "classifier": "unified"}
    full = tiny(**{**base, "run-name": "full"})
    run_inprocess(full, num_nodes=2)
    part = tiny(**{**base, "run-name": "part", "num-tasks": 1})
    run_inprocess(part, num_nodes=2)
    meta = Checkpointer(run_dir_of(part) / "checkpoint").load()[0]
    assert meta["lwf/head.weight"].shape == (2, TINY_WIDTH)
    run_inprocess(tiny(**{**base, "resume-from": str(run_dir_of(part))}), num_nodes=2)
    a, b = (
        Checkpointer(run_dir_of(full) / "checkpoint").load()[0],
        Checkpointer(run_dir_of(part) / "checkpoint").load()[0],
    )
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    key = lambda d: [(r["round"], r["client"], r["train_loss"]) for r in records(d, "train")]  # noqa: E731
    assert key(run_dir_of(full)) == key(run_dir_of(part))


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize("strategy", ["flwf", "lwf-lora"])
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("lwf-temperature", 0.0, "must be > 0"),
        ("lwf-temperature", -2.0, "must be > 0"),
        ("lwf-lambda", -0.5, "must be >= 0"),
        ("lwf-lambda", "high", "must be a number"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(strategy, key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": strategy, key: value})


def test_both_are_registered_with_the_shared_options():
    assert STRATEGIES["flwf"] is flwf.FLwF and STRATEGIES["lwf-lora"] is lwf_lora.LwFLoRA
    for cls in (flwf.FLwF, lwf_lora.LwFLoRA):
        assert {o.key: o.default for o in cls.options if o.key.startswith("lwf-")} == {
            "lwf-temperature": 2.0,
            "lwf-lambda": 1.0,
        }
        assert not cls.folds_evaluation
