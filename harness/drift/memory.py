"""Peak memory of a whole model forward per variant, in a child process with the worker's malloc.

CPU peaks are read as in harness.measure.memory (clear_refs, VmRSS before, VmHWM after), which is
right only when freed memory goes back to the kernel: MALLOC_MMAP_THRESHOLD_=65536 and
MALLOC_TRIM_THRESHOLD_=0 must be in the process's environment from its start, and those
settings slow the process down, so the `model` command does not time anything there.
`Probe` starts `python -m harness.drift.memory` with that environment as the command
starts (its imports overlap the parent's checks and tokenising); then it loads the same
model, takes the parent's first window of each N, runs one untimed forward of the exact
model (the process's first-call allocations), then for each case the measured forward
(B = 1, one thread; a variant's state drawn at first sight of N, e.g. a Linformer
projection, is part of its peak). It prints one JSON line per case. The parent computes
accuracies meanwhile and collects the peaks before it times anything, so the probe never
shares the cores with a timing.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile

from harness.measure.memory import MALLOC_ENV


class Probe:
    """The child process measuring the peaks of `cases` (harness.drift.engine.Case list)."""

    def __init__(self):
        """Start the child at once: it imports torch and transformers while the parent
        checks its input and tokenises, then waits for `send`."""
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, **MALLOC_ENV,
               "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        # stderr to a file: a child blocked on a full pipe would never finish.
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.drift.memory"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, env=env, cwd=repo, text=True)

    def send(self, source, windows: int, seed: int, cases: list) -> None:
        """Give the child its cases. The parent's first window of each N travels as token
        ids: the child never runs the tokenizer. Memory a long encode frees stays inside
        the heap below live objects; later allocations reuse it without raising VmRSS,
        and every peak read 0."""
        ids = {str(n): w[0].tolist() for n, w in source.windows.items()}
        spec = {"model": source.path, "windows": windows, "seed": seed,
                "ids": ids, "text_sha": source.text_sha,
                "cases": [{"variant": c.variant, "params": c.params, "seq_len": c.seq_len}
                          for c in cases if c.seq_len not in source.too_short]}
        self.proc.stdin.write(json.dumps(spec))
        self.proc.stdin.close()

    def collect(self) -> dict[tuple, float]:
        """Wait for the child; {row key: peak MiB}. RuntimeError with its stderr if it failed."""
        out = self.proc.stdout.read()
        if self.proc.wait() != 0:
            self.err.seek(0)
            err = self.err.read()
            tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["no message"]
            raise RuntimeError(f"the memory probe failed: {tail[0]}")
        peaks = {}
        for line in out.splitlines():
            rec = json.loads(line)
            peaks[tuple(rec["key"])] = rec["peak_mem_mib"]
        return peaks

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def main() -> int:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM  # noqa: F401  (the slow imports)

    import variants
    from harness.models import source as hf
    from harness.drift import engine as md
    from harness.models.source import quiet_transformers
    from harness.measure.memory import peak_cpu_mib
    from harness.drift.store import row_key
    from harness.measure.worker import import_extra

    quiet_transformers()
    import_extra()  # the parent's variant modules (ATTNBENCH_EXTRA_MODULES), entry points
    data = sys.stdin.read()
    if not data:  # the parent stopped before sending (bad input, nothing to measure)
        return 0
    spec = json.loads(data)
    torch.set_num_threads(1)  # beside the parent's accuracy forwards, one core each
    windows = {int(n): torch.tensor([ids]) for n, ids in spec["ids"].items()}
    source = md.Source(spec["model"], hf.model_info(spec["model"]), windows, {}, spec["text_sha"])
    model, _ = hf.load_model(source.path)
    causal = source.info.causal
    md.set_exact(model)  # one untimed forward: the process's first-call allocations
    md.forward(model, next(iter(windows.values())), causal)
    gc.freeze()  # the imports and the model live to the end: each collect below skips them
    for c in spec["cases"]:
        case = md.Case(c["variant"], c["params"], c["seq_len"])
        module = variants.build(case.variant, **case.params)
        if md.case_reasons(case, module, model, source):
            continue
        md.set_variant(model, module, case)
        one = source.windows[case.seq_len]
        # Python's collector freeing earlier garbage inside the call would lower the
        # resident size under the level read before it: collect first.
        gc.collect()
        gc.disable()
        peak = peak_cpu_mib(lambda: md.forward(model, one, causal))
        gc.enable()
        key = row_key(md.base_row(case, source, spec["windows"], spec["seed"]))
        print(json.dumps({"key": list(key), "peak_mem_mib": peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
