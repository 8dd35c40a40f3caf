"""Evaluation pooling: each site's evaluation logged, the round's pooled metrics from the sites' confusion counts,
an evaluation carried in the next round's training replies (evaluate-in-train), and the cross-site matrix after
the last round.

``EvaluationMixin`` is the part of ``FederatedStrategy`` (server.py) that turns evaluate replies into records;
``scalar_metrics`` picks the numbers of one evaluation.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..results import RESERVED_FIELDS
from ..training.metrics import CONFUSION, check_confusion, pooled_metrics
from .messaging import Reply, RoundStats


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an evaluation (reply metrics or a metrics.jsonl record): no lists (confusion counts), no record
    fields."""
    return {
        k: v
        for k, v in metrics.items()
        if k not in RESERVED_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class EvaluationMixin:
    """Evaluations: ``record_evaluation`` (log each site's, pool the confusion counts), ``evaluates_round``
    (run-config evaluate-every), ``evaluates_in_train`` and
    ``record_carried_evaluation`` (run-config evaluate-in-train), ``cross_site_evaluation`` (run-config
    cross-site-evaluation).

    Reads from the rest of ``FederatedStrategy``: ``cfg``, ``recorder``, ``stats``, ``num_classes``,
    ``completed_rounds``, ``total_rounds``, ``name``, ``round_label``, ``global_model``, ``model_classes`` and
    ``evaluate_content`` (server.py), ``exchange`` (messaging.py), ``refresh_nodes``, ``ordered_nodes`` and
    ``client_name`` (nodes.py).
    """

    def evaluates_round(self, rnd: int) -> bool:
        """Whether round ``rnd`` has an evaluate phase: every ``evaluate-every``-th round and the last one."""
        every = int(self.cfg.evaluate_every)
        return every <= 1 or rnd % every == 0 or rnd >= self.total_rounds()

    def evaluates_in_train(self, rnd: int) -> bool:
        """Whether round ``rnd``'s training messages ask for the previous round's evaluation first (run-config
        evaluate-in-train; the sites decide the same from the run config and the round)."""
        return bool(self.cfg.evaluate_in_train) and rnd > 1

    def record_evaluation(self, rnd: int, replies: list[Reply]) -> dict[str, Any]:
        """Log each site's evaluation of round ``rnd``; return the round's pooled metrics (for its server record).

        Pooled: the sum of the valid ``confusion`` counts of the sites that answered, i.e. the metric on the
        union of their test splits (SiFT reports balanced accuracy on one pooled test set). Counts are untrusted:
        a malformed one is logged, counted as rejected and left out; the site's other metrics are kept.
        """
        width = self.model_classes(self.num_classes)
        total, sites = np.zeros((width, width), dtype=np.int64), 0
        for reply in replies:
            metrics = dict(reply.metrics)
            if CONFUSION in metrics:
                counts, problem = check_confusion(metrics[CONFUSION], width, metrics.get("n"))
                if problem:
                    log(
                        WARNING,
                        "[medflower] %s %d evaluate: ignored the counts of %s: %s",
                        self.round_label,
                        rnd,
                        reply.client,
                        problem,
                    )
                    self.stats.rejected.append(f"{reply.client}: {problem}")
                    del metrics[CONFUSION]
                else:
                    total, sites = total + counts, sites + 1
            self.recorder.log_client(rnd, reply.client, "eval", metrics)
        return {**pooled_metrics(total), "pooled_sites": sites} if total.sum() > 0 else {}

    def record_carried_evaluation(self, grid: Grid, rnd: int, replies: list[Reply], asked: set[int]) -> None:
        """evaluate-in-train: round ``rnd - 1``'s evaluation, from the training replies of round ``rnd`` and an
        evaluate message (as round ``rnd - 1`` would have sent it) to the nodes not sampled for training. Its
        pooled metrics go into a server record of round ``rnd - 1`` of their own (``evaluated_in``: ``rnd``)."""
        evaluated = [Reply(r.node_id, r.client, OrderedDict(), r.evaluation, r.config) for r in replies if r.evaluation]
        for reply in replies:
            if not reply.evaluation:
                log(WARNING, "[medflower] round %d: %s sent no evaluation of round %d", rnd, reply.client, rnd - 1)
        # a node asked to train that failed has no evaluation of round rnd - 1 either (as if its evaluate failed)
        rest = {n: self.evaluate_content(rnd - 1, n) for n in self.ordered_nodes() if n not in asked}
        if rest:
            evaluated += self.exchange(grid, "evaluate", rest, rnd - 1)
        pooled = self.record_evaluation(rnd - 1, evaluated)
        if pooled:
            self.recorder.log_server(rnd - 1, evaluated_in=rnd, **pooled)
        log(INFO, "[medflower] %s %d evaluation: %s", self.round_label, rnd - 1, self.recorder.round_summary(rnd - 1))

    def cross_site_evaluation(self, grid: Grid) -> dict[str, Any]:
        """Run-config cross-site-evaluation, after the last round: the site x model matrix of the final models
        (summary.json's ``cross_site``; docs/experiments.md#cross-site-evaluation).

        ``matrix[site][model]``: the metrics of ``model`` on ``site``'s test split (and validation split, prefixed
        ``val_``). With one global model (``global_model``) each known site gets one evaluate message carrying it
        (``evaluate_content``, as the last round's evaluate phase sent it), its reply fills its row of the one column
        ``global``, and the messages' bytes go into a server record of their own (``cross_site``), so the run's
        communication totals count them. Otherwise each site's final model is its own and never leaves it (nor does
        the server send a model it makes for one site to another): the matrix is its diagonal, each site's own model
        on its own data as the last round's evaluation recorded it, and nothing is sent."""
        rnd = self.completed_rounds
        if rnd == 0:
            return {"round": 0, "models": [], "matrix": {}, "note": f"no {self.round_label} completed: no final model"}
        if not self.global_model:
            last = {r["client"]: r for r in self.recorder.records("eval") if r["round"] == rnd}
            return {
                "round": rnd,
                "models": sorted(last),
                "matrix": {site: {site: scalar_metrics(r)} for site, r in sorted(last.items())},
                "off_diagonal": (
                    f"not available: with strategy {self.name!r} each site's final model is its own and never "
                    "leaves it, so no site evaluates another site's model; the diagonal is each site's own model on "
                    f"its own data, from the evaluation of {self.round_label} {rnd}"
                ),
            }
        self.stats = RoundStats()
        started = time.monotonic()
        self.refresh_nodes(grid, rnd)  # a resumed run that had already finished knows no node yet
        contents = {n: self.evaluate_content(rnd, n) for n in self.ordered_nodes()}
        replies = self.exchange(grid, "evaluate", contents, rnd)
        self.recorder.log_server(
            rnd,
            cross_site=True,
            **self.stats.counts(),
            round_s=round(time.monotonic() - started, 3),
        )
        answered = {r.node_id for r in replies}
        result: dict[str, Any] = {
            "round": rnd,
            "models": ["global"],
            "matrix": {
                r.client: {"global": scalar_metrics(r.metrics)} for r in sorted(replies, key=lambda r: r.client)
            },
        }
        if missing := sorted(self.client_name(n) for n in contents if n not in answered):
            result["no_reply"] = missing
        log(
            INFO,
            "[medflower] cross-site evaluation: the global model of %s %d on %d of %d sites",
            self.round_label,
            rnd,
            len(replies),
            len(contents),
        )
        return result
