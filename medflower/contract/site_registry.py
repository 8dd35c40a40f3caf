"""The operator's registry of sites: which node (the id ``flwr supernode register`` printed for a site's public
key) may speak for which site name.

With node authentication, a node id stands for one registered key; the registry binds the site name a node claims
in its replies to that key, so a node cannot take another site's name and receive its personal aggregate, block or
pool slot. The file is TOML::

    [sites]
    hospital-a = 2849231234798543
    hospital-b = 91023849023

docs/deployment.md ("Registry of sites") shows how to fill it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..options import bad


@dataclass(frozen=True)
class SiteRegistry:
    node_of: dict[str, int]

    @classmethod
    def load(cls, path: str) -> SiteRegistry:
        """Read and check the file (run-config site-registry); a bad file is a ConfigError naming the key."""
        file = Path(path).expanduser()
        try:
            sites = tomllib.loads(file.read_text()).get("sites")
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise bad("site-registry", path, f"cannot be read as TOML: {err}") from None
        if not isinstance(sites, dict) or not sites:
            raise bad("site-registry", path, "needs a [sites] table mapping each site name to its node id")
        for name, node in sites.items():
            if not isinstance(node, int) or isinstance(node, bool) or node < 0:
                raise bad("site-registry", path, f"site {name!r}: the node id must be a non-negative integer")
        nodes = list(sites.values())
        if len(set(nodes)) != len(nodes):
            raise bad("site-registry", path, "one node id is given to two sites")
        return cls(dict(sites))

    def check(self, node_id: int, claimed: str) -> str | None:
        """Why node ``node_id`` may not speak for site ``claimed``, or None."""
        if claimed not in self.node_of:
            return f"site {claimed!r} is not in the site registry"
        if self.node_of[claimed] != node_id:
            return f"site {claimed!r} is registered to another node; node {node_id} may not use its name"
        return None
