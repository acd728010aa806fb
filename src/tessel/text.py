"""A user's text on its way to a tokenizer: the one check every path runs before tokenizing.

A JSON body can carry a lone surrogate ("\\ud800"), and a command line can hold bytes that are not
UTF-8 (Python decodes them to lone surrogates U+DC80..U+DCFF); a tokenizer given either fails deep
inside with a TypeError. `check_text` refuses them as a user error naming the field and the
character. Every place a tokenizer sees a user's text calls it first: the server's request models
(prompt, stop, chat content, embeddings input), `LLMEngine.tokenize`, `Embedder.tokenize`, the
chat template, `tessel launch`'s request checks and the replica router's token count. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessel.errors import TesselError


class InvalidText(TesselError, ValueError):
    """Not a string, or a string UTF-8 cannot encode (pydantic turns the ValueError into a 400)."""


def check_text(value: Any, name: str) -> str:
    """A string that UTF-8 can encode (no lone surrogates such as "\\ud800"), or InvalidText."""
    if not isinstance(value, str):
        raise InvalidText(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        char = value[error.start]
        raise InvalidText(
            f"{name} is not valid Unicode: a lone surrogate U+{ord(char):04X} at character {error.start}"
        ) from None
    return value


def check_texts(values: Sequence[Any], name: str) -> list[str]:
    """`check_text` of each; an item of several is named by its index (`input[2]`)."""
    if len(values) == 1:
        return [check_text(values[0], name)]
    return [check_text(value, f"{name}[{index}]") for index, value in enumerate(values)]
