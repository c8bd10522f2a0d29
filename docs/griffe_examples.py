"""Reads a docstring's `Example:` heading as the Google-style `Examples:` section.

A griffe extension, loaded by mkdocstrings for the API reference (mkdocs.yml):
without it `Example:` is an admonition in which `>>>` lines read as Markdown.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
