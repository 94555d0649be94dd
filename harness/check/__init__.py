"""The conformance kit: the properties every variant keeps, for the package's own variants
(tests/test_conformance.py runs it over the registry) and for anyone's (`attnbench check`).

    kit.py         a property's Result, the inputs it draws, whether a case runs, the loop
    properties.py  spec, shapes, gradients, batch_heads, causal, determinism, flops, exactness
    decoding.py    weights, decoding, state_size

Imports `variants` and torch only; imported by cli (the `check` command) and the tests.
"""
