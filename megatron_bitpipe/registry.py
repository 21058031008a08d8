"""Named entries in registration order: :class:`Registry`, the shape of every registry of this
package (the schedule generators, the data-parallel modes, the model kinds).

Pure Python, importing nothing of this package: any room may register into one.
"""

from __future__ import annotations

from typing import Callable, Dict, Protocol, Tuple, TypeVar

__all__ = ["Named", "Registry"]


class Named(Protocol):
    """What a registry holds: an entry that carries its name."""

    @property
    def name(self) -> str: ...


Entry = TypeVar("Entry", bound=Named)


class Registry(Dict[str, Entry]):
    """A mapping of each entry's name -> the entry, in registration order (the order listings
    show), with the two rules every registry keeps: a name is registered once (:meth:`add`), and
    the lookup of an unknown name (:meth:`lookup`) raises an error that lists the registered names.

    Args:
        what: the entries' kind with its article, as the duplicate-name error names it
            (``"a schedule"``: "a schedule named 'x' is already registered").
        unknown: the lookup error of an unknown name, given the name and the registered names
            joined by ``", "``.
    """

    def __init__(self, what: str, unknown: Callable[[str, str], Exception]):
        super().__init__()
        self.what = what
        self._unknown = unknown

    def add(self, entry: Entry) -> Entry:
        """Register ``entry`` under its name and return it; :class:`ValueError` if the name is taken."""
        if entry.name in self:
            raise ValueError(f"{self.what} named {entry.name!r} is already registered")
        self[entry.name] = entry
        return entry

    def lookup(self, name: str) -> Entry:
        """The entry registered under ``name``; the registry's ``unknown`` error otherwise."""
        try:
            return self[name]
        except KeyError:
            raise self._unknown(name, ", ".join(self)) from None

    def names(self) -> Tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self)
