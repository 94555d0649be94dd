"""attnbench harness: measuring a matrix of attention variants and reporting it.

One subpackage per subsystem; imports run one way (docs/architecture.md draws it):

    cli -> cluster -> measure -> models -> files        report -> files
    cli -> drift -> (measure, models)                   (all of them -> variants)
    cli -> train -> (measure, models); cluster -> train

files/ is the bottom: a run folder's names and columns and how rows are written. presets/
holds the matrix TOMLs (data, not code).
"""
