"""The class-incremental protocol's outputs (every strategy of it; docs/methods/pfedmxf.md, "Results"):
accuracy over the classes seen so far after every task, and the paper's Last and Avg.

``incremental_summary`` gives summary.json's ``incremental`` table and its ``final`` (Last, Avg, pooled over the
sites' test rows and as a mean over sites, and the AAC router's accuracies after the last task);
``IncrementalReport`` puts the table into summary.md. curves.png is the default per-round plot.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ...results import RunReport, cell, finite_mean, json_value

INCREMENTAL_METRICS = ("accuracy", "router_accuracy", "within_task_accuracy")


def _pooled(records: list[dict[str, Any]], metric: str) -> float | None:
    """Σ_k metric_k n_k / Σ_k n_k: the metric on the union of the sites' test splits."""
    pairs = [
        (r[metric], r.get("n", 0))
        for r in records
        if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric]) and r.get("n", 0) > 0
    ]
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else None


def incremental_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over the seen classes after every task (the evaluation of each task's last round).

    ``incremental``: per task the pooled accuracy (all sites' test rows together), the mean over sites and
    each site's value; ``final``: ``last`` (after the last task) and ``avg`` (mean over tasks) of the pooled
    accuracy, the same over site means, and the router's accuracies (AAC) after the last task.
    """
    by_task: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in evals:
        if r.get("task_end"):
            by_task[int(r["task"])][r["client"]] = r  # the last evaluation of the task per site
    tasks: dict[str, Any] = {}
    for task in sorted(by_task):
        clients = by_task[task]
        tasks[str(task)] = {
            **{m: _pooled(list(clients.values()), m) for m in INCREMENTAL_METRICS},
            "mean_over_sites": finite_mean(r.get("accuracy") for r in clients.values()),
            "per_client": {c: json_value(r.get("accuracy")) for c, r in sorted(clients.items())},
        }
    final: dict[str, Any] = {}
    if tasks:
        last = tasks[list(tasks)[-1]]
        final = {
            "last": last["accuracy"],
            "avg": finite_mean(t["accuracy"] for t in tasks.values()),
            "last_site_mean": last["mean_over_sites"],
            "avg_site_mean": finite_mean(t["mean_over_sites"] for t in tasks.values()),
            "accuracy": last["accuracy"],
            **{m: last[m] for m in INCREMENTAL_METRICS[1:] if last[m] is not None},
        }
    return {"incremental": tasks, "final": final}


def incremental_markdown(tasks: Mapping[str, Any], final: Mapping[str, Any]) -> list[str]:
    names = list(tasks)
    lines = [
        "Accuracy over all classes seen so far, after each task (all sites' test rows pooled):",
        "",
        "| | " + " | ".join(f"task {t}" for t in names) + " | Last | Avg |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    lines.append(
        "| accuracy | "
        + " | ".join(cell(tasks[t]["accuracy"]) for t in names)
        + f" | {cell(final.get('last'))} | {cell(final.get('avg'))} |"
    )
    lines.append(
        "| mean over sites | "
        + " | ".join(cell(tasks[t]["mean_over_sites"]) for t in names)
        + f" | {cell(final.get('last_site_mean'))} | {cell(final.get('avg_site_mean'))} |"
    )
    for m in INCREMENTAL_METRICS[1:]:
        if any(tasks[t].get(m) is not None for t in names):
            lines.append(f"| {m.replace('_', ' ')} | " + " | ".join(cell(tasks[t].get(m)) for t in names) + " | | |")
    return lines + [""]


class IncrementalReport(RunReport):
    """summary.md of a class-incremental run: the per-task accuracy table before the per-client table."""

    def title(self, summary: Mapping[str, Any]) -> str:
        """The strategy with its classifier (``pfedmxf (aac classifier)``)."""
        classifier = summary.get("classifier")
        return f"{summary['strategy']} ({classifier} classifier)" if classifier else str(summary["strategy"])

    def sections(self, summary: Mapping[str, Any]) -> list[str]:
        return incremental_markdown(summary["incremental"], summary["final"])
