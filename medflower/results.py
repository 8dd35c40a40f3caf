"""Run outputs: metrics.jsonl, summary.json, summary.md, curves.png and sites.png (docs/experiments.md, "Outputs").

``metrics.jsonl`` has one JSON object per line:
- ``{"kind": "train"|"eval", "round": r, "client": name, <metric>: value, ...}`` per client;
- ``{"kind": "server", "round": r, "bytes_up", "bytes_down", "num_failed", "num_rejected", ...}``, with
  ``pooled_balanced_accuracy``, ``pooled_accuracy``, ``pooled_n`` and ``pooled_sites`` when classification
  sites sent confusion counts (the metrics on the union of the answering sites' test splits).

``RunReport`` lays out summary.md and curves.png for runs of rounds; a strategy whose runs read differently names
its own (``FederatedStrategy.report``: the continual protocol's in ``strategies/continual/report.py``, the
class-incremental protocol's in ``strategies/incremental/report.py``), and its ``summary_extra`` adds to
summary.json.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from . import run_folder

HEADLINE = ("auc", "accuracy", "balanced_accuracy", "dice", "iou", "loss")
POOLED = ("pooled_balanced_accuracy", "pooled_accuracy")  # server-side metrics of the round (no per-site value)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(text: str) -> str:
    """``text`` as a file or folder name: runs of other characters become one '-'."""
    return _UNSAFE.sub("-", text).strip("-")


def json_value(value: Any) -> Any:
    """``value``, with a non-finite float as None (JSON's null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# The fields a metrics.jsonl record sets itself; a site's metric of the same name is refused (server.py).
RESERVED_FIELDS = frozenset({"kind", "round", "client", "time"})


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file. A torn last line (the process died while appending it) is left out,
    so a crashed run can still be summarised and resumed; a broken line before the last is an error."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not a JSON record") from None
    return records


def finite_mean(values: Iterable[Any]) -> float | None:
    """The mean of the finite numbers among ``values``; None when there are none."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


# Fewer optimizer steps per epoch than this and a site's training hardly moves the model (a site of 15-20 images at
# batch-size 32 takes one step per epoch): said once per site, on the site and on the server.
FEW_STEPS = 5


def loader_steps(n: int, batch_size: int) -> int:
    """Batches per epoch of a shuffled training loader over ``n`` samples (``data.make_loader`` drops a last batch
    of one sample)."""
    if n <= 0:
        return 0
    return n // batch_size if n % batch_size == 1 and n > 1 else -(-n // batch_size)


def few_steps_message(n: int, steps: float, batch_size: int | None = None) -> str | None:
    """What to say of a site taking ``steps`` optimizer steps per epoch over ``n`` training samples (at
    ``batch_size`` when known): the largest batch size that gives at least ``FEW_STEPS``; None when it takes
    enough."""
    if steps >= FEW_STEPS or n <= 0:
        return None
    at = f" at batch-size {batch_size}" if batch_size else ""
    text = f"{n} training samples give {steps:g} optimizer step(s) per epoch{at}; "
    if n < FEW_STEPS:
        return text + f"even batch-size 1 gives only {n} (more local-epochs train it longer)"
    return text + f"batch-size {(best := largest_batch(n))} or less gives {loader_steps(n, best)} or more"


def largest_batch(n: int, steps: int = FEW_STEPS) -> int:
    """The largest batch size whose loader takes at least ``steps`` (>= 2) steps per epoch over ``n`` >= ``steps``
    samples. No larger one can: a batch b >= n / (steps - 1) gives at most steps - 1. Below that bound the count
    only falls short where the loader drops a last batch of one sample, so the search steps down at most a few
    times. ``n`` comes from a site's reply and may be any size (a hostile site declared 10^9): a search over every
    batch size from 1 to n would hold the server for minutes or years."""
    best = (n - 1) // (steps - 1)
    while loader_steps(n, best) < steps:
        best -= 1
    return best


class RunRecorder:
    """Writes one run's folder; on resume it continues the same folder after the checkpoint's round."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / run_folder.METRICS
        # the run's experiment tracker (medflower/tracking.py's RunTracking), told every record; None: no tracking
        self.tracking: Any = None
        # (batch size, local epochs) of the run: with them a site's training records say when it is a small site
        self.training_plan: tuple[int, int] | None = None
        self._small_sites: set[str] = set()

    # ------------------------------------------------------------------ writing
    def write_config(self, config: Mapping[str, Any]) -> None:
        (self.run_dir / run_folder.CONFIG).write_text(json.dumps(dict(config), indent=1, sort_keys=True))
        if self.tracking is not None:
            self.tracking.config(config)

    def _append(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({k: json_value(v) for k, v in record.items()}) + "\n")

    def log_client(self, rnd: int, client: str, kind: str, metrics: Mapping[str, float], **extra: Any) -> None:
        self._append({"kind": kind, "round": rnd, "client": client, **extra, **dict(metrics)})
        if kind == "train":
            self._check_small_site(client, metrics)
        if self.tracking is not None:
            self.tracking.client(rnd, client, kind, metrics)

    def log_server(self, rnd: int, **fields: Any) -> None:
        self._append({"kind": "server", "round": rnd, "time": time.time(), **fields})
        if self.tracking is not None:
            self.tracking.server(rnd, fields)

    def _check_small_site(self, client: str, metrics: Mapping[str, Any]) -> None:
        """Say once per site when its training reply shows fewer than ``FEW_STEPS`` optimizer steps per epoch."""
        n, steps = metrics.get("num-examples"), metrics.get("train_steps")
        if self.training_plan is None or client in self._small_sites:
            return
        if not (_finite(n) and _finite(steps)):
            return
        batch_size, epochs = self.training_plan
        if message := few_steps_message(int(n), float(steps) / max(epochs, 1), batch_size):
            self._small_sites.add(client)
            log(WARNING, "[medflower] small site %s: %s", client, message)

    def truncate_after(self, rnd: int, evaluated_through: int | None = None) -> None:
        """Drop records of rounds after ``rnd`` (a resumed run redoes them), and the evaluation records of rounds
        after ``evaluated_through`` (run-config evaluate-in-train: round ``rnd``'s evaluation comes with the training
        replies of round ``rnd + 1``, which the resumed run redoes)."""
        last_eval = rnd if evaluated_through is None else evaluated_through

        def kept_record(r: dict[str, Any]) -> bool:
            late = r.get("kind") == "eval" or "evaluated_in" in r
            return int(r.get("round", 0)) <= (last_eval if late else rnd)

        kept = [r for r in read_records(self.metrics_path) if kept_record(r)]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    # ------------------------------------------------------------------ reading
    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in read_records(self.metrics_path) if kind is None or r.get("kind") == kind]

    def round_summary(self, rnd: int) -> str:
        evals = [r for r in self.records("eval") if r["round"] == rnd]
        parts = [
            f"{m}={v:.3f}"
            for m in ("auc", "accuracy", "dice", "iou")
            if (v := finite_mean(r.get(m) for r in evals)) is not None
        ]
        server = [r for r in self.records("server") if r["round"] == rnd]
        if server:
            s = {k: v for r in server for k, v in r.items()}  # with evaluate-in-train, the pooled metrics come later
            parts.append(f"up={s['bytes_up'] / 1e6:.2f}MB down={s['bytes_down'] / 1e6:.2f}MB")
            parts += [f"{m}={s[m]:.3f}" for m in POOLED if isinstance(s.get(m), (int, float))]
            if isinstance(s.get("dp_epsilon"), (int, float)):
                parts.append(f"epsilon={s['dp_epsilon']:.3f} (delta={s['dp_delta']:g})")
            if isinstance(s.get("dp_sgd_epsilon"), (int, float)):
                parts.append(f"dp-sgd epsilon<={s['dp_sgd_epsilon']:.3f} (delta={s['dp_delta']:g})")
            if s.get("num_failed") or s.get("num_rejected"):
                parts.append(f"failed={s['num_failed']} rejected={s['num_rejected']}")
        head = f"mean over {len(evals)} clients:" if evals else "no site evaluated this round (yet):"
        return " ".join([head, *parts])

    def summary(
        self, strategy: str, dataset: str, wall_time_s: float, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """summary.json's content: the last evaluation of every client and their mean, plus the pooled metrics of
        the last round that has them."""
        last: dict[str, dict[str, Any]] = {}
        for r in self.records("eval"):
            last[r["client"]] = r
        per_client = {c: {k: v for k, v in r.items() if k not in ("kind", "client")} for c, r in sorted(last.items())}
        metric_names = sorted(
            {
                k
                for r in per_client.values()
                for k, v in r.items()
                if k not in ("round", "n") and isinstance(v, (int, float))
            }
        )
        final = {m: finite_mean(r.get(m) for r in per_client.values()) for m in metric_names}
        # a metric undefined on a site's data (AUC of a split with one class) is left out of its reply
        computed_on = {m: sum(_finite(r.get(m)) for r in per_client.values()) for m in metric_names}
        server = self.records("server")
        pooled = next((r for r in reversed(server) if any(m in r for m in POOLED)), {})
        final.update({m: pooled[m] for m in POOLED if m in pooled})
        steps = {}  # each site's optimizer steps in its last training round
        for r in self.records("train"):
            if _finite(r.get("train_steps")):
                steps[r["client"]] = r["train_steps"]
        return {
            "strategy": strategy,
            "dataset": dataset,
            "rounds": max((r["round"] for r in server), default=0),
            "final": final,
            "computed_on": computed_on,  # sites per metric (of len(per_client))
            **({"steps_per_round": dict(sorted(steps.items()))} if steps else {}),
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

    def finish(
        self,
        strategy: str,
        dataset: str,
        wall_time_s: float,
        extra: Mapping[str, Any] | None = None,
        report: RunReport | None = None,
        figures: bool = True,
    ) -> dict[str, Any]:
        """Write summary.json, summary.md and (``figures``: run config run-figures) curves.png and sites.png as
        ``report`` lays them out (the default: rounds)."""
        report = report or RunReport()
        summary = self.summary(strategy, dataset, wall_time_s, extra)
        (self.run_dir / run_folder.SUMMARY_JSON).write_text(json.dumps(summary, indent=1))
        title = f"{report.title(summary)} on {dataset}"
        for name in (run_folder.CURVES, SITE_BARS):  # a resumed run's pictures are drawn anew or not at all
            (self.run_dir / name).unlink(missing_ok=True)
        if figures:
            report.plot(self.records("eval"), self.run_dir / run_folder.CURVES, title=title)
            try:
                report.plot_sites(summary, self.run_dir / SITE_BARS, title=title)
            except Exception as err:  # a picture is never worth the run's summary
                log(WARNING, "[medflower] no %s (%s: %s)", SITE_BARS, type(err).__name__, err)
        (self.run_dir / run_folder.SUMMARY_MD).write_text(report.markdown(summary, run_figures(self.run_dir)))
        if self.tracking is not None:
            names = (
                run_folder.SUMMARY_MD,
                run_folder.SUMMARY_JSON,
                run_folder.CURVES,
                run_folder.CONFIG,
                run_folder.METRICS,
            )
            self.tracking.files([self.run_dir / name for name in names])
        return summary


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cell(value: Any) -> str:
    """A markdown table cell: 4 decimals, '–' for a missing value."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def privacy_lines(privacy: Mapping[str, Any]) -> list[str]:
    """summary.md's lines for a run with dp or dp-sgd (docs/privacy.md#accounting)."""
    lines = []
    target = f", target {privacy['target_epsilon']:g}" if privacy.get("target_epsilon") else ""
    if level := privacy.get("client_level"):
        lines.append(
            f"Client-level differential privacy (dp='{level['dp']}', noise multiplier {level['noise_multiplier']:g}, "
            f"clipping norm {level['clipping_norm']:g}): **ε = {level['epsilon']:.3f}** at δ = {privacy['delta']:g} "
            f"after {level['rounds']} rounds{target} ({level['accountant']})."
        )
    if sgd := privacy.get("dp_sgd"):
        per_site = ", ".join(f"{site} {eps:.3f}" for site, eps in sgd["epsilon_per_site"].items())
        lines.append(
            f"DP-SGD (noise multiplier {sgd['noise_multiplier']:g}, per-sample gradient norm "
            f"{sgd['max_grad_norm']:g}): **ε ≤ {sgd['epsilon']:.3f}** at δ = {privacy['delta']:g}{target}, per site: "
            f"{per_site or 'none reported'} ({sgd['accountant']})."
        )
        for d in sgd.get("epsilon_decreases") or []:  # a site's ε never decreases in the ledger: flagged
            lines.append(
                f"**Flag**: site {d['client']} reported DP-SGD ε = {d['reported']:.3f} in round {d['round']}, below "
                f"its earlier {d['kept']:.3f}; the ledger kept {d['kept']:.3f} (docs/privacy.md#accounting)."
            )
    return lines


class RunReport:
    """How summary.md and curves.png present a run: every client's last evaluation, per-round curves.

    The default for every strategy; one whose runs are task streams subclasses it and names the subclass as its
    ``report`` (FedKEI's ``ContinualReport``, the class-incremental ``IncrementalReport``).
    """

    unit = "rounds"  # what summary.json's "rounds" counts, in summary.md's first line

    def title(self, summary: Mapping[str, Any]) -> str:
        """summary.md's heading and curves.png's title, before " on <dataset>"."""
        return str(summary["strategy"])

    def sections(self, summary: Mapping[str, Any]) -> list[str]:
        """summary.md's method lines between the run line and the per-client table (none here)."""
        return []

    def columns(self, summary: Mapping[str, Any]) -> list[str]:
        """The per-client table's metrics: the headline metrics of the final evaluation."""
        return [m for m in HEADLINE if m in summary["final"]]

    def plot(self, evals: list[dict[str, Any]], path: Path, title: str) -> None:
        """Write curves.png from the run's eval records."""
        plot_curves(evals, path, title)

    def plot_sites(self, summary: Mapping[str, Any], path: Path, title: str) -> bool:
        """Write sites.png: each site's final value of the per-client table's metrics (but the loss) as bars, beside
        curves.png; False (nothing written) when no site has one."""
        from .figures import plot_site_bars

        metrics = [m for m in self.columns(summary) if m != "loss"]
        return plot_site_bars(summary["per_client"], metrics, path, title)

    def markdown(self, summary: Mapping[str, Any], figures: Mapping[str, Any] | None = None) -> str:
        """summary.md: title, the method's sections, the per-client table (mean, pooled), the bytes and, with
        ``figures`` (``run_figures``), the run folder's pictures."""
        metrics = self.columns(summary)
        lines = [
            f"# {self.title(summary)} on {summary['dataset']}",
            "",
            f"{summary['rounds']} {self.unit}, {summary['wall_time_s']} s.",
            "",
            *(line for text in privacy_lines(summary.get("privacy") or {}) for line in (text, "")),
            *self.sections(summary),
            "| client | " + " | ".join(metrics) + " |",
            "|---|" + "---|" * len(metrics),
        ]
        steps = summary.get("steps_per_round") or {}
        if steps:  # optimizer steps per round: a site of a few images at a large batch size takes one or two
            lines[-2:] = [lines[-2] + " steps/round |", lines[-1] + "---|"]
        for client, values in summary["per_client"].items():
            lines.append(
                f"| {client} | "
                + " | ".join(cell(values.get(m)) for m in metrics)
                + (f" | {_steps_cell(steps.get(client))}" if steps else "")
                + " |"
            )
        lines.append(
            "| **mean** | "
            + " | ".join(cell(summary["final"].get(m)) for m in metrics)
            + (f" | {_steps_cell(finite_mean(steps.values()))}" if steps else "")
            + " |"
        )
        if any(m in summary["final"] for m in POOLED):
            lines.append(
                "| **pooled** (all test rows) | "
                + " | ".join(cell(summary["final"].get(f"pooled_{m}")) for m in metrics)
                + (" | –" if steps else "")
                + " |"
            )
        lines += computed_on_lines(summary)
        comm = summary["communication"]
        lines += [
            "",
            "| bytes up | bytes down | failed replies | rejected replies |",
            "|---|---|---|---|",
            f"| {comm['bytes_up']:,} | {comm['bytes_down']:,} | {comm['failed_replies']} "
            f"| {comm['rejected_replies']} |",
            "",
        ]
        lines += cross_site_lines(summary.get("cross_site"))
        lines += figure_lines(figures or {})
        return "\n".join(lines)


SITE_BARS, SITE_FIGURES = run_folder.SITE_BARS, run_folder.SITE_FIGURES


def run_figures(run_dir: Path) -> dict[str, Any]:
    """The pictures in a run folder, as paths relative to it: ``curves`` and ``sites`` (the bars) when written, and
    ``site_figures`` {site: [its pictures by round]} (simulation: the sites drew them in ``sites/<site>/``)."""
    from .figures import SAMPLE_PREFIX

    run_dir = Path(run_dir)
    found: dict[str, Any] = {
        name: file for name, file in (("curves", run_folder.CURVES), ("sites", SITE_BARS)) if (run_dir / file).is_file()
    }
    site_figures = {}
    folder = run_dir / SITE_FIGURES
    for site in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []:
        pictures = sorted(site.glob(f"{SAMPLE_PREFIX}*.png"))
        if pictures:
            site_figures[site.name] = [p.relative_to(run_dir).as_posix() for p in pictures]
    if site_figures:
        found["site_figures"] = site_figures
    return found


def figure_lines(figures: Mapping[str, Any]) -> list[str]:
    """summary.md's pictures: the curves and the per-site bars side by side, then a link to each site's pictures
    of its predictions, by round."""
    from .figures import SAMPLE_PREFIX

    images = [
        f"![{alt}]({figures[key]})"
        for key, alt in (("curves", "test metrics per round"), ("sites", "final test metrics per site"))
        if figures.get(key)
    ]
    lines = [" ".join(images), ""] if images else []
    site_figures = figures.get("site_figures") or {}
    if site_figures:
        lines += [
            "Each site's model on its first test images (segmentation: ground truth solid, prediction dashed), drawn "
            "by the site:",
            "",
            "| site | pictures |",
            "|---|---|",
        ]
        for site, paths in site_figures.items():
            links = []
            for path in paths:
                number = Path(path).stem.removeprefix(SAMPLE_PREFIX)
                label = f"round {int(number)}" if number.isdigit() else Path(path).name
                links.append(f"[{label}]({path})")
            lines.append(f"| {site} | {', '.join(links)} |")
        lines.append("")
    return lines


def cross_site_lines(cross_site: Mapping[str, Any] | None) -> list[str]:
    """summary.md's cross-site evaluation (run-config cross-site-evaluation): one row per site and model it evaluated,
    with the headline metrics; what is not in the matrix, and why."""
    if not cross_site:
        return []
    matrix = cross_site.get("matrix") or {}
    metrics = [m for m in HEADLINE if any(m in row for models in matrix.values() for row in models.values())]
    rnd = cross_site.get("round", 0)
    if cross_site.get("models") == ["global"]:
        what = (
            f"The final global model (after round {rnd}) on each site's test split: one model that every site "
            "received, so the matrix has one column."
        )
    else:
        what = f"Each site's own final model (after round {rnd}) on its own test split, the matrix's diagonal."
    lines = ["## Cross-site evaluation", "", what, ""]
    if cross_site.get("off_diagonal"):
        lines += [f"Off the diagonal: {cross_site['off_diagonal']}.", ""]
    if cross_site.get("note"):
        lines += [f"{cross_site['note']}.", ""]
    if matrix:
        lines += ["| site (data) | model | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
        for site, models in matrix.items():
            for model, values in models.items():
                label = "own" if model == site else model
                lines.append(f"| {site} | {label} | " + " | ".join(cell(values.get(m)) for m in metrics) + " |")
        lines.append("")
    if cross_site.get("no_reply"):
        lines += [f"No valid reply from: {', '.join(cross_site['no_reply'])}.", ""]
    return lines


def _steps_cell(value: Any) -> str:
    return "–" if value is None else f"{round(value, 1):g}"


def computed_on_lines(summary: Mapping[str, Any]) -> list[str]:
    """summary.md's line naming the metrics some sites could not compute (undefined on their data, e.g. AUC on a
    split holding one class): each mean is over the sites that did."""
    sites = len(summary["per_client"])
    partial = {m: k for m, k in (summary.get("computed_on") or {}).items() if k < sites}
    if not partial:
        return []
    named = ", ".join(f"{m} on {k} of {sites} sites" for m, k in sorted(partial.items()))
    return ["", f"Computed where defined on a site's data, means over those sites: {named}."]


def summary_markdown(summary: Mapping[str, Any], report: RunReport | None = None) -> str:
    """summary.md's text for ``summary`` (laid out by ``report``; the default: a run of rounds)."""
    return (report or RunReport()).markdown(summary)


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
        means = [finite_mean(r.get(metric) for r in evals if r["round"] == rnd) for rnd in rounds]
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
