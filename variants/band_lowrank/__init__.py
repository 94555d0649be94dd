"""Band plus low rank: exact scores near the diagonal, a cheap summary of the rest
(family `band_lowrank`): Scatterbrain (Chen, Dao et al. 2021) and Long-Short (Zhu et al.
2021).

`band_lowrank.py` holds both variants; the plain form is each one's `weights`. Imports:
`variants.core` and the public parts of the families it combines, `sliding_window` (the
band), `linear` (Performer features, lagged sums) and `low_rank` (segment means).
"""

from .band_lowrank import LongShort, LongShortParams, Scatterbrain, ScatterbrainParams

__all__ = ["LongShort", "LongShortParams", "Scatterbrain", "ScatterbrainParams"]
