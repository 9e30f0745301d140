"""`ClusterError` and the small field checks that raise it, shared by values and file format."""
from __future__ import annotations

import difflib
import numbers
from typing import Any, Mapping, Sequence


class ClusterError(ValueError):
    """An invalid cluster description.

    ``str(err)`` is ``"<source>: <field>: <message>"`` (parts omitted when
    unknown); the parts are also available as attributes.
    """

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.message = message
        self.field = field
        self.source = source
        super().__init__(": ".join([p for p in (source, field) if p] + [message]))

    def with_source(self, source: str | None) -> "ClusterError":
        """The same error, naming ``source`` (if given) as where it comes from."""
        return ClusterError(self.message, field=self.field, source=source or self.source)


def fail(field: str | None, message: str) -> ClusterError:
    """A :class:`ClusterError` at ``field`` (to ``raise``)."""
    return ClusterError(message, field=field)


def pos_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise fail(field, f"must be a positive integer, got {value!r}")
    return int(value)


def host_id(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise fail(field, f"must be a non-negative integer host id, got {value!r}")
    return int(value)


def nonempty_str(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(field, f"must be a non-empty string, got {value!r}")
    return value


def check_keys(table: Mapping[str, Any], allowed: Sequence[str], prefix: str | None) -> None:
    """Reject keys of ``table`` not in ``allowed``, suggesting the closest one."""
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            path = f"{prefix}.{key}" if prefix else str(key)
            raise fail(path, f"unknown key {key!r} ({hint}allowed: {', '.join(allowed)})")
