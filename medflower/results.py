"""Run outputs: metrics.jsonl, summary.json, summary.md and curves.png (docs/experiments.md, "Outputs").

``metrics.jsonl`` has one JSON object per line:
- ``{"kind": "train"|"eval", "round": r, "client": name, <metric>: value, ...}`` per client;
- ``{"kind": "server", "round": r, "bytes_up", "bytes_down", "num_failed", "num_rejected", ...}``, with
  ``pooled_balanced_accuracy``, ``pooled_accuracy``, ``pooled_n`` and ``pooled_sites`` when classification
  sites sent confusion counts (the metrics on the union of the answering sites' test splits).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

HEADLINE = ("auc", "accuracy", "balanced_accuracy", "dice", "iou", "loss")
POOLED = ("pooled_balanced_accuracy", "pooled_accuracy")  # server-side metrics of the round (no per-site value)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values: Iterable[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


class RunRecorder:
    """Writes one run's folder; on resume it continues the same folder after the checkpoint's round."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ------------------------------------------------------------------ writing
    def write_config(self, config: Mapping[str, Any]) -> None:
        (self.run_dir / "config.json").write_text(json.dumps(dict(config), indent=1, sort_keys=True))

    def _append(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def log_client(self, rnd: int, client: str, kind: str, metrics: Mapping[str, float], **extra: Any) -> None:
        self._append({"kind": kind, "round": rnd, "client": client, **extra, **dict(metrics)})

    def log_server(self, rnd: int, **fields: Any) -> None:
        self._append({"kind": "server", "round": rnd, "time": time.time(), **fields})

    def truncate_after(self, rnd: int) -> None:
        """Drop records of rounds after ``rnd`` (a resumed run redoes them)."""
        kept = [r for r in read_records(self.metrics_path) if int(r.get("round", 0)) <= rnd]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    # ------------------------------------------------------------------ reading
    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in read_records(self.metrics_path) if kind is None or r.get("kind") == kind]

    def round_summary(self, rnd: int) -> str:
        evals = [r for r in self.records("eval") if r["round"] == rnd]
        parts = [f"{m}={v:.3f}" for m in ("auc", "accuracy", "dice", "iou") if (v := _mean(r.get(m) for r in evals)) is not None]
        server = [r for r in self.records("server") if r["round"] == rnd]
        if server:
            s = server[-1]
            parts.append(f"up={s['bytes_up'] / 1e6:.2f}MB down={s['bytes_down'] / 1e6:.2f}MB")
            parts += [f"{m}={s[m]:.3f}" for m in POOLED if isinstance(s.get(m), (int, float))]
            if s.get("num_failed") or s.get("num_rejected"):
                parts.append(f"failed={s['num_failed']} rejected={s['num_rejected']}")
        return f"mean over {len(evals)} clients: " + " ".join(parts)

    def summary(self, strategy: str, dataset: str, wall_time_s: float, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """summary.json's content: the last evaluation of every client and their mean, plus the pooled metrics of
        the last round that has them."""
        last: dict[str, dict[str, Any]] = {}
        for r in self.records("eval"):
            last[r["client"]] = r
        per_client = {
            c: {k: v for k, v in r.items() if k not in ("kind", "client")} for c, r in sorted(last.items())
        }
        metric_names = sorted({k for r in per_client.values() for k, v in r.items()
                               if k not in ("round", "n") and isinstance(v, (int, float))})
        final = {m: _mean(r.get(m) for r in per_client.values()) for m in metric_names}
        server = self.records("server")
        pooled = next((r for r in reversed(server) if any(m in r for m in POOLED)), {})
        final.update({m: pooled[m] for m in POOLED if m in pooled})
        return {
            "strategy": strategy,
            "dataset": dataset,
            "rounds": max((r["round"] for r in server), default=0),
            "final": final,
            "per_client": per_client,
            "communication": {
                "bytes_up": sum(r.get("bytes_up", 0) for r in server),
                "bytes_down": sum(r.get("bytes_down", 0) for r in server),
                "failed_replies": sum(r.get("num_failed", 0) for r in server),
                "rejected_replies": sum(r.get("num_rejected", 0) for r in server),
            },
            "wall_time_s": round(wall_time_s, 2),
            **dict(extra or {}),
        }

    def finish(self, strategy: str, dataset: str, wall_time_s: float, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        summary = self.summary(strategy, dataset, wall_time_s, extra)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        (self.run_dir / "summary.md").write_text(summary_markdown(summary))
        evals = self.records("eval")
        plot = plot_task_curves if any("auc_curve" in r for r in evals) else plot_curves
        plot(evals, self.run_dir / "curves.png", title=f"{_title(summary)} on {dataset}")
        return summary


# ----------------------------------------------------------------------------- continual runs (FedKEI)
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
        means = {m: _mean(r.get(m) for r in clients.values()) for m in CONTINUAL_METRICS}
        tasks[str(task)] = {**means, "per_client": {c: {m: _clean(r.get(m)) for m in CONTINUAL_METRICS}
                                                    for c, r in sorted(clients.items())}}
        final.update({f"task{task}_{m}": v for m, v in means.items()})
    for m in CONTINUAL_METRICS:
        final[m] = _mean(t[m] for t in tasks.values())
    names = sorted({c for clients in by_task.values() for c in clients})
    per_client = {c: {m: _mean(by_task[t][c].get(m) for t in by_task if c in by_task[t]) for m in CONTINUAL_METRICS}
                  for c in names}
    return {"tasks": tasks, "final": final, "per_client": per_client}


def tasks_markdown(tasks: Mapping[str, Any], final: Mapping[str, Any]) -> list[str]:
    """Tasks as columns, then the overall mean: final AUC, LCA and AUC at initialisation (mean over clients)."""
    names = list(tasks)
    lines = ["| metric | " + " | ".join(f"task {t}" for t in names) + " | overall |",
             "|---|" + "---|" * (len(names) + 1)]
    labels = {"auc": "final AUC", "lca": "LCA", "auc_init": "AUC at init"}
    for m in CONTINUAL_METRICS:
        lines.append(f"| {labels[m]} | " + " | ".join(_fmt(tasks[t].get(m)) for t in names) + f" | {_fmt(final.get(m))} |")
    return lines


# ----------------------------------------------------------------------------- class-incremental runs (pFedMxF)
INCREMENTAL_METRICS = ("accuracy", "router_accuracy", "within_task_accuracy")


def _pooled(records: list[dict[str, Any]], metric: str) -> float | None:
    """Σ_k metric_k n_k / Σ_k n_k: the metric on the union of the sites' test splits."""
    pairs = [(r[metric], r.get("n", 0)) for r in records if isinstance(r.get(metric), (int, float))
             and math.isfinite(r[metric]) and r.get("n", 0) > 0]
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
            "mean_over_sites": _mean(r.get("accuracy") for r in clients.values()),
            "per_client": {c: _clean(r.get("accuracy")) for c, r in sorted(clients.items())},
        }
    final: dict[str, Any] = {}
    if tasks:
        last = tasks[list(tasks)[-1]]
        final = {
            "last": last["accuracy"], "avg": _mean(t["accuracy"] for t in tasks.values()),
            "last_site_mean": last["mean_over_sites"], "avg_site_mean": _mean(t["mean_over_sites"] for t in tasks.values()),
            "accuracy": last["accuracy"],
            **{m: last[m] for m in INCREMENTAL_METRICS[1:] if last[m] is not None},
        }
    return {"incremental": tasks, "final": final}


def incremental_markdown(tasks: Mapping[str, Any], final: Mapping[str, Any]) -> list[str]:
    names = list(tasks)
    lines = ["Accuracy over all classes seen so far, after each task (all sites' test rows pooled):", "",
             "| | " + " | ".join(f"task {t}" for t in names) + " | Last | Avg |",
             "|---|" + "---|" * (len(names) + 2)]
    lines.append("| accuracy | " + " | ".join(_fmt(tasks[t]["accuracy"]) for t in names)
                 + f" | {_fmt(final.get('last'))} | {_fmt(final.get('avg'))} |")
    lines.append("| mean over sites | " + " | ".join(_fmt(tasks[t]["mean_over_sites"]) for t in names)
                 + f" | {_fmt(final.get('last_site_mean'))} | {_fmt(final.get('avg_site_mean'))} |")
    for m in INCREMENTAL_METRICS[1:]:
        if any(tasks[t].get(m) is not None for t in names):
            lines.append(f"| {m.replace('_', ' ')} | " + " | ".join(_fmt(tasks[t].get(m)) for t in names) + " | | |")
    return lines + [""]


def _title(summary: Mapping[str, Any]) -> str:
    """The strategy, with its variant when it has one (``fedkei (variant C)``)."""
    variant = summary.get("variant")
    if variant:
        return f"{summary['strategy']} (variant {variant})"
    classifier = summary.get("classifier")
    return f"{summary['strategy']} ({classifier} classifier)" if classifier else str(summary["strategy"])


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def summary_markdown(summary: Mapping[str, Any]) -> str:
    continual = "tasks" in summary
    metrics = list(CONTINUAL_METRICS) if continual else [m for m in HEADLINE if m in summary["final"]]
    lines = [
        f"# {_title(summary)} on {summary['dataset']}",
        "",
        f"{summary['rounds']} {'tasks' if continual else 'rounds'}, {summary['wall_time_s']} s.",
        "",
    ]
    if continual:
        lines += tasks_markdown(summary["tasks"], summary["final"]) + ["", "Per client, mean over its tasks:", ""]
    if "incremental" in summary:
        lines += incremental_markdown(summary["incremental"], summary["final"])
    lines += [
        "| client | " + " | ".join(metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for client, values in summary["per_client"].items():
        lines.append(f"| {client} | " + " | ".join(_fmt(values.get(m)) for m in metrics) + " |")
    lines.append("| **mean** | " + " | ".join(_fmt(summary["final"].get(m)) for m in metrics) + " |")
    if any(m in summary["final"] for m in POOLED):
        lines.append("| **pooled** (all test rows) | " + " | ".join(_fmt(summary["final"].get(f"pooled_{m}")) for m in metrics) + " |")
    comm = summary["communication"]
    lines += [
        "",
        "| bytes up | bytes down | failed replies | rejected replies |",
        "|---|---|---|---|",
        f"| {comm['bytes_up']:,} | {comm['bytes_down']:,} | {comm['failed_replies']} | {comm['rejected_replies']} |",
        "",
    ]
    return "\n".join(lines)


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
            mean = _mean(c[i] for c in curves[task] if i < len(c))
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
            ax.plot(range(start, start + len(r["auc_curve"])), [math.nan if v is None else v for v in r["auc_curve"]],
                    lw=0.8, alpha=0.5, color=colour, label=r["client"] if task == min(starts) else None)
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


def plot_curves(evals: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per-round test metrics: one thin line per client and the mean in bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in HEADLINE if any(m in r for r in evals)]
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(4 * max(len(metrics), 1), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        by_client: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in evals:
            if isinstance(r.get(metric), (int, float)):
                by_client[r["client"]].append((r["round"], r[metric]))
        for client, points in sorted(by_client.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, lw=0.8, alpha=0.5, label=client)
        rounds = sorted({r["round"] for r in evals})
        means = [_mean(r.get(metric) for r in evals if r["round"] == rnd) for rnd in rounds]
        ax.plot(rounds, means, lw=2.2, color="black", label="mean")
        ax.set_title(metric)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    if metrics:
        axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
