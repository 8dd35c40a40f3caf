"""The strategy contract, once for every registered strategy (timm tests every registered model the same way; peft
runs one shared tester over a case matrix).

Parametrised over ``sorted(STRATEGIES)``: a strategy is covered the moment it registers. What a strategy needs
beyond the plain ``TINY`` config (tests/helpers.py: the synthetic source on timm's test ViT) is its class's
``contract_case`` (a protocol's base states it once for its family, so its baselines inherit it); without one it
runs with ``TINY`` and the default expectations (it sends arrays both ways every round, logs a valid training reply
as a "train" record).

Three runs per strategy, 3 in-process nodes, all with the same faults (``Faults``); R rounds, a stop after round
S (``Case.stop_after``, default R - 1):
- uninterrupted: R rounds;
- stopped: the server dies at round S + 1's first message, after round S's checkpoint;
- resumed: ``resume-from`` the stopped run on fresh in-process nodes (a new ``run_inprocess``: no node memory).
Faults, by partition: partition 1's training reply is corrupted in round 1 (a NaN array), round S (an array of
the wrong shape) and round R (an unexpected array name), so with R = 3 the server never takes a reply of it and
resumes without any state of that site; partition 2 is silent for the whole of round S; partition 0's ClientApp
raises on its round-R training message (its message stays on the site: the server gets the error's kind only).
The checks (one test each, on the same runs): outputs are written, bad replies are rejected and left out, a silent
or failing node is survived and the silent one trains again, resume equals uninterrupted, bytes are counted, and the
class docstring says what leaves a site. tests/contract/test_fault_injection.py sends every other kind of malformed
reply.

A strategy that fails a check for real gets an ``XFAIL`` entry (strict), never a weaker check.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message
from helpers import ROOT, TINY, records, restart_processes, run_dir_of
from safetensors.numpy import load_file

from medflower.contract import Checkpointer, ClientRuntime
from medflower.inprocess import InProcessGrid, run_inprocess
from medflower.strategies import STRATEGIES

NUM_NODES = 3
NODE = {p: p + 1 for p in range(NUM_NODES)}  # InProcessGrid: node i + 1 holds partition i
CORRUPTED, SILENT, CRASHING = 1, 2, 0  # partitions
UNEXPECTED = "unexpected/array"
CRASH = "disk full at this site"


# ----------------------------------------------------------------------------- the cases, from the registry
@dataclass(frozen=True)
class Case:
    """What a strategy needs beyond the plain tiny config, and what it is expected to send: its class's
    ``contract_case`` (``FederatedStrategy.contract_case``), which a protocol's base states once for its family."""

    config: dict[str, Any] = field(default_factory=dict)
    rounds: int = 3  # iterations of the run (rounds; FedKEI: tasks; incremental: tasks x rounds-per-task)
    stop_after: int = 0  # the round after which the stopped run dies (0: rounds - 1)
    train_kind: str = "train"  # the record kind a valid training reply is logged as
    arrays_up: bool = True  # False: training replies carry metrics only (then say why)
    no_arrays_down: Callable[[int], bool] = lambda rnd: False  # rounds in which no message carries arrays down
    why: str = ""
    # Not a federation (the pooled reference: one site trains on every partition's data), so the faults of the other
    # partitions' training replies cannot happen; its own test file says why and checks what it promises instead.
    not_a_federation: str = ""

    @property
    def stop(self) -> int:
        return self.stop_after or self.rounds - 1

    @classmethod
    def of(cls, strategy: type) -> Case:
        facts = dict(strategy.contract_case)
        down = facts.pop("no_arrays_down", ())
        if down == "all":
            rule = lambda rnd: True  # noqa: E731
        elif isinstance(down, dict):
            rule = lambda rnd, after=down["after"]: rnd > after  # noqa: E731
        else:
            rule = lambda rnd, rounds=frozenset(down): rnd in rounds  # noqa: E731
        return cls(no_arrays_down=rule, **facts)


# (strategy, check) -> reason: real contract failures, to be fixed (strict: the xfail must keep failing). Checks:
# "outputs", "rejected", "failed", "resume", "bytes"; "runs" marks the whole parameter (its runs crash).
XFAIL: dict[tuple[str, str], str] = {}


def case_of(name: str) -> Case:
    """The registered strategy's case (its class's ``contract_case``, inherited from its protocol's base)."""
    return Case.of(STRATEGIES[name])


# ----------------------------------------------------------------------------- faults, in test code only
class Stop(Exception):
    """The server process dies."""


def array_bytes(message: Message) -> int:
    """Bytes of the arrays a message carries, from their shapes and dtypes."""
    return sum(
        int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        for record in message.content.array_records.values()
        for a in record.values()
    )


def _crash(*args, **kwargs):
    raise RuntimeError(CRASH)


@dataclass
class Received:
    round: int
    message_type: str
    partition: int
    honest_bytes: int  # before the test corrupted it
    bytes: int  # as the server got it
    corrupted: str | None


class Faults:
    """Wraps InProcessGrid.send_and_receive: corrupts replies, makes a ClientApp raise, stops the server."""

    def __init__(self, case: Case):
        self.case = case
        self.rounds = case.rounds
        self.stop_at: int | None = None
        self.clients: dict[int, str] = {}  # partition -> site name, from the replies' info

    def drop(self, node_id: int, message: Message) -> bool:
        return node_id == NODE[SILENT] and int(message.metadata.group_id) == self.case.stop

    def corruption(self, rnd: int, message_type: str, partition: int) -> str | None:
        if message_type != "train" or partition != CORRUPTED:
            return None
        return expected_rejections(self.case).get(rnd, (None,))[0]

    def wrap(self, original):
        faults = self

        def send_and_receive(grid: InProcessGrid, messages, *, timeout=None):
            received = grid.__dict__.setdefault("received", [])
            replies = []
            for message in messages:
                rnd, message_type = int(message.metadata.group_id), message.metadata.message_type
                if faults.stop_at is not None and rnd >= faults.stop_at:
                    raise Stop(f"server stopped before round {rnd}")
                partition = int(grid.contexts[message.metadata.dst_node_id].node_config["partition-id"])
                crash = rnd == faults.rounds and message_type == "train" and partition == CRASHING
                with pytest.MonkeyPatch.context() as patch:  # raises inside the real ClientApp's handler
                    if crash:
                        patch.setattr(ClientRuntime, "from_message", staticmethod(_crash))
                    out = list(original(grid, [message], timeout=timeout))
                for reply in out:
                    if reply.has_error():
                        continue
                    faults.clients[partition] = str(reply.content["info"]["client"])
                    honest = array_bytes(reply)
                    kind = faults.corruption(rnd, message_type, partition)
                    if kind:
                        corrupt(reply, kind)
                    received.append(Received(rnd, message_type, partition, honest, array_bytes(reply), kind))
                replies.extend(out)
            return replies

        return send_and_receive


def expected_rejections(case: Case) -> dict[int, tuple[str, str]]:
    """round -> (how partition 1's training reply is corrupted, what the server's reason must say)."""
    rejections = {case.rounds: ("name", "wrong array names")}
    if case.arrays_up:  # an array to corrupt
        rejections.update({1: ("nan", "NaN/Inf"), case.stop: ("shape", "has shape")})
    return rejections


def corrupt(reply: Message, kind: str) -> None:
    if kind in ("nan", "shape"):
        record = reply.content["arrays"]
        name = next((k for k in record if np.dtype(record[k].dtype).kind == "f"), None)
        assert name is not None, "no float array in the training reply: say arrays_up=False in contract_case, and why"
        value = record[name].numpy()
        bad = np.full_like(value, np.nan) if kind == "nan" else np.concatenate([value, value[:1]]).astype(value.dtype)
        record[name] = Array(bad)
    else:
        if "arrays" not in reply.content.array_records:
            reply.content["arrays"] = ArrayRecord()
        reply.content["arrays"][UNEXPECTED] = Array(np.zeros(3, np.float32))


# ----------------------------------------------------------------------------- the runs, once per strategy
@dataclass
class Runs:
    name: str
    case: Case
    faults: Faults
    full: Path
    resumed: Path
    summary: dict
    resumed_summary: dict
    grid: InProcessGrid
    resumed_grid: InProcessGrid
    stopped_meta: dict

    def client(self, partition: int) -> str:
        return self.faults.clients[partition]


def strategy_params() -> list:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=XFAIL[(name, "runs")]))
        if (name, "runs") in XFAIL
        else name
        for name in sorted(STRATEGIES)
        if not case_of(name).not_a_federation
    ]


@pytest.fixture(scope="module", params=strategy_params())
def runs(request, tmp_path_factory) -> Runs:
    name = request.param
    case = case_of(name)
    faults = Faults(case)
    config = {**TINY, "output-dir": str(tmp_path_factory.mktemp(name)), "strategy": name, **case.config}
    full, stopped = {**config, "run-name": "uninterrupted"}, {**config, "run-name": "stopped"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InProcessGrid, "send_and_receive", faults.wrap(InProcessGrid.send_and_receive))
        restart_processes()
        summary, grid = run_inprocess(full, NUM_NODES, drop=faults.drop)
        faults.stop_at = case.stop + 1
        restart_processes()
        with pytest.raises(Stop):
            run_inprocess(stopped, NUM_NODES, drop=faults.drop)
        faults.stop_at = None
        _, stopped_meta = Checkpointer(run_dir_of(stopped) / "checkpoint").load()
        restart_processes()
        resumed_summary, resumed_grid = run_inprocess(
            {**stopped, "resume-from": str(run_dir_of(stopped))}, NUM_NODES, drop=faults.drop
        )
    return Runs(
        name,
        case,
        faults,
        run_dir_of(full),
        run_dir_of(stopped),
        summary,
        resumed_summary,
        grid,
        resumed_grid,
        stopped_meta,
    )


def expect_xfail(request, runs: Runs, check: str) -> None:
    if (runs.name, check) in XFAIL:
        request.applymarker(pytest.mark.xfail(strict=True, reason=XFAIL[(runs.name, check)]))


def by_round(run_dir: Path) -> dict[int, dict]:
    return {r["round"]: r for r in records(run_dir, "server")}


def trained(run_dir: Path, kind: str, rnd: int) -> set[str]:
    return {r["client"] for r in records(run_dir, kind) if r["round"] == rnd}


def checkpoint_files(run_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every safetensors file under checkpoint/ (arrays.safetensors, FedKEI's pool, ...), by relative path."""
    root = run_dir / "checkpoint"
    return {str(p.relative_to(root)): load_file(str(p)) for p in sorted(root.rglob("*.safetensors"))}


# ----------------------------------------------------------------------------- the checks
def test_a_run_writes_its_outputs(runs, request):
    expect_xfail(request, runs, "outputs")
    for run_dir, summary in ((runs.full, runs.summary), (runs.resumed, runs.resumed_summary)):
        newest = f"checkpoint/round-{runs.case.rounds:06d}"
        for name in ("summary.json", "metrics.jsonl", f"{newest}/state.json", f"{newest}/arrays.safetensors"):
            assert (run_dir / name).is_file(), name
        assert json.loads((run_dir / "summary.json").read_text()) == summary
        assert summary["strategy"] == runs.name and summary["rounds"] == runs.case.rounds
        assert sorted(by_round(run_dir)) == list(range(1, runs.case.rounds + 1))
        _, meta = Checkpointer(run_dir / "checkpoint").load()
        assert meta["strategy"] == runs.name and meta["completed_rounds"] == runs.case.rounds
        for rnd in range(1, runs.case.rounds + 1):
            assert trained(run_dir, runs.case.train_kind, rnd), f"no site trained in round {rnd}"


def test_bad_replies_are_rejected_and_left_out(runs, request):
    expect_xfail(request, runs, "rejected")
    bad = runs.client(CORRUPTED)
    expected = {rnd: reason for rnd, (_, reason) in expected_rejections(runs.case).items()}
    for run_dir, summary in ((runs.full, runs.summary), (runs.resumed, runs.resumed_summary)):
        server = by_round(run_dir)
        for rnd, record in server.items():
            assert record["num_rejected"] == len(record["rejected"])
            if rnd in expected:
                assert len(record["rejected"]) == 1, record["rejected"]
                assert record["rejected"][0].startswith(f"{bad}: ") and expected[rnd] in record["rejected"][0]
                assert bad not in trained(run_dir, runs.case.train_kind, rnd), "a rejected reply was used"
            else:
                assert record["rejected"] == [], f"round {rnd}"
        assert summary["communication"]["rejected_replies"] == len(expected)
        for path, arrays in checkpoint_files(run_dir).items():
            for k, v in arrays.items():
                assert not np.issubdtype(v.dtype, np.floating) or np.isfinite(v).all(), f"{path}: {k}"
    assert UNEXPECTED in runs.full.joinpath("metrics.jsonl").read_text()  # the reason names the array


def test_a_silent_or_failing_node_is_survived_and_trains_again(runs, request):
    expect_xfail(request, runs, "failed")
    silent, crashing, stop, last = runs.client(SILENT), runs.client(CRASHING), runs.case.stop, runs.case.rounds
    for run_dir in (runs.full, runs.resumed):
        server = by_round(run_dir)
        for rnd, record in server.items():
            assert record["num_failed"] == len(record["failed"])
            if rnd == stop:  # silent for the whole round: every message it was sent is a "no reply"
                assert record["failed"] and set(record["failed"]) == {f"{silent}: no reply"}, record["failed"]
            elif rnd == last:
                assert len(record["failed"]) == 1, record["failed"]
                assert (
                    record["failed"][0].startswith(f"{crashing}: ") and "RuntimeError in train" in record["failed"][0]
                )
            else:
                assert record["failed"] == [], f"round {rnd}"
        assert silent not in trained(run_dir, runs.case.train_kind, stop)
        assert crashing not in trained(run_dir, runs.case.train_kind, last)
        assert silent in trained(run_dir, runs.case.train_kind, last), "the silent node takes part again"
    assert CRASH not in runs.full.joinpath("metrics.jsonl").read_text(), "the site's error message left the site"
    assert runs.summary["communication"]["failed_replies"] == sum(r["num_failed"] for r in by_round(runs.full).values())


def _timing(key: str) -> bool:
    return key == "time" or key.endswith("_s")


def canonical(value):
    """JSON values without timings, NaN comparable."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items() if not _timing(k)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


def same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert list(a) == list(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert np.array_equal(a[k], b[k]), f"{what}: {k} differs"


def client_state(run_dir: Path) -> dict[str, Path]:
    root = run_dir / "client-state"
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()} if root.is_dir() else {}


def sent_after(grid: InProcessGrid, stop: int) -> list[tuple[tuple, dict[str, np.ndarray]]]:
    """(round, type, partition) and arrays of every message after round ``stop`` but the queries (a resumed
    server asks every node again who it is)."""
    return [
        (
            (
                int(m.metadata.group_id),
                m.metadata.message_type,
                grid.contexts[m.metadata.dst_node_id].node_config["partition-id"],
            ),
            {f"{r}/{k}": v.numpy() for r, record in m.content.array_records.items() for k, v in record.items()},
        )
        for m in grid.sent
        if int(m.metadata.group_id) > stop and m.metadata.message_type != "query"
    ]


def test_resume_equals_uninterrupted(runs, request):
    expect_xfail(request, runs, "resume")
    stop, last = runs.case.stop, runs.case.rounds
    assert runs.stopped_meta["completed_rounds"] == stop
    assert {int(m.metadata.group_id) for m in runs.resumed_grid.sent} == set(range(stop + 1, last + 1)), (
        "the resumed run redid rounds"
    )
    # what the server sends after the resume (global arrays, aggregates, cluster modules, ...) is what it sent
    sent_a, sent_b = sent_after(runs.grid, stop), sent_after(runs.resumed_grid, stop)
    assert [key for key, _ in sent_a] == [key for key, _ in sent_b]
    for (key, a), (_, b) in zip(sent_a, sent_b):
        same_arrays(a, b, f"message {key}")
    a, meta_a = Checkpointer(runs.full / "checkpoint").load()
    b, meta_b = Checkpointer(runs.resumed / "checkpoint").load()
    same_arrays(a, b, "checkpoint")
    assert meta_a["strategy_meta"] == meta_b["strategy_meta"] and meta_b["completed_rounds"] == last
    files_a, files_b = checkpoint_files(runs.full), checkpoint_files(runs.resumed)
    assert list(files_a) == list(files_b)
    for path in files_a:
        same_arrays(files_a[path], files_b[path], f"checkpoint/{path}")
    kinds = {json.loads(line)["kind"] for line in (runs.full / "metrics.jsonl").read_text().splitlines()}
    for kind in sorted(kinds):  # eval, train, server, ... record by record: round, client, every metric
        assert canonical(records(runs.full, kind)) == canonical(records(runs.resumed, kind)), kind
    assert canonical(runs.summary) == canonical(runs.resumed_summary)
    state_a, state_b = client_state(runs.full), client_state(runs.resumed)
    assert list(state_a) == list(state_b)
    for path in state_a:
        if path.endswith(".safetensors"):
            same_arrays(load_file(str(state_a[path])), load_file(str(state_b[path])), f"client-state/{path}")
        else:
            assert state_a[path].read_bytes() == state_b[path].read_bytes(), path


def test_bytes_are_counted(runs, request):
    expect_xfail(request, runs, "bytes")
    down, up, honest_up = defaultdict(int), defaultdict(int), defaultdict(int)
    for message in runs.grid.sent:
        down[int(message.metadata.group_id)] += array_bytes(message)
    for reply in runs.grid.received:
        up[reply.round] += reply.bytes
        honest_up[reply.round] += reply.honest_bytes
    server = by_round(runs.full)
    for rnd, record in server.items():
        assert (record["bytes_down"], record["bytes_up"]) == (down[rnd], up[rnd]), f"round {rnd}"
        assert (down[rnd] == 0) == runs.case.no_arrays_down(rnd), f"round {rnd}: arrays down {down[rnd]}"
        assert (honest_up[rnd] > 0) == runs.case.arrays_up, f"round {rnd}: arrays up {honest_up[rnd]}"
    communication = runs.summary["communication"]
    assert communication["bytes_down"] == sum(down.values()) and communication["bytes_up"] == sum(up.values())


# ----------------------------------------------------------------------------- no runs needed
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_docstring_says_what_leaves_a_site(name):
    assert "Leaves a site:" in (STRATEGIES[name].__doc__ or ""), f"{STRATEGIES[name].__qualname__}'s docstring"


def test_the_cases_are_valid_and_an_exemption_says_why():
    assert {s for s, _ in XFAIL} <= set(STRATEGIES)
    for name, strategy in STRATEGIES.items():
        facts = strategy.contract_case
        assert set(facts) <= {f.name for f in fields(Case)}, f"{name}: unknown contract_case keys {set(facts)}"
        case = case_of(name)
        assert 1 <= case.stop < case.rounds, f"{name}: stop_after must fall inside the run"
        assert case.arrays_up or case.why, f"{name}: an exemption from sending arrays needs its reason"
        if case.not_a_federation:  # the pooled reference alone, with a test file of its own
            assert name == "pooled" and (ROOT / "tests" / "strategies" / "test_pooled.py").is_file(), name
