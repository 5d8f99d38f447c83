"""A tiny name -> builder registry with "did you mean" on unknown names.

Registry names are the CLI names: `method=jl` looks up METHODS["jl"]. One idiom registers everything, the
decorator on the definition (a family built in a loop applies the same call: `MODELS.register(name)(builder)`):

    MODELS = Registry("model")

    @MODELS.register("mlp")
    def build_mlp(...): ...

    MODELS.build("mlp", ...)      # -> the built object
    MODELS.build("mpl")           # DprunError: unknown model 'mpl' (did you mean 'mlp'?); valid: cnn, mlp, ...
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Iterable

from runner.errors import DprunError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: register the decorated object under `name`. Registering a name twice is a bug."""

        def add(o):
            if name in self._entries and self._entries[name] is not o:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = o
            return o

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._entries:
            raise DprunError(unknown_name_message(self.kind, name, self.names()))
        return self._entries[name]

    def build(self, name: str, *args, **kwargs):
        return self.get(name)(*args, **kwargs)

    def items(self) -> Iterable[tuple[str, Callable[..., Any]]]:
        return sorted(self._entries.items())


def unknown_name_message(kind: str, name: object, valid: list[str]) -> str:
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}; valid: {', '.join(valid)}"
