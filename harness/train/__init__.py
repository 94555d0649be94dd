"""Trained quality (`attnbench train`): can a small model built on each variant learn
to recall? A model (embedding, a short causal convolution, the variant as the sequence
mixer, a tied head) is trained per configuration on a synthetic task, into train.csv.

    tasks.py    the task registry and its generators (MQAR)
    state_tasks.py  parity, mod_sum, permutations: running-state generators
    corpus.py   byte-level text corpora (lm) and their document splits by sha256
    text_windows.py  a split's training windows and its evaluation tiling
    text_metrics.py  bits per byte, unigram and bigram floors, recall hits
    model.py    the small model around a variant
    input_layers.py  the layers that make a variant's declared inputs (gates, DSA's indexer)
    output_layer.py  the papers' norm and gate after a mixer, before the output projection
    trainer.py  one training run: AdamW, early stop, settling, validation and test
                accuracy; a run paused and continued (the race), or extended
    schedule.py the learning rate: warmup-stable-decay (or an earlier folder's cosine)
    outcome.py  the plateau, the margin and a run's outcome
    race.py     the race of learning rates: successive halving over continued runs
    matrix.py   a train TOML (preset or file) expanded into configurations, checked first
    worker.py   training runs in a process of its own (`python -m harness.train.worker`)
    rows.py     a train.csv row: the configuration's columns, the outcome of its runs
    runner.py   the serial run: per cell, the race on the first seed, the later seeds at
                its rate; rows, resume
    estimate.py the plan's time: the protocol's steps at step costs probed per model
    store.py    a run folder's train.csv and train_meta.json

May import harness.measure (its worker process and memory cap), harness.models and
harness.files; imported by harness.cli and harness.cluster (the sharded sweep).
"""
