"""The structure of a torch call, its arguments or its output, as tensor leaves and a spec to rebuild it.

Tuples, lists, named tuples, dicts (and their subclasses), dataclasses and transformers' ``ModelOutput`` are walked;
a ``torch.Tensor`` (torchax's too) is a leaf; anything else (``None``, numbers, strings, dtypes) is static and kept in
the spec. `static_key` is the spec as a hashable value: the part of a call that selects its compiled program.

Example:
    >>> import torch
    >>> leaves, spec = flatten(((torch.ones(2),), {"mask": torch.zeros(2), "causal": True}))
    >>> len(leaves), unflatten(spec, [t * 2 for t in leaves])[1]["causal"]
    (2, True)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from openhosti_jax.errors import BridgeError

_TENSOR = ("tensor",)


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def flatten(obj: Any) -> tuple[list[Any], Any]:
    """``obj``'s tensors in a fixed order, and the spec that `unflatten` rebuilds ``obj`` from."""
    leaves: list[Any] = []

    def walk(x: Any) -> Any:
        if _is_tensor(x):
            leaves.append(x)
            return _TENSOR
        if isinstance(x, Mapping):
            keys = tuple(x.keys())
            return ("map", x, keys, tuple(walk(x[k]) for k in keys))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            names = tuple(f.name for f in dataclasses.fields(x))
            return ("dataclass", x, names, tuple(walk(getattr(x, n)) for n in names))
        if isinstance(x, tuple | list):
            return ("seq", x, len(x), tuple(walk(v) for v in x))
        return ("static", x)

    return leaves, walk(obj)


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    """The structure ``spec`` describes with ``leaves`` in place of its tensors (in `flatten`'s order)."""
    it = iter(leaves)

    def build(s: Any) -> Any:
        kind = s[0]
        if kind == "tensor":
            return next(it)
        if kind == "static":
            return s[1]
        template, _, children = s[1], s[2], s[3]
        values = [build(c) for c in children]
        if kind == "map":
            return _mapping(template, dict(zip(s[2], values, strict=True)))
        if kind == "dataclass":
            new = copy.copy(template)
            for name, v in zip(s[2], values, strict=True):
                object.__setattr__(new, name, v)
            return new
        if isinstance(template, tuple) and hasattr(template, "_fields"):  # a named tuple
            return type(template)(*values)
        return type(template)(values)

    return build(spec)


def _mapping(template: Mapping[str, Any], items: dict[str, Any]) -> Mapping[str, Any]:
    kind = type(template)
    if kind is dict:
        return items
    if hasattr(template, "to_tuple"):  # transformers' ModelOutput: a dataclass over an OrderedDict
        return kind(**items)
    new = copy.copy(template)  # OrderedDict, defaultdict, other dict subclasses keep their type and attributes
    new.clear()  # type: ignore[attr-defined]
    new.update(items)  # type: ignore[attr-defined]
    return new


def static_key(spec: Any) -> Hashable:
    """``spec`` as a hashable value: container types, keys, and the static values (which must be hashable)."""
    kind = spec[0]
    if kind == "tensor":
        return _TENSOR
    if kind == "static":
        value = spec[1]
        try:
            hash(value)
        except TypeError:
            raise BridgeError(
                f"a non-tensor argument of forward() selects the compiled program, so it must be hashable; found "
                f"{type(value).__name__} {value!r}; pass it as a tensor, or as a hashable value (a tuple, not a set)"
            ) from None
        return ("static", type(value), value)
    return (kind, type(spec[1]), spec[2], tuple(static_key(c) for c in spec[3]))


__all__ = ["flatten", "unflatten", "static_key"]
