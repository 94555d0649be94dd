"""attnbench harness: matrix, inputs, timing, memory, accuracy, runner, store, report."""
