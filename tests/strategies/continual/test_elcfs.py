"""ELCFS (Liu et al., CVPR 2021) as a FedKEI baseline: the continuous frequency space interpolation against the
authors' numpy formula on the full spectrum (the window-only upload gives the same image), λ = 0 and λ = 1, the
episodic step's update against a hand computation (first order) and finite differences (second order), a site's
amplitude windows, the amplitude phase end to end (relayed to the other sites, a bad upload dropped), one site
trains as fedavg-init, and bad config."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, RecordDict
from helpers import TINY, LinearModel, half_mse, half_mse_gradient, half_mse_loss, records, run_dir_of, site_runtime

from medflower.config import ExperimentConfig, defaults
from medflower.contract import from_record, to_record
from medflower.data import make_loader
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.strategies import STRATEGIES
from medflower.strategies.continual import elcfs as el
from medflower.training import OptimizerSpec

TASKS = {"num-tasks": 2, "task-epochs": 1, "optimizer": "sgd", "lr": 0.01, "batch-size": 16}


# ----------------------------------------------------------------------------- the frequency space
def authors_interpolation(src: np.ndarray, trg: np.ndarray, lam: float, ratio: float) -> np.ndarray:
    """The authors' freq_space_interpolation (numpy, unnormalised FFT, the target's full amplitude spectrum): in the
    window a_src·(1 − λ) + a_trg·λ, the source's phase, the real part of the inverse FFT."""
    fft_src = np.fft.fft2(src, axes=(-2, -1))
    a_src = np.fft.fftshift(np.abs(fft_src), axes=(-2, -1))
    a_trg = np.fft.fftshift(np.abs(np.fft.fft2(trg, axes=(-2, -1))), axes=(-2, -1))
    _, h, w = src.shape
    b = int(np.floor(min(h, w) * ratio))
    c_h, c_w = h // 2, w // 2
    h1, h2, w1, w2 = c_h - b, c_h + b + 1, c_w - b, c_w + b + 1
    a_src[:, h1:h2, w1:w2] = a_src[:, h1:h2, w1:w2] * (1 - lam) + a_trg[:, h1:h2, w1:w2] * lam
    a_src = np.fft.ifftshift(a_src, axes=(-2, -1))
    return np.real(np.fft.ifft2(a_src * np.exp(1j * np.angle(fft_src)), axes=(-2, -1)))


RNG = np.random.default_rng(0)
SRC = RNG.uniform(size=(2, 3, 12, 12))
TRG = RNG.uniform(size=(2, 3, 12, 12)) ** 2


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.4])
def test_the_window_only_interpolation_equals_the_authors_on_the_full_spectrum(ratio):
    lam = np.array([0.3, 0.85])
    window = el.amplitude_window(torch.tensor(TRG), ratio)  # what a site uploads
    assert window.shape[-2:] == (2 * int(12 * ratio) + 1,) * 2
    got = el.frequency_interpolate(torch.tensor(SRC), window, torch.tensor(lam), ratio).double().numpy()
    for i in range(2):
        np.testing.assert_allclose(got[i], authors_interpolation(SRC[i], TRG[i], lam[i], ratio), atol=1e-5)
    assert not np.allclose(got, SRC, atol=1e-3)  # the interpolation changed something


def test_lambda_zero_is_the_image_and_lambda_one_is_the_target_amplitude_with_the_source_phase():
    x, target = torch.tensor(SRC[:1], dtype=torch.float64), torch.tensor(TRG[:1], dtype=torch.float64)
    np.testing.assert_allclose(
        el.frequency_interpolate(x, el.amplitude_window(target, 0.2), torch.zeros(1), 0.2).numpy(), SRC[:1], atol=1e-5
    )
    for size, ratio in ((12, 0.2), (11, 0.46)):  # a window inside the spectrum, then (11 px, b = 5) all of it
        src, trg = x[..., :size, :size], target[..., :size, :size]
        out = el.frequency_interpolate(src, el.amplitude_window(trg, ratio), torch.ones(1), ratio)
        spectrum, source = np.fft.fft2(out.numpy(), norm="ortho"), np.fft.fft2(src.numpy(), norm="ortho")
        amp = np.fft.fftshift(np.abs(spectrum), axes=(-2, -1))
        h1, h2, w1, w2 = el.window_bounds(size, size, ratio)
        inside = np.zeros((size, size), bool)
        inside[h1:h2, w1:w2] = True
        want = np.fft.fftshift(np.abs(np.fft.fft2(trg.numpy(), norm="ortho")), axes=(-2, -1))
        kept = np.fft.fftshift(np.abs(source), axes=(-2, -1))
        np.testing.assert_allclose(amp[..., inside], want[..., inside], rtol=1e-4, atol=1e-5)  # the target's
        np.testing.assert_allclose(amp[..., ~inside], kept[..., ~inside], rtol=1e-4, atol=1e-5)  # the source's
        phase = np.angle(spectrum * np.conj(source))  # the phase difference, where there is an amplitude
        assert np.abs(phase[np.abs(source) > 1e-3]).max() < 1e-3
    assert inside.all()  # the last window is the whole spectrum: |F(x̃)| is the target's amplitude


def test_the_window_follows_the_authors_formula():
    assert el.window_bounds(224, 224, 0.003) == (112, 113, 112, 113)  # b = 0: the DC term (their training L = 0)
    assert el.window_bounds(384, 384, 0.003) == (191, 194, 191, 194)  # their demo's 384 px: 3 x 3
    assert el.window_width(16, 0.003) == 1 and el.window_width(16, 0.2) == 7


def test_the_mix_keeps_pixels_in_range_and_is_seeded():
    x = torch.randn(6, 3, 8, 8)
    banks = [torch.rand(4, 3, 3, 3) * 8, torch.rand(2, 3, 3, 3)]
    a = el.FrequencyMix(banks, 0.15, torch.Generator().manual_seed(3))(x)
    b = el.FrequencyMix(banks, 0.15, torch.Generator().manual_seed(3))(x)
    assert torch.equal(a, b) and not torch.allclose(a, x)
    pixels = el.to_pixels(a)
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6


# ----------------------------------------------------------------------------- the episodic step


def tilde(x):
    return 2.0 * x + 1.0  # a fixed stand-in for the frequency interpolation


BATCHES = [(RNG.normal(size=(5, 3)) * s, RNG.normal(size=5)) for s in (1.0, 40.0)]  # the second clips the gradient
W0 = {"w": np.array([0.5, -1.0, 2.0]), "b": np.array([0.3])}


def step(second_order, beta, lr):
    model = LinearModel(W0["w"], W0["b"])
    metrics = el.episodic_steps(
        model,
        [(torch.tensor(x), torch.tensor(y)) for x, y in BATCHES],
        tilde,
        half_mse,
        inner_lr=beta,
        optimizer=OptimizerSpec("sgd", lr, momentum=0.0),
        second_order=second_order,
    )
    return {"w": model.w.detach().numpy(), "b": model.b.detach().numpy()}, metrics


def test_the_first_order_step_is_the_inner_gradient_plus_the_outer_gradient_at_the_inner_step_by_hand():
    beta, lr = 0.05, 0.1
    got, metrics = step(False, beta, lr)
    w = {k: v.copy() for k, v in W0.items()}
    clipped = False
    inner, outer = [], []
    for x, y in BATCHES:
        g = half_mse_gradient(w, x, y)
        clipped |= any(np.abs(v).max() > 100 for v in g.values())
        fast = {k: w[k] - beta * np.clip(g[k], -100, 100) for k in w}  # θ' (the authors clip at ±100)
        g_out = half_mse_gradient(fast, tilde(x), y)
        inner.append(half_mse_loss(w, x, y))
        outer.append(half_mse_loss(fast, tilde(x), y))
        w = {k: w[k] - lr * (g[k] + g_out[k]) for k in w}
    assert clipped
    for k in w:
        np.testing.assert_allclose(got[k], w[k], rtol=1e-12, atol=1e-12)
    assert metrics["train_loss"] == pytest.approx(np.mean(inner)) and metrics["outer_loss"] == pytest.approx(
        np.mean(outer)
    )
    assert metrics["train_steps"] == 2.0


def test_the_second_order_step_is_the_gradient_of_the_episodic_objective_by_finite_differences():
    beta, lr = 0.05, 1.0
    x, y = BATCHES[0]
    model = LinearModel(W0["w"], W0["b"])
    el.episodic_steps(
        model,
        [(torch.tensor(x), torch.tensor(y))],
        tilde,
        half_mse,
        inner_lr=beta,
        optimizer=OptimizerSpec("sgd", lr, momentum=0.0),
        second_order=True,
    )
    flat0 = np.concatenate([W0["w"], W0["b"]])

    def objective(flat):
        p = {"w": flat[:3], "b": flat[3:]}
        g = half_mse_gradient(p, x, y)
        return half_mse_loss(p, x, y) + half_mse_loss({k: p[k] - beta * g[k] for k in p}, tilde(x), y)

    eps = 1e-6
    fd = np.array([(objective(flat0 + eps * e) - objective(flat0 - eps * e)) / (2 * eps) for e in np.eye(4)])
    moved = flat0 - np.concatenate([model.w.detach().numpy(), model.b.detach().numpy()])
    np.testing.assert_allclose(moved / lr, fd, rtol=1e-6, atol=1e-8)
    first, _ = step(False, beta, lr)  # the first-order step differs (the Hessian term)
    assert not np.allclose(first["w"], model.w.detach().numpy())


# ----------------------------------------------------------------------------- a site
def message(config: dict, arrays: dict | None = None):
    content = RecordDict({"config": ConfigRecord({"round": 1, **config})})
    for name, record in (arrays or {}).items():
        content[name] = to_record(record)
    return SimpleNamespace(content=content)


def test_a_site_reports_its_count_then_sends_windows_of_its_task_images(tmp_path):
    rt = site_runtime(tmp_path, "elcfs", **TASKS, **{"elcfs-window": 0.2})
    rt.config["round"] = 1
    client = el.ELCFSClient(rt)
    count = client.elcfs_amplitudes(message({}))
    n = int(count["metrics"]["num-examples"])
    assert n > 5 and "arrays" not in count
    train = client.task_split("train")
    loader = make_loader(train, 8, False, 0)
    every = torch.cat([el.amplitude_window(el.to_pixels(x), 0.2) for x, _ in loader]).numpy()
    sent = from_record(client.elcfs_amplitudes(message({el.SEND: n}))["arrays"])[el.AMPLITUDES]
    assert sent.shape == (n, 3, 7, 7) and sent.dtype == np.float32 and (sent >= 0).all()
    np.testing.assert_allclose(sent, every, rtol=1e-6)
    some = from_record(client.elcfs_amplitudes(message({el.SEND: 5}))["arrays"])[el.AMPLITUDES]
    assert some.shape == (5, 3, 7, 7) and all(any(np.array_equal(s, e) for e in every) for s in some)
    with pytest.raises(ValueError, match="asked for"):
        client.elcfs_amplitudes(message({el.SEND: n + 1}))


def test_a_site_refuses_bad_windows_and_trains_by_the_episodic_step_with_good_ones(tmp_path):
    rt = site_runtime(tmp_path, "elcfs", **TASKS, **{"elcfs-order": "second"})
    rt.config["round"] = 1
    good = OrderedDict([("site/0", np.ones((4, 3, 1, 1), np.float32))])
    with pytest.raises(ValueError, match="negative"):
        el.ELCFSClient(rt).train(message({}, {el.RECORD: {"site/0": -np.ones((4, 3, 1, 1), np.float32)}}))
    with pytest.raises(ValueError, match="shape"):
        el.ELCFSClient(rt).train(message({}, {el.RECORD: {"site/0": np.ones((4, 3, 3, 3), np.float32)}}))
    metrics = el.ELCFSClient(rt).train(message({}, {el.RECORD: good}))["metrics"]
    assert metrics["elcfs_sites"] == 1 and metrics["elcfs_bank"] == 4 and metrics["outer_loss"] > 0


# ----------------------------------------------------------------------------- a federation
def spy_amplitudes(monkeypatch, corrupt=None) -> dict:
    """Task -> {node: amplitude windows accepted}; ``corrupt`` rewrites partition 1's amplitude reply."""
    seen, original = {}, el.ELCFS.amplitude_phase

    def phase(self, grid, task, nodes):
        banks = original(self, grid, task, nodes)
        seen[task] = banks
        return banks

    monkeypatch.setattr(el.ELCFS, "amplitude_phase", phase)
    if corrupt is not None:
        reply = el.ELCFSClient.elcfs_amplitudes

        def bad(self, message):
            content = reply(self, message)
            if self.rt.partition_id == 1 and "arrays" in content:
                value = content["arrays"][el.AMPLITUDES].numpy()
                content["arrays"][el.AMPLITUDES] = Array(corrupt(value))
            return content

        monkeypatch.setattr(el.ELCFSClient, "elcfs_amplitudes", bad)
    return seen


def relayed(grid, task: int) -> dict[int, list[np.ndarray]]:
    out = {}
    for m in grid.sent:
        if m.metadata.message_type == "train" and m.metadata.group_id == str(task):
            record = m.content.array_records.get(el.RECORD)
            out[m.metadata.dst_node_id] = list(from_record(record).values()) if record is not None else []
    return out


def test_every_site_gets_the_other_sites_windows_and_the_bytes_are_counted(tiny, monkeypatch):
    seen = spy_amplitudes(monkeypatch)
    config = tiny(**TASKS, **{"strategy": "elcfs", "run-name": "three", "elcfs-bank-size": 6})
    summary, grid = run_inprocess(config, num_nodes=3)
    assert sorted(seen) == [1, 2]
    for task in (1, 2):
        banks = seen[task]
        assert sorted(banks) == [1, 2, 3] and all(b.shape == (6, 3, 1, 1) for b in banks.values())
        for node, got in relayed(grid, task).items():
            others = [banks[n] for n in sorted(banks) if n != node]
            assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, others))
    server = records(run_dir_of(config), "server")
    for r in server:
        assert r["bytes"]["amplitudes"]["up"] == 3 * 6 * 3 * 4 and r["bytes"]["amplitude_counts"]["up"] == 0
        assert r["elcfs_banks"] == {"site-0": 6, "site-1": 6, "site-2": 6}
    evals = records(run_dir_of(config), "eval")
    assert len(evals) == 6 and all(r["elcfs_sites"] == 2 and r["elcfs_bank"] == 12 for r in evals)
    assert set(summary["tasks"]) == {"1", "2"} and "variant" not in summary
    assert (run_dir_of(config) / "summary.md").read_text().startswith("# elcfs on synthetic")


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda v: -v - 1.0, "negative values"),
        (lambda v: np.full_like(v, np.nan), "NaN/Inf"),
        (lambda v: np.concatenate([v, v[:1]]), "has shape"),
    ],
)
def test_a_bad_amplitude_upload_is_dropped_and_reaches_no_other_site(tiny, monkeypatch, corrupt, reason):
    seen = spy_amplitudes(monkeypatch, corrupt)
    config = tiny(**{**TASKS, "num-tasks": 1}, **{"strategy": "elcfs", "run-name": "bad"})
    _, grid = run_inprocess(config, num_nodes=3)
    assert sorted(seen[1]) == [1, 3]  # node 2 (partition 1) dropped
    server = records(run_dir_of(config), "server")[0]
    assert len(server["rejected"]) == 1 and server["rejected"][0].startswith("site-1: ")
    assert reason in server["rejected"][0]
    got = relayed(grid, 1)
    assert [len(got[n]) for n in (1, 2, 3)] == [1, 2, 1]
    assert np.array_equal(got[1][0], seen[1][3]) and np.array_equal(got[3][0], seen[1][1])
    assert all(np.isfinite(a).all() and (a >= 0).all() for bank in got.values() for a in bank)
    evals = {r["client"]: r for r in records(run_dir_of(config), "eval")}
    assert evals["site-0"]["elcfs_sites"] == 1 and evals["site-2"]["elcfs_sites"] == 1  # the honest sites' banks only
    assert evals["site-1"]["elcfs_sites"] == 2  # the dropped site still fine-tunes, with the others' windows


def test_one_site_trains_plainly_as_fedavg_init(tiny):
    common = {**TASKS}
    one = tiny(**common, **{"strategy": "elcfs", "run-name": "one"})
    init = tiny(**common, **{"strategy": "fedkei", "fedkei-variant": "fedavg-init", "run-name": "init"})
    _, grid = run_inprocess(one, num_nodes=1)
    run_inprocess(init, num_nodes=1)
    assert not any(m.metadata.message_type == "train.elcfs_amplitudes" for m in grid.sent)
    key = lambda d: [(r["task"], r["auc_curve"], r["train_loss"]) for r in records(d, "eval")]  # noqa: E731
    assert key(run_dir_of(one)) == key(run_dir_of(init))


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "key, value, why",
    [
        ("elcfs-window", 0.5, r"must lie in \[0, 0.5\)"),
        ("elcfs-window", -0.01, r"must lie in \[0, 0.5\)"),
        ("elcfs-inner-lr", -1.0, "must be >= 0"),
        ("elcfs-order", "third", "first, second"),
        ("elcfs-bank-size", -1, "must be >= 0"),
        ("fedkei-variant", "rand", "fedkei's initialisation; strategy 'elcfs' has its own"),
    ],
)
def test_bad_option_values_are_refused_with_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
        ExperimentConfig.from_run_config({**defaults(), **TINY, "strategy": "elcfs", key: value})


def test_it_is_registered_with_its_options_and_action():
    assert STRATEGIES["elcfs"] is el.ELCFS and not el.ELCFS.folds_evaluation
    defaults_ = {o.key: o.default for o in el.ELCFS.options}
    assert defaults_["elcfs-window"] == 0.003 and defaults_["elcfs-inner-lr"] == 0.001
    assert defaults_["elcfs-order"] == "first" and defaults_["elcfs-bank-size"] == 0
    assert el.ELCFS.extra_actions == (("train", "elcfs_amplitudes"),)
