"""run-config evaluate-in-train: each round's evaluation rides in the next round's training replies.

The fold must change how many messages a round takes, never what is measured: a folded run logs the same
evaluations (every round, every site, the same values and pooled metrics) and trains the same models as the
unfolded run, with one message per site in every round but the last. It resumes like any run, and it is refused
where a strategy's protocol needs its own evaluate phase.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from helpers import ROOT, records, run_dir_of, site_runtime

from medflower.config import ExperimentConfig, defaults
from medflower.contract.checkpoint import Checkpointer
from medflower.contract.registry import strategies_with
from medflower.contract.server import FederatedStrategy
from medflower.inprocess import run_inprocess
from medflower.options import ConfigError
from medflower.results import read_records
from medflower.strategies import STRATEGIES

FOLDING = sorted(strategies_with("folds_evaluation"))


def _values(record: dict) -> dict:
    """A record without its timings, NaN comparable."""
    return {
        k: ("NaN" if isinstance(v, float) and math.isnan(v) else v)
        for k, v in record.items()
        if k != "time" and not k.endswith("_s")
    }


def evaluations(run_dir) -> Counter:
    return Counter(str(sorted(_values(r).items())) for r in records(run_dir, "eval"))


def pooled(run_dir) -> dict[int, dict]:
    """Per round, the pooled metrics of its server records (with the fold they come in a later record)."""
    out: dict[int, dict] = {}
    for r in records(run_dir, "server"):
        out.setdefault(r["round"], {}).update({k: v for k, v in r.items() if k.startswith("pooled_")})
    return out


def final_arrays(run_dir) -> dict[str, np.ndarray]:
    return Checkpointer(run_dir / "checkpoint").load()[0]


def sent_types(grid) -> Counter:
    """(round, message type) -> messages the server sent."""
    return Counter((int(m.metadata.group_id), m.metadata.message_type) for m in grid.sent)


def test_the_folding_strategies_are_the_ones_with_a_single_training_phase():
    assert FOLDING == [
        "fedala",
        "fedavg",
        "feddbe",
        "feddyn",
        "fedheal",
        "fedprox",
        "fedra",
        "fedsa",
        "fedspeed",
        "lat",
        "local",
        "scaffold",
        "sgca",
    ]
    for name in FOLDING:
        assert STRATEGIES[name].run_round is FederatedStrategy.run_round, name


@pytest.mark.parametrize("strategy", FOLDING)
def test_a_folded_run_measures_and_trains_what_the_unfolded_run_does(tiny, strategy):
    rounds, nodes = 3, 3
    case = STRATEGIES[strategy].contract_case.get("config", {})  # what it needs beyond TINY (SCAFFOLD: plain SGD)
    base = tiny(strategy=strategy, **{"num-rounds": rounds, **case})
    plain, plain_grid = run_inprocess({**base, "run-name": "plain"}, nodes)
    folded, folded_grid = run_inprocess({**base, "run-name": "folded", "evaluate-in-train": True}, nodes)
    a, b = run_dir_of({**base, "run-name": "plain"}), run_dir_of({**base, "run-name": "folded"})

    assert evaluations(a) == evaluations(b)
    assert len(records(b, "eval")) == rounds * nodes
    assert pooled(a) == pooled(b)
    assert Counter(str(sorted(_values(r).items())) for r in records(a, "train")) == Counter(
        str(sorted(_values(r).items())) for r in records(b, "train")
    )
    for k, v in final_arrays(a).items():
        np.testing.assert_array_equal(v, final_arrays(b)[k], err_msg=k)
    assert plain["final"] == folded["final"]

    # one message per site in rounds 1..R-1, the evaluate phase only in the last round
    assert sent_types(plain_grid) - Counter({(1, "query"): nodes}) == Counter(
        {(r, t): nodes for r in range(1, rounds + 1) for t in ("train", "evaluate")}
    )
    assert sent_types(folded_grid) - Counter({(1, "query"): nodes}) == Counter(
        {**{(r, "train"): nodes for r in range(1, rounds + 1)}, (rounds, "evaluate"): nodes}
    )
    phases = {r["round"]: r.get("phase_s", {}) for r in records(b, "server") if "bytes_up" in r}
    assert ["evaluate" in phases[r] for r in range(1, rounds + 1)] == [False, False, True]


def test_sites_not_sampled_for_training_get_the_evaluate_message_of_the_previous_round(tiny):
    base = tiny(strategy="fedavg", **{"num-rounds": 3, "fraction-train": 0.5})
    run_inprocess({**base, "run-name": "plain"}, 4)
    _, grid = run_inprocess({**base, "run-name": "folded", "evaluate-in-train": True}, 4)
    a, b = run_dir_of({**base, "run-name": "plain"}), run_dir_of({**base, "run-name": "folded"})
    assert evaluations(a) == evaluations(b)
    assert len(records(b, "eval")) == 3 * 4
    types = sent_types(grid)
    for rnd in (2, 3):  # 2 of 4 train, the other two evaluate the previous round's model in the same round
        assert types[(rnd, "train")] == 2
        assert types[(rnd - 1, "evaluate")] == 2 + (4 if rnd - 1 == 3 else 0)
    assert types[(3, "evaluate")] == 4


class Stop(Exception):
    pass


def test_a_folded_run_resumed_after_a_crash_mid_round_equals_the_uninterrupted_run(tiny, monkeypatch):
    base = tiny(strategy="fedavg", **{"num-rounds": 3, "evaluate-in-train": True})
    full, stopped = {**base, "run-name": "full"}, {**base, "run-name": "stopped"}
    run_inprocess(full, 3)

    original = FederatedStrategy.aggregate_train

    def crash_in_round_3(self, rnd, replies):
        if rnd == 3:  # after round 2's evaluation came in with round 3's training replies, before the checkpoint
            raise Stop
        return original(self, rnd, replies)

    monkeypatch.setattr(FederatedStrategy, "aggregate_train", crash_in_round_3)
    with pytest.raises(Stop):
        run_inprocess(stopped, 3)
    assert any(r["round"] == 2 for r in records(run_dir_of(stopped), "eval"))  # logged before the crash
    monkeypatch.setattr(FederatedStrategy, "aggregate_train", original)
    run_inprocess({**stopped, "resume-from": str(run_dir_of(stopped))}, 3)

    a, b = run_dir_of(full), run_dir_of(stopped)
    assert evaluations(a) == evaluations(b)  # round 2's evaluation once, not twice
    assert pooled(a) == pooled(b)
    late = [r for r in read_records(b / "metrics.jsonl") if "evaluated_in" in r]
    assert sorted(r["round"] for r in late) == [1, 2]
    for k, v in final_arrays(a).items():
        np.testing.assert_array_equal(v, final_arrays(b)[k], err_msg=k)


def test_a_training_reply_with_a_malformed_evaluation_is_rejected(tiny, monkeypatch):
    from medflower.contract.client import ClientHalf

    original = ClientHalf.train_after_evaluating

    def bad_evaluation(self, message):
        content = original(self, message)
        if self.rt.partition_id == 1:
            content["evaluation"]["auc"] = float("nan")
        return content

    monkeypatch.setattr(ClientHalf, "train_after_evaluating", bad_evaluation)
    config = tiny(strategy="fedavg", **{"num-rounds": 2, "evaluate-in-train": True, "run-name": "bad"})
    run_inprocess(config, 3)
    server = [r for r in records(run_dir_of(config), "server") if "bytes_up" in r]
    assert server[1]["num_rejected"] == 1
    assert "metric auc is not a finite number" in server[1]["rejected"][0]
    trained_round_2 = {r["client"] for r in records(run_dir_of(config), "train") if r["round"] == 2}
    assert len(trained_round_2) == 2  # the rejected reply's update is left out like any rejected reply


def test_the_evaluation_sees_the_previous_round_and_the_runtime_keeps_its_own(tmp_path, monkeypatch):
    """The site's evaluation runs on a copy of the runtime for the previous round: the runtime the message built
    says its own round throughout, and what the evaluation loaded (data, model) the training reuses."""
    from types import SimpleNamespace

    from flwr.app import ConfigRecord, RecordDict

    from medflower.contract import ClientRuntime, to_record
    from medflower.strategies.fedavg import FedAvgClient

    arrays = site_runtime(tmp_path, "fedavg").initial_arrays
    runtime = site_runtime(tmp_path, "fedavg")
    runtime.config["round"] = 3
    message = SimpleNamespace(content=RecordDict({"arrays": to_record(arrays), "config": ConfigRecord({"round": 3})}))
    seen, loads = [], []
    evaluate, load_data = FedAvgClient.evaluate, ClientRuntime._load_data

    def spy(self, message):
        seen.append((self.rt.round, runtime.round, self.rt is runtime))
        return evaluate(self, message)

    def counted(self):
        loads.append(self.round)
        return load_data(self)

    monkeypatch.setattr(FedAvgClient, "evaluate", spy)
    monkeypatch.setattr(ClientRuntime, "_load_data", counted)
    half = FedAvgClient(runtime)
    content = half.train_after_evaluating(message)
    assert seen == [(2, 3, False)]
    assert half.rt is runtime and runtime.round == 3 and runtime.config["round"] == 3
    assert loads == [2]  # loaded once, by the evaluation; the training reuses it
    assert "auc" in content["evaluation"] and content["metrics"]["num-examples"] > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "fedkei"}, "strategy 'fedkei' needs its own evaluate phase; it works with fedavg, fedprox"),
        ({"strategy": "sift", "sift-variant": "trainable-head"}, "strategy 'sift' needs its own evaluate phase"),
        ({"secagg": True}, "with secagg a training reply carries only the masked update"),
        ({"dp": "site", "dp-target-epsilon": 100.0}, "would leave the last round trained without its evaluation"),
    ],
)
def test_evaluate_in_train_is_refused_where_the_protocol_needs_an_evaluate_phase(overrides, message):
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_run_config({**defaults(), "evaluate-in-train": True, **overrides}, check_paths=False)
    assert "evaluate-in-train" in str(err.value) and message in str(err.value)


def test_the_deployment_docs_list_the_strategies_that_fold():
    text = (ROOT / "docs" / "deployment.md").read_text()
    section = text.split("## Fewer messages per round", 1)[1].split("\n## ", 1)[0]
    paragraph = section.split("It works with the strategies", 1)[1].split("The others refuse it", 1)[0]
    listed = {name.strip("`") for name in paragraph.replace(",", " ").replace(".", " ").split() if name[0] == "`"}
    assert listed == set(FOLDING)
