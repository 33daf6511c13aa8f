"""Names a package imports on first use (PEP 562): a package's ``__getattr__`` and ``__dir__``
from a table of name -> module, so that importing the package stays cheap."""
from __future__ import annotations

import importlib
from typing import Callable


def lazy_attributes(package: str, table: dict[str, str], namespace: dict
                    ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``table`` is imported from its
    module when first asked for and kept in ``namespace`` (the package's globals)."""
    def __getattr__(name: str) -> object:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__


__all__ = ["lazy_attributes"]
