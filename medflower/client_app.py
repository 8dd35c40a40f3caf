"""ClientApp (Flower's entry point on a site): routes each message to the site's app, here or in its worker.

In a deployment Flower starts a fresh process for every message, so this module imports only Flower and the
standard library; the site's app (``medflower/site_app.py``: the run's strategy, torch, timm, peft) runs in the
site's long-lived worker process (``medflower/site_worker.py``), which keeps its imports, model and data between
messages; node-config ``site-worker=false`` runs it in this process instead (docs/deployment.md#site-worker). In
Flower's simulation engine and medflower's in-process grid the process already lives as long as the run, so the
site's app runs here.
"""

from __future__ import annotations

import time

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from . import profiling
from .app_pin import check_pin
from .engine import in_simulation
from .site_worker import forward, message_record, uses_worker

# The strategies' message actions beyond query/train/evaluate (their ``extra_actions``; tests/test_site_worker.py
# checks this list against them, so that registering them does not import every strategy).
EXTRA_ACTIONS = (
    ("train", "fedkei_inner"),
    ("train", "inflora_stats"),
    ("train", "fedcurv_fisher"),
    ("train", "fedga_gap"),
    ("train", "elcfs_amplitudes"),
)

app = ClientApp()


def route(message: Message, context: Context) -> Message:
    """The site app's reply to ``message``: from the site's worker in a deployment, else computed here."""
    check_pin(context.node_config)  # node-config app-hash/app-version: only the app the site reviewed (app_pin.py)
    if not in_simulation() and uses_worker(context):
        return forward(message, context)
    return handle_here(message, context)


def handle_here(message: Message, context: Context) -> Message:
    started = time.time()
    with profiling.timed_message() as timings:
        with profiling.phase("imports"):
            from .site_app import app as site_app
        try:
            return site_app(message, context)
        finally:
            if profiling.enabled():
                mode = "simulation" if in_simulation() else "process"
                profiling.write(message_record(message, context, mode, started, time.time(), timings))


app.query()(route)
app.train()(route)
app.evaluate()(route)
for _category, _action in EXTRA_ACTIONS:
    getattr(app, _category)(_action)(route)
