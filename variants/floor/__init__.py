"""Floors for trained comparisons: `none`, a mixer that mixes nothing.

A trained model with `none` is its block without the mixer (the short convolution and the
MLP), the level a mixer must beat to have learned anything from the context. Declared a
floor in its contract: `"all"` and `attnbench list` leave it out; named, it builds.

Imports: variants.core only.
"""

from .none import NoMixer  # noqa: F401
