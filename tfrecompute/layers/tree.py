"""Walking a tree of Keras layers: models, blocks and the layers they hold."""

from __future__ import annotations

from typing import Any

import keras

from tfrecompute._keras_internals import direct_sublayers

__all__ = ["children", "is_input", "leaves", "walk"]


def children(layer: Any) -> list[Any]:
    """The layers `layer` holds, one level down, in creation order.

    For a `RecomputeBlock` these are its wrapped layers in call order.
    """
    return direct_sublayers(layer)


def is_input(layer: Any) -> bool:
    """Whether `layer` is a `keras.layers.InputLayer` (it only declares an input)."""
    return isinstance(layer, keras.layers.InputLayer)


def walk(root: Any, root_path: str) -> list[tuple[Any, str]]:
    """Every layer under `root` once (depth first, creation order), with its path.

    The first entry is `(root, root_path)`; a child's path is its parent's
    path, "/", and its name.
    """
    entries: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def visit(layer: Any, path: str) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        entries.append((layer, path))
        for child in children(layer):
            visit(child, f"{path}/{child.name}")

    visit(root, root_path)
    return entries


def leaves(root: Any, root_path: str) -> list[tuple[Any, str]]:
    """The layers under `root` that compute themselves (no sublayers, no inputs)."""
    return [
        (layer, path)
        for layer, path in walk(root, root_path)[1:]
        if not is_input(layer) and not children(layer)
    ]
