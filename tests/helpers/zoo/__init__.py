"""The model zoo: tiny adversarial models, one ``ZooEntry`` each, with what the sweep must see.

``common`` defines ``ZooEntry`` and the shared inputs, losses and layers; each themed
module holds its models and their ``ENTRIES``. ``ZOO`` is every entry, in this order.
"""

from __future__ import annotations

from . import checkpointing, dataflow, layers, mutation, ops, tensors
from .common import ZooEntry

ZOO: tuple[ZooEntry, ...] = (
    dataflow.ENTRIES
    + mutation.ENTRIES
    + tensors.ENTRIES
    + layers.ENTRIES
    + ops.ENTRIES
    + checkpointing.ENTRIES
)
