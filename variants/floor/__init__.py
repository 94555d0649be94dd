"""Floors for trained comparisons: `none`, a mixer that mixes nothing."""

from .none import NoMixer  # noqa: F401
