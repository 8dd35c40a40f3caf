"""ClientApp: routes each message to the client half of the run's strategy."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .config import ExperimentConfig
from .strategies import STRATEGIES
from .strategies.client import ClientRuntime

app = ClientApp()


def handle(message: Message, context: Context) -> Message:
    """Build the site's runtime and call ``<category>`` or ``<action>`` on the method's client half."""
    cfg = ExperimentConfig.from_run_config(context.run_config, check_paths=False)
    runtime = ClientRuntime.from_message(message, context, cfg)
    half = cfg.strategy_class.client_half(runtime)
    category, _, action = message.metadata.message_type.partition(".")
    handler = getattr(half, action or category)
    return Message(handler(message), reply_to=message)


app.query()(handle)
app.train()(handle)
app.evaluate()(handle)
for _category, _action in sorted({a for s in STRATEGIES.values() for a in s.extra_actions}):
    getattr(app, _category)(_action)(handle)
