"""The per-case worker: `python -m harness.measure.worker` reads (case, part) requests (JSON lines)
on stdin and writes one result (a JSON line) per request on stdout.

A case is measured in two parts, each in its own long-lived worker process:
- `memory`: the memory the variant keeps between calls (`state_mib`: what its preparation
  and first call leave resident) and the peak of one call above that (`peak_mem_mib`), in
  a worker whose environment has harness.measure.memory.MALLOC_ENV (freed memory goes back
  to the kernel, so VmRSS and VmHWM are right);
- `time`: the error of the forward output against float64 exact attention and the median
  time, in a worker with glibc's default malloc. The memory settings make every small
  temporary a fresh mmap and page faults then dominate chunked code (measured here:
  block_sparse forward at N=8192, H=8 took 873 ms with them and 435 ms without).
- `retime`: the time alone, again, in the time worker: rounds 2..R of a case timed in
  rounds (harness.measure.loop). Each round's timing takes min_run_time_s / R and at
  least ceil(min_repeats / R) timings, after its own warm-up, and returns its samples.
Each part caps the worker's address space during the case, so a runaway allocation is an
`oom` result, not a swapped machine. Anything else a case raises is an `error` result with
its message. On CUDA the caching allocator is emptied after each part, so that the memory
one worker's allocator holds is free for the other's.

ATTNBENCH_EXTRA_MODULES (os.pathsep-separated module names or .py paths) names modules to
import before the first case: variants registered outside the `variants` package (tests).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

import variants

from harness.measure import accuracy
from harness.measure import decode
from harness.measure import layers
from harness.models import capture
from harness.measure import memory
from harness.measure import timing
from harness.measure.inputs import DISTRIBUTIONS, make_inputs
from harness.measure.matrix import Case

EXTRA_ENV = "ATTNBENCH_EXTRA_MODULES"
# Marks result lines, so that anything else written to stdout before it was redirected
# (an import-time print) cannot be mistaken for a result.
RESULT_PREFIX = "ATTNBENCH-RESULT "


def import_extra(spec: str | None = None) -> None:
    """Import the variant modules of ATTNBENCH_EXTRA_MODULES (or `spec`) and the installed
    packages' `attnbench.variants` entry points, once per process (variants.load_module:
    a module that does not import, registers nothing or a taken name is a ModuleError)."""
    spec = os.environ.get(EXTRA_ENV, "") if spec is None else spec
    for item in filter(None, spec.split(os.pathsep)):
        variants.load_module(item)
    variants.load_entry_points()


def _result(status: str, reason: str = "", **fields) -> dict:
    return {"status": status, "reason": reason, **fields}


PARTS = ("memory", "time", "retime")


def run_case(case: Case, part: str) -> dict:
    """Measure one part of a case; returns result fields (status, reason, time_ms, ...)."""
    torch.set_num_threads(case.threads)
    device = torch.device(case.device)
    dtype = getattr(torch, case.dtype)
    common = {"threads": torch.get_num_threads()}
    try:
        module = layers.build(case).to(device)  # a variant, or a layer pattern's stack
        if case.decode:  # its context is drawn chunk by chunk into each state (decode.py)
            if device.type == "cpu":
                memory.cap_address_space(case.mem_limit_mib)
            try:
                return {**common, **decode.measure(case, module, device, part)}
            finally:
                if device.type == "cpu":
                    memory.lift_address_space_cap()
        if case.input in DISTRIBUTIONS:
            q, k, v = make_inputs(case.input, case.batch, case.heads, case.seq_len,
                                  case.head_dim, dtype=dtype, device=device, seed=case.seed,
                                  kv_heads=case.kv_heads, value_heads=case.value_heads,
                                  value_dim=case.value_dim)
        else:  # captured q, k, v, (layers x windows, H, N, D) from harness.models.capture's cache
            q, k, v = capture.load_inputs(case, dtype, device)
        # The inputs beyond q, k, v it declares (gates), from the case's seed, untimed.
        inputs = module.draw_inputs(q.shape[0], case.shape.out_heads, q.shape[2], q.shape[3],
                                    seed=case.seed, dtype=dtype, device=device)
        if device.type == "cpu":
            memory.cap_address_space(case.mem_limit_mib)
        try:
            measure = {"memory": _measure_memory, "time": _measure_time,
                       "retime": _retime}[part]
            return {**common, **measure(case, module, q, k, v, device, inputs)}
        finally:
            if device.type == "cpu":
                memory.lift_address_space_cap()
    except (MemoryError, torch.OutOfMemoryError) as e:
        return _result("oom", describe(e), **common)
    except RuntimeError as e:
        if memory.is_oom_message(str(e)):
            return _result("oom", describe(e), **common)
        return _result("error", describe(e), **common)
    except Exception as e:  # a variant's own failure is a result row, with its message
        return _result("error", describe(e), **common)


def _plain(reference):
    """A float64 reference on the shared heads repeated (grouped values: value head j
    reads query-key head j // (Hv / Hk)), as the variant's own plain form takes them."""
    def run(q, k, v, causal, **inputs):
        return reference(*variants.expand_heads(q, k, v), causal, **inputs)
    return run


def _prepare(case: Case, module, q, k, v, device) -> float | None:
    """The variant's one-time preparation (a library kernel's compile), in ms; None if none.

    Synchronised on CUDA so the kernels it launched are inside the measurement.
    """
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    did = module.prepare(q, k, v, case.causal, backward=case.backward)
    sync()
    return (time.perf_counter() - start) * 1e3 if did else None


def _measure_memory(case: Case, module, q, k, v, device, inputs: dict) -> dict:
    # A throwaway module of the same setting pays this process's one-time costs first
    # (lazy initialisation of torch's kernels and thread pools, a compile), so that what
    # `module`'s preparation and first call leave resident is its own state.
    first = layers.build(case).to(device)
    _prepare(case, first, q, k, v, device)
    _prepared(case, first, q, k, v, inputs)()
    _drop_grads(case, q, k, v, *inputs.values())
    del first
    gc.collect()
    before = memory.resident_mib(device)
    _prepare(case, module, q, k, v, device)
    fn = _prepared(case, module, q, k, v, inputs)
    fn()  # one-time state (features, layouts, masks, caches): kept, not the call's peak
    _drop_grads(case, q, k, v, *inputs.values())  # freed before the state is read and the probe's baseline
    state = max(0.0, memory.resident_mib(device) - before)  # below 0: allocator noise
    return _result("ok", "", peak_mem_mib=memory.peak_mib(fn, device), state_mib=state)


def _drop_grads(case: Case, *tensors) -> None:
    if case.backward:
        for t in tensors:
            t.grad = None


def _measure_time(case: Case, module, q, k, v, device, inputs: dict) -> dict:
    compile_ms = _prepare(case, module, q, k, v, device)  # before any call: never in time_ms
    # The forward output once, outside any timed region: finiteness and error.
    with torch.no_grad():
        o = module(q, k, v, causal=case.causal, **inputs)
    if not bool(torch.isfinite(o).all()):
        return _result("nonfinite", "forward output has NaN or Inf")
    # Against exact softmax attention, or (err_ref = recurrence) the variant's own float64 form.
    own = None if module.contract.err_ref == "softmax" else _plain(module.reference)
    err = accuracy.error(o, q, k, v, case.causal, max_rows=case.err_rows, seed=case.seed,
                         reference=own, inputs=inputs,
                         layers=capture.layers_of(case))
    errors = {"rel_err": err.rel_err, "max_abs_err": err.max_abs_err, "err_rows": err.err_rows,
              "row_cos": err.row_cos}
    if err.layer_rel_err is not None:
        errors["layer_rel_err"] = json.dumps([float(f"{x:.4g}") for x in err.layer_rel_err])
    if compile_ms is not None:  # travels with the error fields into every later result
        errors["compile_ms"] = compile_ms
    if case.selection and not case.backward:
        errors.update(_measure_selection(case, module, q, k, inputs, device))
    del o
    fn = _prepared(case, module, q, k, v, inputs)
    start = time.perf_counter()
    fn()  # warm-up (the error pass warmed up the forward only); its gradients are checked
    call_s = time.perf_counter() - start
    if case.backward and not all(bool(torch.isfinite(t.grad).all())
                                 for t in (q, k, v, *inputs.values())):
        return _result("nonfinite", "gradient of q, k, v (or an input) has NaN or Inf",
                       **errors)
    timed = _timed(case, fn, call_s, device)
    calls = module.contract.prepare_calls
    if "compile_ms" in errors and calls:  # prepare ran the pass itself
        errors["compile_ms"] = max(0.0, errors["compile_ms"] - calls * timed["time_ms"])
    return _result("ok", "", **timed, **errors)


def _measure_selection(case: Case, module, q, k, inputs: dict, device) -> dict:
    """`mass` and `select_ms` of a variant that selects keys (its `selection` is not None),
    and its selection's FLOPs and bytes a query (`Variant.selection_cost`; empty for a
    fixed pattern); {} for one that does not. The selection is timed alone, as the call
    is, on half the case's time budget."""
    if isinstance(module, layers.Stack):  # a layer pattern selects nothing as a whole
        return {}
    select = module.selection
    with torch.no_grad():
        sel = select(q, k, case.causal, **inputs)
        if sel is None:
            return {}
        mass = accuracy.mass_captured(module, sel, q, k, case.causal, max_rows=case.err_rows,
                                      seed=case.seed)
        del sel
        start = time.perf_counter()
        select(q, k, case.causal, **inputs)  # warm-up

        def fn():
            with torch.no_grad():
                select(q, k, case.causal, **inputs)
        t = timing.time_call(fn, min_run_time=case.min_run_time_s / 2,
                             min_repeats=case.min_repeats, warmup=0,
                             call_s=time.perf_counter() - start, device=device)
    cost = module.selection_cost(case.batch, case.heads, case.kv_heads or case.heads,
                                 case.seq_len, case.head_dim, case.causal,
                                 torch.empty(0, dtype=q.dtype).element_size())
    flops, nbytes = cost if cost is not None else (None, None)
    return {"mass": mass, "select_ms": t.time_ms, "select_flops": flops,
            "select_bytes": nbytes}


def _retime(case: Case, module, q, k, v, device, inputs: dict) -> dict:
    """A later round: the same preparation and warm-up, then the timing alone."""
    _prepare(case, module, q, k, v, device)  # a compile is cached: fast after round 1
    fn = _prepared(case, module, q, k, v, inputs)
    start = time.perf_counter()
    fn()  # warm-up
    return _result("ok", "", **_timed(case, fn, time.perf_counter() - start, device))


def _timed(case: Case, fn, call_s: float, device) -> dict:
    """One round's timing: a 1/rounds share of the case's budget; its samples travel along."""
    t = timing.time_call(fn, min_run_time=case.min_run_time_s / case.rounds,
                         min_repeats=-(-case.min_repeats // case.rounds), warmup=0,
                         call_s=call_s, device=device)
    return {"time_ms": t.time_ms, "time_ms_iqr": t.time_ms_iqr, "repeats": t.repeats,
            "samples_ms": list(t.samples_ms)}


def _prepared(case: Case, module, q, k, v, inputs: dict):
    """The call a case measures: forward, or forward then backward into q, k, v (and the
    inputs beyond them: a model trains its gates' projections too)."""
    if not case.backward:
        return timing.forward_fn(module, q, k, v, case.causal, **inputs)
    for t in (q, k, v, *inputs.values()):
        t.requires_grad_(True)
    return timing.forward_backward_fn(module, q, k, v, case.causal, **inputs)


def describe(e: BaseException) -> str:
    """'Type: first line of the message (at file:line of the innermost frame)'."""
    msg = str(e).strip().splitlines()
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {msg[0][:400] if msg else ''}{where}"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the runner dies (prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return  # not glibc Linux: the worker still exits at EOF on stdin
    libc.prctl(1, signal.SIGKILL)


def serve(handle) -> None:
    """A worker process's loop: one JSON request per stdin line, handle(request) -> result,
    one RESULT_PREFIX line per result on the real stdout (library prints go to stderr).
    Shared by this worker and the training worker (harness.train.worker)."""
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library prints go to stderr; stdout carries results only
    import_extra()
    # What the imports made (torch, the variants: some 175,000 objects) lives as long as the
    # process: out of the collector's reach, each gc.collect (the memory part's, before it
    # reads the resident size) and Python's own full collections scan only what cases made
    # (measured here: 0.09 s a collection before, 6 us after).
    gc.freeze()
    for line in sys.stdin:
        if not line.strip():
            continue
        proto.write(RESULT_PREFIX + json.dumps(handle(json.loads(line))) + "\n")
        proto.flush()


def _handle(request: dict) -> dict:
    result = run_case(Case(**request["case"]), request["part"])
    memory.release(request["case"]["device"])  # the case's tensors are gone by now
    return result


def main() -> None:
    serve(_handle)


if __name__ == "__main__":
    main()
