"""What every benchmark prints and writes: a markdown table of its rows and a JSON file with the machine."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def print_table(header: list[str], rows: list[dict[str, Any]], number_format: str) -> None:
    """A markdown table of ``rows`` (dicts keyed by the header); floats with ``number_format``, missing cells '–'."""
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        cells = [
            format(row[h], number_format) if isinstance(row.get(h), float) else str(row.get(h, "–")) for h in header
        ]
        print("| " + " | ".join(cells) + " |")


def write_results(out: Path, key: str, rows: list[dict[str, Any]]) -> None:
    """``{"machine": ..., key: rows}`` as JSON at ``out`` (its folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    out.write_text(json.dumps({"machine": machine, key: rows}, indent=1))
    print(f"\nwritten to {out}")
