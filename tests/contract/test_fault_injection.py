"""Malformed replies from one node, through the real ServerApp/ClientApp code, for every registered strategy.

Two runs per strategy (its ``contract_case``, read by tests/contract/test_contract.py, 3 in-process nodes):
- faulty: partition 1 answers its round-1 query with a malformed query reply (so it is refused and asked again
  at round 2, where it joins), then answers every later message of every phase (train, evaluate, custom actions
  such as FedKEI's inner step or a SiFT hop) with a malformed reply: of the ``REPLY_FAULTS`` that apply to the
  reply at hand, the kind sent least so far in the session, so the matrix as a whole sends every kind;
- reference: partition 1 does not answer those same messages at all.
Checks: the faulty run completes; every injected fault is one rejected reply in its round, with its reason; the
other sites' records, the server's records (but its failure lists and byte counts) and the checkpoint equal the
reference run's: a rejected reply leaves no more trace than a silent node. A strategy where that cannot hold
gets a ``DIFFERS`` entry with the reason.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from helpers import TINY, records, restart_processes, run_dir_of
from test_contract import canonical, case_of, same_arrays

from medflower.contract import Checkpointer
from medflower.inprocess import InProcessGrid, run_inprocess
from medflower.strategies import STRATEGIES

NUM_NODES = 3
FAULTY = 1  # partition (node 2)
HONEST = (0, 2)
DIFFERS: dict[str, str] = {}  # strategy -> why the other sites' results may differ from the reference's


@dataclass(frozen=True)
class Fault:
    name: str
    reason: str  # what the server's rejection must say
    applies: Callable[[Message], bool]
    inject: Callable[[Message, dict], None]


def _metrics(m: Message) -> dict:
    return m.content["metrics"] if "metrics" in m.content.metric_records else {}


def _float_array(m: Message) -> str | None:
    if "arrays" not in m.content.array_records:
        return None
    record = m.content["arrays"]
    return next((k for k in record if np.dtype(record[k].dtype).kind == "f" and math.prod(record[k].shape)), None)


def _replace(m: Message, change: Callable[[np.ndarray], np.ndarray]) -> None:
    record = m.content["arrays"]
    name = _float_array(m)
    record[name] = Array(change(record[name].numpy()))


def _raw(m: Message, data: Callable[[Array], bytes]) -> None:
    record = m.content["arrays"]
    name = _float_array(m)
    a = record[name]
    record[name] = Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=data(a))


def _set(record: str, key: str, value) -> Callable[[Message, dict], None]:
    def inject(m: Message, ctx: dict) -> None:
        m.content[record][key] = value

    return inject


def _delete(record: str) -> Callable[[Message, dict], None]:
    return lambda m, ctx: m.content.__delitem__(record)


def _add_arrays(m: Message, ctx: dict) -> None:
    m.content["arrays"] = ArrayRecord({"smuggled": Array(np.zeros(4, np.float32))})


def _always(m: Message) -> bool:
    return True


def _has_arrays(m: Message) -> bool:
    return _float_array(m) is not None


def _has(key: str) -> Callable[[Message], bool]:
    return lambda m: key in _metrics(m)


COMMON = [
    Fault("nan-metric", "not a finite number", _always, _set("metrics", "loss", float("nan"))),
    Fault("reserved-metric", "reserved for the record's own fields", _always, _set("metrics", "round", 7.0)),
    Fault("missing-info", "no 'info' record", _always, _delete("info")),
    Fault("float-partition", "partition-id must be an integer", _always, _set("info", "partition-id", 1.5)),
    Fault("unexpected-record", "unexpected record", _always, lambda m, ctx: m.content.__setitem__("x", ConfigRecord())),
]
REPLY_FAULTS = [
    Fault("nan-array", "NaN/Inf", _has_arrays, lambda m, ctx: _replace(m, lambda v: np.full_like(v, np.nan))),
    Fault("huge-values", "beyond ±", _has_arrays, lambda m, ctx: _replace(m, lambda v: np.full_like(v, 1e20))),
    Fault("wrong-dtype", "has dtype", _has_arrays, lambda m, ctx: _replace(m, lambda v: v.astype(np.float64))),
    Fault(
        "wrong-shape",
        "has shape",
        _has_arrays,
        lambda m, ctx: _replace(m, lambda v: np.concatenate([v.reshape(-1), v.reshape(-1)[:1]])),
    ),
    Fault("not-npy", "not a valid npy", _has_arrays, lambda m, ctx: _raw(m, lambda a: b"\x93NUMPY" + b"\0" * 200)),
    Fault("padded", "bytes, at most", _has_arrays, lambda m, ctx: _raw(m, lambda a: a.data + b"\0" * 65536)),
    Fault("missing-arrays", "wrong array names", _has_arrays, _delete("arrays")),
    Fault(
        "unexpected-array",
        "wrong array names",
        _has_arrays,
        lambda m, ctx: m.content["arrays"].__setitem__("smuggled", Array(np.zeros(3, np.float32))),
    ),
    Fault("arrays-where-none", "where none are expected", lambda m: "arrays" not in m.content, _add_arrays),
    Fault("inflated-examples", "exceeds the", _has("num-examples"), _set("metrics", "num-examples", 1e9)),
    Fault("fractional-examples", "non-negative integer", _has("num-examples"), _set("metrics", "num-examples", 2.5)),
    Fault("negative-examples", "non-negative integer", _has("num-examples"), _set("metrics", "num-examples", -4.0)),
    Fault("identity", "identity changed", _always, _set("info", "client", "impostor")),
    *COMMON,
]
QUERY_FAULTS = [
    Fault("num-train-nan", "not a finite number", _always, _set("metrics", "num-train", float("nan"))),
    Fault("num-train-negative", "non-negative integer", _always, _set("metrics", "num-train", -3.0)),
    Fault("num-train-missing", "must declare num-train", _always, lambda m, ctx: m.content["metrics"].pop("num-train")),
    Fault("duplicate-site", "already held by node 1", _always, lambda m, ctx: _set("info", "client", ctx[0])(m, ctx)),
    Fault("duplicate-partition", "already held by node 1", _always, _set("info", "partition-id", 0)),
    Fault("query-arrays", "where none are expected", _always, _add_arrays),
    *COMMON,
]
# Method-specific values a query declares: one site's budget or capacity that cannot work.
METHOD_QUERY_FAULTS = [
    Fault("n-frequency", "does not fit the q/k matrices", _has("n-frequency"), _set("metrics", "n-frequency", 1e9)),
    Fault("capacity", "capacity must lie in (0, 1]", _has("capacity"), _set("metrics", "capacity", 2.0)),
]


USED: Counter[str] = Counter()  # reply faults sent so far in this session: the next reply gets the least sent kind


@dataclass
class Injected:
    round: int
    phase: str
    fault: str
    reason: str


class Injector:
    """Wraps InProcessGrid.send_and_receive: partition 1's replies are malformed (faulty) or dropped (reference)."""

    def __init__(self, index: int, faulty: bool):
        self.index, self.faulty = index, faulty
        self.cursor = 5 * index  # where this strategy starts in REPLY_FAULTS
        self.injected: list[Injected] = []
        self.clients: dict[int, str] = {}

    def targeted(self, rnd: int, message_type: str) -> bool:
        return (message_type == "query" and rnd == 1) or message_type != "query"

    def pick(self, reply: Message, query: bool) -> Fault:
        if query:
            specific = [f for f in METHOD_QUERY_FAULTS if f.applies(reply)]
            return specific[0] if specific else QUERY_FAULTS[self.index % len(QUERY_FAULTS)]
        order = [REPLY_FAULTS[(self.cursor + step) % len(REPLY_FAULTS)] for step in range(len(REPLY_FAULTS))]
        applicable = [f for f in order if f.applies(reply)]
        if applicable:
            fault = min(applicable, key=lambda f: USED[f.name])  # the least sent kind so far, then cycle order
            USED[fault.name] += 1
            self.cursor = REPLY_FAULTS.index(fault) + 1
            return fault
        raise AssertionError("no fault applies")

    def wrap(self, original):
        injector = self

        def send_and_receive(grid: InProcessGrid, messages, *, timeout=None):
            out = []
            for message in messages:
                rnd, message_type = int(message.metadata.group_id), message.metadata.message_type
                partition = int(grid.contexts[message.metadata.dst_node_id].node_config["partition-id"])
                target = partition == FAULTY and injector.targeted(rnd, message_type)
                if target and not injector.faulty:
                    continue  # the reference: no answer
                for reply in original(grid, [message], timeout=timeout):
                    if not reply.has_error():
                        injector.clients.setdefault(partition, str(reply.content["info"]["client"]))
                        if target:
                            fault = injector.pick(reply, message_type == "query")
                            fault.inject(reply, injector.clients)
                            injector.injected.append(Injected(rnd, message_type, fault.name, fault.reason))
                    out.append(reply)
            return out

        return send_and_receive


@dataclass
class Pair:
    name: str
    faulty: Path
    reference: Path
    summary: dict
    injector: Injector
    clients: dict[int, str]


@pytest.fixture(scope="module", params=sorted(STRATEGIES))
def pair(request, tmp_path_factory) -> Pair:
    name = request.param
    case = case_of(name)
    base = {**TINY, "output-dir": str(tmp_path_factory.mktemp(f"faults-{name}")), "strategy": name, **case.config}
    index = sorted(STRATEGIES).index(name)
    runs = {}
    for faulty in (True, False):
        config = {**base, "run-name": "faulty" if faulty else "reference"}
        injector = Injector(index, faulty)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(InProcessGrid, "send_and_receive", injector.wrap(InProcessGrid.send_and_receive))
            restart_processes()
            summary, _ = run_inprocess(config, NUM_NODES)
        runs[faulty] = (run_dir_of(config), summary, injector)
    faulty_dir, summary, injector = runs[True]
    return Pair(name, faulty_dir, runs[False][0], summary, injector, injector.clients)


def test_the_run_completes_and_every_fault_is_one_rejection_with_its_reason(pair):
    assert pair.injector.injected, "nothing was injected"
    assert pair.summary["rounds"] == max(r["round"] for r in records(pair.faulty, "server"))
    server = {r["round"]: r for r in records(pair.faulty, "server")}
    by_round: dict[int, list[Injected]] = {}
    for item in pair.injector.injected:
        by_round.setdefault(item.round, []).append(item)
    for rnd, record in server.items():
        expected = by_round.get(rnd, [])
        assert record["num_rejected"] == len(expected), (rnd, record["rejected"], expected)
        for item in expected:  # a node forgotten earlier in the round (a changed identity or count) is not joined
            assert any(item.reason in line or "has not joined" in line for line in record["rejected"]), (
                item,
                record["rejected"],
            )
    bad = pair.clients[FAULTY]
    for kind in ("train", "eval"):
        assert all(r["client"] not in (bad, "impostor") for r in records(pair.faulty, kind)), (
            "a rejected reply was used"
        )


NOT_COMPARED = {"failed", "rejected", "num_failed", "num_rejected", "bytes_down", "bytes_up", "bytes"}


def test_the_other_sites_results_equal_a_run_without_the_faulty_node(pair, request):
    if pair.name in DIFFERS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=DIFFERS[pair.name]))
    honest = {pair.clients[p] for p in HONEST}
    for kind in ("train", "eval"):
        a = [r for r in records(pair.faulty, kind) if r["client"] in honest]
        b = [r for r in records(pair.reference, kind) if r["client"] in honest]
        assert canonical(a) == canonical(b), kind
    strip = [{k: v for k, v in r.items() if k not in NOT_COMPARED} for r in records(pair.faulty, "server")]
    ref = [{k: v for k, v in r.items() if k not in NOT_COMPARED} for r in records(pair.reference, "server")]
    assert canonical(strip) == canonical(ref)
    a, meta_a = Checkpointer(pair.faulty / "checkpoint").load()
    b, meta_b = Checkpointer(pair.reference / "checkpoint").load()
    same_arrays(a, b, "checkpoint")
    assert meta_a["strategy_meta"] == meta_b["strategy_meta"]
