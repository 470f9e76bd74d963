"""Reports as plain Python objects with the fields of the command line's ``--json``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["Record", "from_json"]


class Record:
    """A report: one attribute per field of its ``--json`` form (nested reports are Records).

    ``to_dict()`` gives the JSON-shaped dictionary back; two Records are equal when their
    fields are.
    """

    __slots__ = ("_fields",)

    def __init__(self, **fields: Any) -> None:
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(
                f"Record has no field {name!r} (fields: {', '.join(self._fields)})"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Record is read-only")

    def __dir__(self) -> list[str]:
        return sorted(self._fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"Record({inner})"

    def fields(self) -> list[str]:
        """The field names, in the order ``--json`` prints them."""
        return list(self._fields)

    def to_dict(self) -> dict[str, Any]:
        """The report as the dictionary ``json.loads`` gives for ``--json``."""
        return {k: _plain(v) for k, v in self._fields.items()}


def _plain(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def from_json(text: str) -> Any:
    """Parses a report's JSON into Records (objects) and lists."""
    return json.loads(text, object_hook=lambda d: Record(**d))
