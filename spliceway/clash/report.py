"""What an import carried over, changed in meaning, or left out: :class:`Report`.

Every item says where it was in the Clash document (``path``, as ``proxies[3]``,
``proxy-groups[1].interval``, ``dns.nameserver[2]``, ``rules[120]``), what it names
(the proxy, group, provider or key), what became of it and why. The importer adds to one
report as it goes; the CLI prints it for people (:meth:`Report.render`) or as JSON
(:meth:`Report.to_json`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Item", "Kind", "Report"]

Kind = Literal["converted", "changed", "skipped"]


@dataclass(frozen=True, slots=True)
class Item:
    """One report line: ``path`` in the Clash document, the ``name`` it carries (empty
    when none), ``what`` it became (or was), and ``why`` (empty when nothing needs
    saying)."""

    path: str
    name: str
    what: str
    why: str = ""

    def to_json(self) -> dict[str, str]:
        """The item as a JSON object (``why`` left out when empty)."""
        doc = {"path": self.path, "name": self.name, "what": self.what}
        if self.why:
            doc["why"] = self.why
        return doc


@dataclass(slots=True)
class Report:
    """Items by kind: ``converted`` (carried with the same meaning), ``changed`` (carried,
    but it behaves differently in spliceway), ``skipped`` (not carried); ``notes`` are
    things the user must do (export a variable, provide a file)."""

    converted: list[Item] = field(default_factory=list)
    changed: list[Item] = field(default_factory=list)
    skipped: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, kind: Kind, path: str, name: str, what: str, why: str = "") -> None:
        """Add an item of ``kind``."""
        self._list(kind).append(Item(path, name, what, why))

    def extend(self, kind: Kind, items: Iterable[Item]) -> None:
        """Add items of ``kind``."""
        self._list(kind).extend(items)

    def note(self, text: str) -> None:
        """Add something the user must do (printed first)."""
        if text not in self.notes:
            self.notes.append(text)

    def _list(self, kind: Kind) -> list[Item]:
        if kind == "converted":
            return self.converted
        if kind == "changed":
            return self.changed
        return self.skipped

    def counts(self) -> dict[str, int]:
        """How many items of each kind."""
        return {
            "converted": len(self.converted),
            "changed": len(self.changed),
            "skipped": len(self.skipped),
        }

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON object: ``counts``, ``notes`` and the three lists."""
        return {
            "counts": self.counts(),
            "notes": list(self.notes),
            "converted": [i.to_json() for i in self.converted],
            "changed": [i.to_json() for i in self.changed],
            "skipped": [i.to_json() for i in self.skipped],
        }

    def render(self) -> str:
        """The report for people: notes, then changed and skipped items (every one), then
        what was converted."""
        lines: list[str] = []
        counts = self.counts()
        lines.append(
            f"import: {counts['converted']} converted, {counts['changed']} changed in "
            f"meaning, {counts['skipped']} skipped"
        )
        for note in self.notes:
            lines.append(f"note: {note}")
        for title, items in (
            ("changed", self.changed),
            ("skipped", self.skipped),
            ("converted", self.converted),
        ):
            if not items:
                continue
            lines.append(f"{title}:")
            for item in items:
                label = f"{item.path} ({item.name})" if item.name else item.path
                text = f"  {label}: {item.what}"
                if item.why:
                    text += f" - {item.why}"
                lines.append(text)
        return "\n".join(lines) + "\n"
