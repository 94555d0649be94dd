"""The decode pass: time and memory per generated token at a context of N tokens.

For a case of seq_len N and decode_tokens T (in the worker, like every part of a case):
the context's keys and values are drawn from the case's seed in chunks of `CHUNK` tokens
and fed straight into the variant's state (`prefill` on the first chunk, `extend` on the
rest; a variant that cannot extend gets the whole context in one prefill), so no
(3, B, H, N, D) tensor exists at 1M tokens; the same chunks feed the float64 reference of
the generated tokens as they pass. The prefill is timed once (`prefill_ms`),
outside the timed region. Then T new tokens are generated; a timed repeat is those T
steps followed by a rewind of the state to context N (a cache's length set back, a small
state copied back), so the context never grows across repeats; `time_ms` is the median
over repeats of their time divided by T. `decode_state_mib` is `state_nbytes` at context N,
`peak_mem_mib` one step's peak above what is resident, `state_mib` what the prefilled state
left resident. The T outputs are compared with float64 exact causal attention over the
same context (`accuracy.DecodeReference`, an online softmax over the chunks); a variant
measured against its own recurrence (`err_ref` = recurrence) against that recurrence run
in float64: the same prefill and steps on the context and tokens in float64. Declared
inputs beyond q, k, v (gates) are drawn with each chunk, from the chunk's seed, and with
the new tokens.

Chunk i of the context is drawn as an N = CHUNK sequence of its distribution from seed
(seed * 1_000_003 + i); the new tokens from (seed * 1_000_003 + 999_983). For `local`
inputs the positional pattern therefore restarts every chunk.
"""

from __future__ import annotations

import time

import torch

from harness.measure import accuracy, memory, timing
from harness.measure.inputs import make_inputs

CHUNK = 8192
_NEW_TOKENS_SEED = 999_983


def _draw(case, module, r, dtype, device, seed):
    q, k, v = make_inputs(case.input, case.batch, case.heads, r, case.head_dim, dtype=dtype,
                          device=device, seed=seed)
    inputs = module.draw_inputs(case.batch, case.heads, r, case.head_dim, seed=seed,
                                dtype=dtype, device=device)
    return q, k, v, inputs


def context_chunks(case, module, dtype, device):
    """The context's (k, v, inputs) chunks, (B, H, r, D) each, in order, from the seed."""
    for i, s in enumerate(range(0, case.seq_len, CHUNK)):
        r = min(CHUNK, case.seq_len - s)
        _, k, v, inputs = _draw(case, module, r, dtype, device, case.seed * 1_000_003 + i)
        yield k, v, inputs


def new_tokens(case, module, dtype, device):
    """q, k, v (B, H, T, D) of the T generated tokens, and their inputs."""
    return _draw(case, module, case.decode_tokens, dtype, device,
                 case.seed * 1_000_003 + _NEW_TOKENS_SEED)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(case, module, dtype, device, reference=None):
    """(state, prefill seconds): the context fed into the state chunk by chunk (and into
    `reference`, an `accuracy.DecodeReference`, when given)."""
    max_len = case.seq_len + case.decode_tokens
    chunks = context_chunks(case, module, dtype, device)
    if reference is not None:
        chunks = _fed(chunks, reference)
    if not module.has_extend():  # one prefill of the whole context
        ks, vs, ins = zip(*chunks)
        k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
        inputs = {n: torch.cat([i[n] for i in ins], dim=2) for n in ins[0]}
        del ks, vs, ins
        _sync(device)
        start = time.perf_counter()
        state = module.prefill(k, v, max_len=max_len, **inputs)
        _sync(device)
        return state, time.perf_counter() - start
    spent, state = 0.0, None
    for k, v, inputs in chunks:
        _sync(device)
        start = time.perf_counter()
        state = (module.prefill(k, v, max_len=max_len, **inputs) if state is None
                 else module.extend(state, k, v, **inputs))
        _sync(device)
        spent += time.perf_counter() - start
    return state, spent


def _fed(chunks, reference):
    for k, v, inputs in chunks:
        reference.add(k, v, inputs)
        yield k, v, inputs


class _OwnReference:
    """The variant's own float64 form, fed the same context: for err_ref = recurrence."""

    def __init__(self, case, module, max_len):
        self.case, self.module, self.max_len, self.state = case, module, max_len, None

    def add(self, k, v, inputs):
        k, v, inputs = k.double(), v.double(), {n: x.double() for n, x in inputs.items()}
        self.state = (self.module.prefill(k, v, max_len=self.max_len, **inputs)
                      if self.state is None else self.module.extend(self.state, k, v, **inputs))

    def finish(self, q, k, v, inputs):
        q, k, v = q.double(), k.double(), v.double()
        out = _steps(self.module, self.state, q, k, v,
                     {n: x.double() for n, x in inputs.items()}, None)()
        return torch.cat(out, dim=-2)


class _SoftmaxReference(accuracy.DecodeReference):
    def add(self, k, v, inputs=None, allowed=None):
        super().add(k, v, allowed)

    def finish(self, q, k, v, inputs):
        return super().finish(k, v)


def _steps(module, state, q, k, v, inputs, mark):
    """A callable: generate the T tokens, then rewind to the context (`mark`: None to
    keep going); returns the outputs."""
    T = q.shape[-2]

    def run():
        out = []
        for t in range(T):
            o, _ = module.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                               **{n: x[:, :, t:t + 1] for n, x in inputs.items()})
            out.append(o)
        if mark is not None:
            state.rewind(mark)
        return out

    return run


def _read_mib(case, module, dtype) -> float | None:
    """MiB a step reads at context N (`decode_read_size`), batch and heads included."""
    size = module.decode_read_size(case.seq_len, case.head_dim)
    return None if size is None else (case.batch * case.heads * size
                                      * torch.finfo(dtype).bits // 8 / memory.MIB)


def measure(case, module, device, part: str) -> dict:
    """One part ("memory", "time", "retime") of a decode case: result fields."""
    dtype = getattr(torch, case.dtype)
    T = case.decode_tokens
    with torch.no_grad():
        q, k, v, inputs = new_tokens(case, module, dtype, device)
        reference = None
        if part == "time":
            reference = (_OwnReference(case, module, case.seq_len + T)
                         if module.err_ref == "recurrence" else _SoftmaxReference(q))
        before = memory.resident_mib(device)
        state, prefill_s = prefill(case, module, dtype, device, reference)
        kept = max(0.0, memory.resident_mib(device) - before)
        mark = state.mark()
        run = _steps(module, state, q, k, v, inputs, mark)
        if part == "memory":
            one = _steps(module, state, q[:, :, :1], k[:, :, :1], v[:, :, :1],
                         {n: x[:, :, :1] for n, x in inputs.items()}, mark)
            one()  # the first step's one-time costs (lazy kernels) are not its peak
            return {"status": "ok", "reason": "", "peak_mem_mib": memory.peak_mib(one, device),
                    "state_mib": kept}
        start = time.perf_counter()
        out = run()  # warm-up; its outputs are the ones checked
        call_s = time.perf_counter() - start
        fields = {}
        if part == "time":
            o = torch.cat(out, dim=-2)  # (B, H, T, D)
            if not bool(torch.isfinite(o).all()):
                return {"status": "nonfinite", "reason": "a generated token's output has NaN "
                                                         "or Inf"}
            err = accuracy.decode_error(o, reference.finish(q, k, v, inputs))
            fields = {"rel_err": err.rel_err, "max_abs_err": err.max_abs_err,
                      "err_rows": err.err_rows, "row_cos": err.row_cos,
                      "prefill_ms": prefill_s * 1e3,
                      "decode_state_mib": module.state_nbytes(state) / memory.MIB,
                      "decode_read_mib": _read_mib(case, module, dtype)}
        t = timing.time_call(run, min_run_time=case.min_run_time_s / case.rounds,
                             min_repeats=-(-case.min_repeats // case.rounds), warmup=0,
                             call_s=call_s, device=device)
        return {"status": "ok", "reason": "", "time_ms": t.time_ms / T,
                "time_ms_iqr": t.time_ms_iqr / T, "repeats": t.repeats,
                "samples_ms": [s / T for s in t.samples_ms], **fields}
