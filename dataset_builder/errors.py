"""The one error type of the dataset builder."""

from __future__ import annotations


class BuildError(ValueError):
    """The dataset cannot be built or pushed; the message names the input and what is wrong."""
