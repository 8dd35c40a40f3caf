"""The client half of methods that exchange only some of the trainable arrays and keep every other on the site
(SGCA and LAT: the lowest adapters; FedSA: the LoRA A matrices).

What leaves a site: the shared arrays after local training (the method's ``shared_names``) and n_k; the rest stays
in the site's personal state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
from flwr.app import Message, RecordDict

from ..contract.checkpoint import PersonalState
from ..contract.client import ClientHalf
from ..records import from_record


class SharedSubsetClient(ClientHalf):
    """Keeps every trainable array in its personal state; trains and evaluates with the received shared arrays in
    place of its own, and sends back only those."""

    state_key: ClassVar[str] = "personal"  # its PersonalState key

    def shared_names(self) -> list[str]:
        """The names of the arrays this site exchanges, in the order the server sends them."""
        raise NotImplementedError

    def shared_description(self) -> str:
        """What the shared arrays are, for the error when a message carries others."""
        return "shared arrays"

    def personal(self) -> PersonalState:
        return PersonalState(self.rt, key=self.state_key)

    def received(self, message: Message) -> OrderedDict[str, np.ndarray]:
        """The message's arrays, refused unless they are exactly this site's shared arrays."""
        shared = from_record(message.content["arrays"])
        expected = self.shared_names()
        if list(shared) != expected:
            raise ValueError(
                f"received arrays {list(shared)[:3]}... do not match this site's {self.shared_description()} "
                f"{expected[:3]}..."
            )
        return shared

    def load(self, before: int, shared: Mapping[str, np.ndarray]) -> None:
        """The site's own arrays saved before round ``before`` (the seeded initial ones before its first training),
        with the received shared arrays in place of its own."""
        rt = self.rt
        own = self.personal().load(before=before)
        rt.model.set_trainable(own if own is not None else rt.initial_arrays)
        rt.model.set_trainable(shared, strict=False)

    def extra_loss(self, shared: Mapping[str, np.ndarray]):
        """A term added to the local loss (none by default)."""
        return None

    def train(self, message: Message) -> RecordDict:
        rt = self.rt
        shared = self.received(message)
        self.load(rt.round, shared)
        metrics = rt.train_local(self.extra_loss(shared))
        trained = rt.model.get_trainable()
        self.personal().save(rt.round, trained)
        metrics["num-examples"] = len(rt.data.train)
        return self.reply(arrays=OrderedDict((k, trained[k]) for k in shared), metrics=metrics)

    def evaluate(self, message: Message) -> RecordDict:
        """The received shared arrays (the round's aggregate) with the site's own rest: the model it trains from
        next."""
        self.load(self.rt.round + 1, self.received(message))
        return self.reply(metrics=self.rt.evaluate_splits())
