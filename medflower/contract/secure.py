"""Secure aggregation: the training phase as Flower's SecAgg+ (run-config secagg), whose only result is the
n_k-weighted mean of the sites' updates.

``SecureAggregationMixin`` is the part of ``FederatedStrategy`` (server.py) that runs that phase
(medflower/privacy/secagg.py holds the protocol) and applies the mean.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from logging import WARNING

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..options import ConfigError
from ..records import median_capped, record_bytes, validate_arrays
from .replies import RejectedReply, check_metric_values


class SecureAggregationMixin:
    """SecAgg+ rounds: ``secure_train`` (the training phase, checked like a reply) and ``aggregate_secure`` (the
    global arrays plus the mean update; a method with ``secagg = True`` may override it).

    Reads from the rest of ``FederatedStrategy``: ``cfg``, ``recorder``, ``stats``, ``nodes``,
    ``completed_rounds``, ``global_arrays`` and ``reply_spec`` (server.py), ``client_name`` (nodes.py).
    """

    def secure_train(self, grid: Grid, rnd: int, contents: Mapping[int, RecordDict]) -> None:
        """The training phase as Flower's SecAgg+ (medflower/privacy/secagg.py): only the n_k-weighted mean of the
        sites' updates reaches ``aggregate_secure``. It is checked like a reply (names, shapes, finite, within
        reply-value-limit); each site's training metrics are checked like a reply's before they are logged."""
        from ..privacy.secagg import SecureRoundError, protocol_bytes, secure_mean_update

        def count(content: RecordDict, down: bool) -> None:
            size = record_bytes(content) + protocol_bytes(content)
            if down:
                self.stats.bytes_down += size
            else:
                self.stats.bytes_up += size

        # max_weight: the largest declared size, each capped at max-weight-over-median × the median (3+ sites), so
        # that one site's declaration cannot shrink the honest weights below the quantisation's resolution
        declared = [self.nodes[n].num_train for n in contents if n in self.nodes]
        cap = float(max(median_capped(declared, self.cfg.max_weight_over_median)))
        try:
            mean, results = secure_mean_update(grid, rnd, contents, float(max(cap, 1)), self.cfg, count)
        except Exception as err:  # a round that cannot be secured, or the workflow failing: skipped, never the run
            why = str(err) if isinstance(err, SecureRoundError) else f"{type(err).__name__}: {str(err)[:300]}"
            if isinstance(err, SecureRoundError) and self.completed_rounds == 0:
                raise ConfigError(  # no round of this federation was ever secured: a run that would train nothing
                    f"run-config 'secagg' = True cannot run: {why}; set min-nodes to the sites SecAgg+ needs "
                    "(docs/privacy.md#secure-aggregation)"
                ) from None
            log(WARNING, "[medflower] round %d: SecAgg+ round skipped: %s; the model is unchanged", rnd, why)
            self.stats.failed.append(f"secagg: round skipped: {why}")
            self.stats.extra["secagg_sites"] = 0
            return
        for node_id, fitres in results:
            # Untrusted like any reply's metrics; a bad set is dropped, but the site's masked update stays in the
            # sum: SecAgg+ cannot take one site out of it (nor check its weight n_k, docs/privacy.md).
            client = self.client_name(node_id)
            try:
                self.recorder.log_client(rnd, client, "train", check_metric_values(dict(fitres.metrics)))
            except RejectedReply as exc:
                log(WARNING, "[medflower] round %d: ignored the training metrics of %s: %s", rnd, client, exc)
                self.stats.rejected.append(f"{client}: {exc}")
        self.stats.extra["secagg_sites"] = len(results)
        self.stats.trained = len(results)
        started = time.monotonic()
        spec = self.reply_spec(next(iter(contents)))
        if mean is not None and list(mean) == list(spec):  # dequantised in float64: back to the arrays' dtypes
            mean = OrderedDict((k, np.asarray(v, dtype=spec[k][1])) for k, v in mean.items())
        problem = "the protocol halted (too few sites answered)" if mean is None else validate_arrays(mean, spec)
        if problem is None and any(np.abs(v).max(initial=0) > self.cfg.reply_value_limit for v in mean.values()):
            problem = f"a value beyond reply-value-limit = {self.cfg.reply_value_limit:g}"
        if problem:
            log(WARNING, "[medflower] round %d: SecAgg+ gave no usable sum: %s; the model is unchanged", rnd, problem)
            self.stats.failed.append(f"secagg: {problem}")
        else:
            self.aggregate_secure(rnd, mean, [node_id for node_id, _ in results])
        self.stats.aggregation_s += time.monotonic() - started

    def aggregate_secure(self, rnd: int, mean_update: Mapping[str, np.ndarray], sites: list[int]) -> None:
        """With secagg: the global arrays plus the n_k-weighted mean update of ``sites`` (the nodes in the sum)."""
        self.global_arrays = OrderedDict(
            (k, np.asarray(v + mean_update[k], dtype=v.dtype)) for k, v in self.global_arrays.items()
        )
