"""Pretrained models as sources of real attention: loading a model and its text
(source.py), capturing each layer's q, k, v as a benchmark input (capture.py, the `minilm`
input), and the adapter that puts a variant inside a model through transformers'
AttentionInterface (attention.py).

Imports only harness.files and harness.errors (and variants); imported by harness.measure,
harness.drift and harness.cli.
"""
