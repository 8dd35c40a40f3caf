"""Secure aggregation: Flower's SecAgg+ for the strategies whose aggregate is only a weighted sum of the sites'
updates (docs/privacy.md#secure-aggregation).

With ``secagg=true`` a round's training runs as Flower's ``SecAggPlusWorkflow`` (Bell et al. 2020): the sites agree
on pairwise masks, each sends its n_k-weighted update quantised and masked, and the server can unmask only their sum.
It never sees one site's update; a site that drops out after the masks were agreed is unmasked from the key shares
of the others, as long as ``secagg-reconstruction-threshold`` of its neighbours answer.

Flower's workflow speaks the legacy FitIns/FitRes records and its client mod masks a FitRes. The two bridges here
translate, on each side, between them and medflower's messages, so the strategies and their ClientApp handlers stay
as they are: the server sends each site the same training content as without SecAgg (plus the arrays' names), the
site trains as always (``dp='site'`` noise included, which makes the sum distributed DP), and sends back the update,
reply − received, which is small and centred and so quantises well.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from ..options import Option, bad, non_negative, positive

SECAGG_OPTIONS: tuple[Option, ...] = (
    Option(
        "secagg",
        False,
        "Flower's SecAgg+ for the training sum: the server learns only the n_k-weighted sum of the sites' updates "
        "(fedavg, fedprox, lat); docs/privacy.md#secure-aggregation",
        None,
        "privacy",
    ),
    Option(
        "secagg-num-shares",
        0,
        "SecAgg+: each site's secrets are split among this many sites (itself and its neighbours); 0 = every site "
        "sampled in the round",
        non_negative,
        "privacy",
    ),
    Option(
        "secagg-reconstruction-threshold",
        0,
        "SecAgg+: shares needed to unmask a site (fewer colluding sites learn nothing; more dropouts stop the round); "
        "0 = a majority of the shares, at least 2",
        non_negative,
        "privacy",
    ),
    Option(
        "secagg-clipping-range",
        8.0,
        "SecAgg+: each entry of a site's weighted update is clipped to ±this before it is quantised",
        positive,
        "privacy",
    ),
)


class SecureRoundError(RuntimeError):
    """A round that SecAgg+ cannot run (too few sites for its shares and threshold): the server skips it."""


NAMES = "secagg-names"  # the training message's config entry naming the arrays, in order (FitIns has a list only)
MAX_WEIGHT = "secagg-max-weight"  # the round's max_weight, so that a site's bridge caps its own weight at it


# ----------------------------------------------------------------------------- the run config
def check_secagg_config(cfg, strategy_name: str, able: bool, supported: list[str]) -> None:
    """Refuse SecAgg+ for a strategy that needs individual updates, with dp='server', or with a threshold above the
    shares."""
    if not cfg.secagg:
        return
    if not able:
        raise bad(
            "secagg",
            True,
            f"strategy {strategy_name!r} needs each site's update, not only their sum "
            f"(docs/privacy.md#secure-aggregation); secagg works with {', '.join(supported)}",
        )
    if cfg.dp == "server":
        raise bad(
            "secagg",
            True,
            "dp='server' clips every site's update on the server, which SecAgg+ hides from it; use dp='site' "
            "(each site clips and noises its own update before it is masked)",
        )
    if cfg.max_client_share < 1:
        raise bad(
            "secagg",
            True,
            f"max-client-share = {cfg.max_client_share:g} caps each site's weight, which SecAgg+ hides from the "
            "server; use max-client-share = 1 with secagg",
        )
    if cfg.secagg_num_shares == 1:
        raise bad("secagg-num-shares", 1, "a site's secrets need at least 2 shares (0 = every site of the round)")
    if cfg.secagg_num_shares and cfg.secagg_reconstruction_threshold >= cfg.secagg_num_shares:
        raise bad(
            "secagg-reconstruction-threshold",
            cfg.secagg_reconstruction_threshold,
            f"is not less than secagg-num-shares = {cfg.secagg_num_shares}: Flower's SecAgg+ needs fewer shares to "
            "reconstruct than it deals, so that a site that leaves can be unmasked",
        )
    if cfg.secagg_reconstruction_threshold == 1:
        raise bad("secagg-reconstruction-threshold", 1, "one share would let a single site unmask another; use >= 2")


MIN_SITES = 3  # with 2, each site reads the other's update: the new global model minus its own


def shares_and_threshold(cfg, num_sites: int) -> tuple[int, int] | str:
    """The round's (shares, threshold), or why a round of ``num_sites`` sites cannot be secured: fewer than
    MIN_SITES sites (then each site could subtract its own update from the new global model and read the other's,
    and Flower's workflow wants more than 2 shares), or secagg-num-shares / secagg-reconstruction-threshold beyond
    the sites present. The server skips such a round (the model is unchanged) instead of stopping the run."""
    if num_sites < MIN_SITES:
        return (
            f"SecAgg+ needs at least {MIN_SITES} sites in a round and this round has {num_sites} (with 2, each site "
            "could read the other's update from the new global model)"
        )
    shares = cfg.secagg_num_shares or num_sites
    threshold = cfg.secagg_reconstruction_threshold or max(2, shares // 2 + 1)
    if shares > num_sites:
        return f"secagg-num-shares = {shares} is more than the {num_sites} sites of this round"
    if threshold >= shares:
        return f"the reconstruction threshold {threshold} needs fewer than the {shares} shares of this round"
    return shares, threshold


# ----------------------------------------------------------------------------- the server's bridge
def protocol_bytes(content: RecordDict) -> int:
    """Bytes SecAgg+ carries in config records (keys, encrypted shares, masked vectors), beside any arrays."""
    total = 0
    for record in content.config_records.values():
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            total += sum(len(v) for v in items if isinstance(v, bytes))
    return total


class _ByteCountingGrid:
    """The grid as the workflow uses it (send_and_receive), counting the bytes of every message and reply."""

    def __init__(self, grid, count: Callable[[RecordDict, bool], None]):
        self._grid, self._count = grid, count

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            self._count(m.content, True)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            if not r.has_error():
                self._count(r.content, False)
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def secure_mean_update(
    grid,
    rnd: int,
    contents: Mapping[int, RecordDict],
    weight_cap: float,
    cfg,
    count: Callable[[RecordDict, bool], None],
) -> tuple[OrderedDict[str, np.ndarray] | None, list[tuple[int, Any]]]:
    """One round of SecAgg+ over ``contents`` (node id -> medflower training content): the n_k-weighted mean of the
    sites' updates (None when the protocol halted: too few sites left) and the (node id, FitRes) of the sites whose
    masked update is in it (their metrics; their parameters are the mean, never their own)."""
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import Strategy
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    from ..records import from_record

    names: list[str] = []
    fitins: dict[int, FitIns] = {}
    for node_id, content in contents.items():
        arrays = from_record(content["arrays"])
        names = list(arrays)
        config = {**dict(content["config"]), NAMES: "\n".join(names), MAX_WEIGHT: float(weight_cap)}
        fitins[node_id] = FitIns(ndarrays_to_parameters(list(arrays.values())), config)
    proxies = {n: GridClientProxy(n, grid, 0) for n in fitins}

    class SumOnly(Strategy):
        """The legacy strategy the workflow drives: the sites of this round; it keeps what the workflow returns."""

        def __init__(self):
            self.outcome: tuple[Any, list] = (None, [])

        def initialize_parameters(self, client_manager):
            return None

        def configure_fit(self, server_round, parameters, client_manager):
            return [(proxies[n], fitins[n]) for n in fitins]

        def aggregate_fit(self, server_round, results, failures):
            mean = results[0][1].parameters if results else None
            self.outcome = (mean, [(p.node_id, res) for p, res in results])
            return mean, {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    plan = shares_and_threshold(cfg, len(contents))
    if isinstance(plan, str):
        raise SecureRoundError(plan)
    shares, threshold = plan
    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd}),
            MAIN_PARAMS_RECORD: ArrayRecord(),  # the workflow reads it; each site's content is in SumOnly
        }
    )
    strategy = SumOnly()
    context = LegacyContext(
        Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
        strategy=strategy,
        client_manager=SimpleClientManager(),
    )
    workflow = SecAggPlusWorkflow(
        shares,
        threshold,
        max_weight=weight_cap,
        clipping_range=cfg.secagg_clipping_range,
        timeout=cfg.round_timeout,
    )
    workflow(_ByteCountingGrid(grid, count), context)
    mean, results = strategy.outcome
    if mean is None:
        return None, results
    return OrderedDict(zip(names, parameters_to_ndarrays(mean))), results


# ----------------------------------------------------------------------------- the site's bridge
def secagg_mod(msg: Message, context: Context, call_next):
    """ClientApp mod: a training message of the SecAgg+ protocol goes through Flower's ``secaggplus_mod``, whose
    training stage calls the ClientApp through the bridge below; every other message passes untouched."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type != "train" or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    return secaggplus_mod(msg, context, _medflower_training(call_next))


def _medflower_training(call_next):
    """The SecAgg+ training stage as a medflower training message: FitIns in, the site's update (reply − received)
    and its metrics out as a FitRes for the mod to mask."""

    def bridge(msg: Message, context: Context) -> Message:
        import flwr.compat.common.recorddict_compat as compat
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

        from ..records import from_record, to_record

        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        names = str(fitins.config.get(NAMES, "")).split("\n")
        arrays = parameters_to_ndarrays(fitins.parameters)
        if len(names) != len(arrays):
            raise ValueError(f"secagg: the training message names {len(names)} arrays and carries {len(arrays)}")
        received = OrderedDict(zip(names, arrays))
        config = {k: v for k, v in fitins.config.items() if k not in (NAMES, MAX_WEIGHT)}
        msg.content = RecordDict({"arrays": to_record(received), "config": ConfigRecord(config)})
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        sent = from_record(reply.content["arrays"])
        if list(sent) != names:
            raise ValueError("secagg: the site's reply does not update exactly the arrays it received")
        update = [np.asarray(sent[n], dtype=np.float32) - np.asarray(received[n], dtype=np.float32) for n in names]
        metrics = {k: v for k, v in reply.content["metrics"].items() if isinstance(v, (int, float))}
        weight = _count(metrics, fitins.config.get(MAX_WEIGHT))
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), weight, metrics)
        out = compat.fitres_to_recorddict(fitres, keep_input=True)
        out.config_records["info"] = reply.content["info"]
        return Message(out, reply_to=msg)

    return bridge


def _count(metrics: Mapping[str, Any], max_weight: Any = None) -> int:
    """The site's weight n_k for the masked sum: its num-examples, at least 1, and at most the round's max_weight
    (Flower's mod would otherwise let a weight above it overflow the quantised sum)."""
    n = metrics.get("num-examples", 1)
    n = int(n) if isinstance(n, (int, float)) and math.isfinite(n) and n >= 1 else 1
    if isinstance(max_weight, (int, float)) and math.isfinite(max_weight) and max_weight >= 1:
        n = min(n, int(max_weight))
    return n
