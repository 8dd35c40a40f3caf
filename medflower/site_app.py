"""The site's app: routes each message to the client half of the run's strategy.

``medflower/client_app.py`` (Flower's entry point) calls this ClientApp in the process that handles the message (in
simulation) or in the site's long-lived worker process (``medflower/site_worker.py``, in a deployment).

What a failing site sends back is redacted: the error's kind and the phase, never its message (which may name
files, paths or label values), except for errors marked ``shareable`` (a missing device, named with the devices the
site has). The full error goes to the site's own log; node-config ``share-error-detail=true``
sends it to the server as well, for debugging.
"""

from __future__ import annotations

from logging import ERROR

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from .config import ExperimentConfig
from .contract.client import ClientRuntime
from .data.roots import site_reads
from .privacy import privatise_train_reply, withhold_training_metrics
from .privacy.policy import SitePolicy, check_before_training, record_after_training
from .privacy.secagg import secagg_mod
from .site_errors import SiteError
from .strategies import STRATEGIES

# SecAgg+ rounds (run-config secagg) go through Flower's secaggplus_mod; every other message passes the mod untouched.
app = ClientApp(mods=[secagg_mod])


def shares_error_detail(context: Context) -> bool:
    return str(context.node_config.get("share-error-detail", "false")).lower() in ("true", "1", "yes")


def handle(message: Message, context: Context) -> Message:
    """Build the site's runtime and call ``<category>`` or ``<action>`` on the method's client half."""
    try:
        cfg = ExperimentConfig.from_run_config(context.run_config, check_paths=False)
        runtime = ClientRuntime.from_message(message, context, cfg)
        half = cfg.strategy_class.client_half(runtime)
        category, _, action = message.metadata.message_type.partition(".")
        handler = getattr(half, action or category)
        if message.metadata.message_type == "train" and cfg.evaluate_in_train and runtime.round > 1:
            handler = half.train_after_evaluating  # the previous round's evaluation rides in this reply
        policy = SitePolicy.from_node_config(context.node_config)  # the site's own limits (node config)
        trains = category == "train"
        with site_reads(context.node_config, own_data=runtime.data_path is not None):  # open-time checks
            if trains and policy.active:
                check_before_training(runtime, cfg, policy)
            content = handler(message)
        if message.metadata.message_type == "train":  # run-config dp: clip (and noise) the update before it leaves
            content = privatise_train_reply(message.content, content, cfg)
            content = withhold_training_metrics(content, cfg)  # with dp/dp-sgd/secagg: no image-derived metric
            metrics = content.metric_records.get("metrics") if hasattr(content, "metric_records") else None
            record_after_training(runtime, cfg, policy, metrics)
        return Message(content, reply_to=message)
    except Exception as err:
        kind = type(err).__name__
        log(ERROR, "[medflower] %s failed on this site: %s: %s", message.metadata.message_type, kind, err, exc_info=err)
        if shares_error_detail(context) or getattr(err, "shareable", False):  # e.g. DeviceError: names devices only
            raise SiteError(f"{kind}: {err}") from err
        raise SiteError(
            f"{kind} in {message.metadata.message_type} (the message stays in the site's log; node-config "
            "share-error-detail=true sends it)"
        ) from None


app.query()(handle)
app.train()(handle)
app.evaluate()(handle)
for _category, _action in sorted({a for s in STRATEGIES.values() for a in s.extra_actions}):
    getattr(app, _category)(_action)(handle)
