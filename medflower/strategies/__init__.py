"""The strategies. Every module of this package is imported here, and a method module registers its strategy
classes with ``@register_strategy`` when imported, so adding a method is adding its module
(docs/adding-a-method.md); nothing else lists methods by name.

``STRATEGIES`` maps a run-config ``strategy`` name to its server half (which names its client half).
"""

import importlib
import pkgutil

from ..contract.client import ClientHalf
from ..contract.registry import STRATEGIES, register_strategy
from ..contract.server import FederatedStrategy

# every module, in the protocol packages too (continual/, incremental/, submodel/), in name order
for _module in sorted(m.name for m in pkgutil.walk_packages(__path__, f"{__name__}.") if "._" not in m.name):
    importlib.import_module(_module)

__all__ = ["STRATEGIES", "ClientHalf", "FederatedStrategy", "register_strategy"]
