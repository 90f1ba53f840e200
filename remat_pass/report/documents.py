"""The JSON documents of ``remat-pass sweep --json`` and ``plan --json``: versioned
(``schema_version``, ``kind``) and validated against their JSON Schemas
(``sweep_schema.json``, ``plan_schema.json``, JSON Schema 2020-12, beside the report's
``report_schema.json``) before they are written, so a field that changes meaning is a
new version and a reader can refuse what it does not know.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from .schedule_report import validation_message, write_json

DOCUMENT_VERSION = 1
SCHEMAS = {
    "remat-pass-sweep": "sweep_schema.json",
    "remat-pass-sweep-ranks": "sweep_schema.json",
    "remat-pass-plan": "plan_schema.json",
}
"""Each document kind and the schema file (in this folder) that describes it."""


@lru_cache(maxsize=None)
def document_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema of a document kind.

    Raises:
        KeyError: ``kind`` is not one of ``SCHEMAS``.
    """
    return json.loads(Path(__file__).with_name(SCHEMAS[kind]).read_text(encoding="utf-8"))


def document(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with ``schema_version`` and ``kind`` first, checked against its schema.

    Raises:
        KeyError: an unknown kind.
        ValueError: the document does not match its schema (a bug: the message names the
            field).
    """
    doc = {"schema_version": DOCUMENT_VERSION, "kind": kind, **payload}
    problem = validation_message(document_schema(kind), doc)
    if problem is not None:
        raise ValueError(f"internal error: the {kind} document does not match {SCHEMAS[kind]}: {problem}")
    return doc


def write_document(path: str | Path, kind: str, payload: dict[str, Any]) -> None:
    """Write ``document(kind, payload)`` as indented JSON to ``path``."""
    write_json(path, document(kind, payload))
