"""Drift inside a real model (`attnbench model`): each variant swapped into a
pretrained model through transformers' AttentionInterface and compared with the model
under exact attention on the same token windows.

    engine.py  the cases, the comparison and its numbers (emb_cos, hidden_rel_err, kl, ...)
    memory.py  the peak-memory child process (`python -m harness.drift.memory`)
    store.py   model.csv and model_meta.json: append, resume

May import harness.models (sources, the adapter), harness.measure (timing, memory) and
harness.files; imported by harness.cli.
"""
