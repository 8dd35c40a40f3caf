"""The continual protocol's outputs (docs/methods/fedkei.md, "Outputs of a continual run"): per-task tables and
curves.

summary.json gets ``tasks`` (per task the mean over clients of the final AUC, LCA and AUC at initialisation, and
every client's values), ``final`` (the means over tasks, the paper's Table I) and ``per_client`` (each client's
mean over its tasks) from ``continual_summary``; ``ContinualReport`` writes summary.md's per-task table and
curves.png's test AUC after every epoch, task after task. ``task_curve_layout`` also lays out the comparison
plots of ``experiments.py``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...results import RunReport, cell, finite_mean, json_value

CONTINUAL_METRICS = ("auc", "lca", "auc_init")


def continual_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-task tables of a continual run (the paper's Table I): final AUC, LCA and the initial AUC.

    ``tasks``: per task the mean over clients and every client's values; ``final``: the mean over tasks
    of those means (overall AUC and LCA) plus ``task<t>_<metric>`` columns; ``per_client``: each client's
    mean over its tasks. Non-finite values (a test split without both labels) are left out of means.
    """
    by_task: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in evals:
        by_task[int(r.get("task", r["round"]))][r["client"]] = r
    tasks: dict[str, Any] = {}
    final: dict[str, Any] = {}
    for task in sorted(by_task):
        clients = by_task[task]
        means = {m: finite_mean(r.get(m) for r in clients.values()) for m in CONTINUAL_METRICS}
        tasks[str(task)] = {
            **means,
            "per_client": {c: {m: json_value(r.get(m)) for m in CONTINUAL_METRICS} for c, r in sorted(clients.items())},
        }
        final.update({f"task{task}_{m}": v for m, v in means.items()})
    for m in CONTINUAL_METRICS:
        final[m] = finite_mean(t[m] for t in tasks.values())
    names = sorted({c for clients in by_task.values() for c in clients})
    per_client = {
        c: {m: finite_mean(by_task[t][c].get(m) for t in by_task if c in by_task[t]) for m in CONTINUAL_METRICS}
        for c in names
    }
    return {"tasks": tasks, "final": final, "per_client": per_client}


def tasks_markdown(tasks: Mapping[str, Any], final: Mapping[str, Any]) -> list[str]:
    """Tasks as columns, then the overall mean: final AUC, LCA and AUC at initialisation (mean over clients)."""
    names = list(tasks)
    lines = [
        "| metric | " + " | ".join(f"task {t}" for t in names) + " | overall |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    labels = {"auc": "final AUC", "lca": "LCA", "auc_init": "AUC at init"}
    for m in CONTINUAL_METRICS:
        lines.append(
            f"| {labels[m]} | " + " | ".join(cell(tasks[t].get(m)) for t in names) + f" | {cell(final.get(m))} |"
        )
    return lines


def task_curve_layout(curves: Mapping[int, list[list[Any]]]) -> tuple[dict[int, int], list[float], list[float]]:
    """Per-epoch AUC curves laid out task after task.

    ``curves`` maps each task to its curves (one per site, or per site and seed). Returns each task's
    first x position, and the x and mean-curve values (NaN between tasks, so a line breaks there).
    """
    starts: dict[int, int] = {}
    xs: list[float] = []
    ys: list[float] = []
    offset = 0
    for task in sorted(curves):
        starts[task] = offset
        length = max(len(c) for c in curves[task])
        for i in range(length):
            mean = finite_mean(c[i] for c in curves[task] if i < len(c))
            xs.append(offset + i)
            ys.append(math.nan if mean is None else mean)
        xs.append(math.nan)
        ys.append(math.nan)
        offset += length
    return starts, xs, ys


def plot_task_curves(evals: list[dict[str, Any]], path: Path, title: str) -> None:
    """Continual runs: test AUC after every epoch (epoch 0 = the initialisation), task after task;
    one thin line per client, the mean in bold, a dotted line at every task boundary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_task: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in evals:
        if isinstance(r.get("auc_curve"), list):
            by_task[int(r.get("task", r["round"]))].append(r)
    starts, xs, mean = task_curve_layout({t: [r["auc_curve"] for r in rs] for t, rs in by_task.items()})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(by_task)), 3.4))
    colours: dict[str, str] = {}
    for task, start in starts.items():
        for r in sorted(by_task[task], key=lambda r: r["client"]):
            colour = colours.setdefault(r["client"], f"C{len(colours) % 10}")
            ax.plot(
                range(start, start + len(r["auc_curve"])),
                [math.nan if v is None else v for v in r["auc_curve"]],
                lw=0.8,
                alpha=0.5,
                color=colour,
                label=r["client"] if task == min(starts) else None,
            )
        ax.axvline(start - 0.5, ls=":", color="grey")
        length = max(len(r["auc_curve"]) for r in by_task[task])
        ax.text(start + length / 2, 1.0, f"task {task}", ha="center", va="bottom", fontsize=8)
    ax.plot(xs, mean, lw=2.2, color="black", label="mean")
    ax.set_xlabel("epoch (0 = initialisation), task after task")
    ax.set_ylabel("test AUC")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, pad=14)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ContinualReport(RunReport):
    """summary.md and curves.png of a continual run (FedKEI): one iteration is a task."""

    unit = "tasks"

    def title(self, summary: Mapping[str, Any]) -> str:
        """The strategy with its variant (``fedkei (variant C)``)."""
        variant = summary.get("variant")
        return f"{summary['strategy']} (variant {variant})" if variant else str(summary["strategy"])

    def sections(self, summary: Mapping[str, Any]) -> list[str]:
        return tasks_markdown(summary["tasks"], summary["final"]) + ["", "Per client, mean over its tasks:", ""]

    def columns(self, summary: Mapping[str, Any]) -> list[str]:
        return list(CONTINUAL_METRICS)

    def plot(self, evals: list[dict[str, Any]], path: Path, title: str) -> None:
        """The per-epoch AUC curves, task after task (per-round curves when no record has one)."""
        if any("auc_curve" in r for r in evals):
            plot_task_curves(evals, path, title)
        else:
            super().plot(evals, path, title)
