"""Which engine runs the site handling this message: Flower's simulation, medflower's in-process grid, or a
deployment (a SuperNode's ``flwr-clientapp`` process). Standard library only: the ClientApp's entry point imports
it before anything heavy."""

from __future__ import annotations

import sys

# (module, class, method) whose frame is on the stack while a simulated site handles a message: Flower's
# simulation engine (a Ray actor of the Virtual Client Engine) and medflower's in-process grid.
SIMULATION_CALLERS = (
    ("flwr.simulation.ray_transport.ray_actor", "VirtualClientEngineActor", "run"),
    ("medflower.inprocess", "InProcessGrid", "send_and_receive"),
)


def in_simulation() -> bool:
    """True while a simulated site handles a message (Flower's simulation engine or medflower's in-process grid):
    one of ``SIMULATION_CALLERS`` is on the calling stack. A module that is not imported is not running."""
    codes = set()
    for module_name, class_name, method in SIMULATION_CALLERS:
        module = sys.modules.get(module_name)
        function = getattr(getattr(module, class_name, None), method, None)
        if function is not None and hasattr(function, "__code__"):
            codes.add(function.__code__)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False
