"""The decode pass: time and memory per generated token at a context of N tokens.

For a case of seq_len N and decode_tokens T (in the worker, like every part of a case):
the context's keys and values are drawn from the case's seed in chunks of `CHUNK` tokens
and fed straight into the variant's state (`prefill` on the first chunk, `extend` on the
rest; a variant that cannot extend gets the whole context in one prefill), so no
(3, B, H, N, D) tensor exists at 1M tokens; the same chunks feed the float64 reference of
the generated tokens as they pass. The prefill is timed once (`prefill_ms`), outside the
timed region; it checks the context's declared inputs where they enter. The T new tokens
are checked once (`Variant.check_tokens`) and sliced before anything is timed; a timed
repeat is then the T steps alone (`decode_step`), after an untimed rewind of the state to
context N (a cache's length set back, a small state copied back: `timing.time_call`'s
setup), so the context never grows across repeats; `time_ms` is the median over repeats
of their time divided by T.

`decode_state_mib` is `state_nbytes` at context N, `peak_mem_mib` one step's peak above
what is resident, `state_mib` what the prefilled state left resident, `decode_read_mib` the
bytes a step moves (`traffic_mib`): what it reads of its state and, for a state rewritten
every step, what it writes back, in the state's own element size; `decode_flops` the FLOPs
of one generated token (`step_flops`: the variant's `decode_flops_at`, batch included),
which the report's roofline bound sets against the run's matmul rate beside the moved
bytes against its read rate.

The T outputs are compared with an independent float64 reference over the same context:
exact causal attention (`accuracy.DecodeReference`, an online softmax over the chunks), or,
for a variant measured against its own recurrence (`err_ref` = recurrence), its causal
forward in float64 carried from chunk to chunk (`Variant.reference_from`), or the
variant's own `decode_reference` where it gives one (mla: an online softmax of the T new
tokens over the latents, where its `reference_from` would cost the square of the
context): never its decoding form run again, so a wrong step shows in the row.

Chunk i of the context is drawn as an N = CHUNK sequence of its distribution from seed
(seed * 1_000_003 + i); the new tokens from (seed * 1_000_003 + 999_983); their declared
inputs (gates) with them, from the same seeds, except the gates' per-case parameters
(Mamba2's A_log and dt_bias), drawn once from the case's seed for the whole sequence, as
a forward case of that seed draws them. For `local` inputs the positional pattern
therefore restarts every chunk.

A layer pattern (harness.measure.layers.Stack) runs the same pass over its layers: layer l
draws its own context, tokens and gate parameters from every seed above plus
l * LAYER_SEED (layer 0 draws what the plain variant draws), prefills its own state, and a
timed repeat is the T tokens each stepped through every layer in turn (token by token, as
a model generates), after the rewind of every layer's state. `prefill_ms`,
`decode_state_mib`, `decode_read_mib` and `decode_flops` are the sums over the layers; the
error columns stay empty, with the reason (`layers.NO_REFERENCE`): the row has no single
reference, and each mixer's own decoding keeps its own tests.
"""

from __future__ import annotations

import time

import torch

from harness.measure import accuracy, layers, memory, timing
from harness.measure.inputs import make_inputs
from variants import expand_heads, per_token

CHUNK = 8192
_NEW_TOKENS_SEED = 999_983
# Layer l of a stack draws from every seed of layer 0 plus l * LAYER_SEED: a prime far above
# the chunk and token offsets (below 1_000_003), so no two layers or seeds share a draw.
LAYER_SEED = 1_000_000_007


def _draw(case, module, r, dtype, device, seed, layer=0):
    seed += layer * LAYER_SEED
    q, k, v = make_inputs(case.input, case.batch, case.heads, r, case.head_dim, dtype=dtype,
                          device=device, seed=seed, kv_heads=case.kv_heads,
                          value_heads=case.value_heads, value_dim=case.value_dim)
    inputs = module.draw_inputs(case.batch, case.shape.out_heads, r, case.head_dim, seed=seed,
                                dtype=dtype, device=device,
                                fixed_seed=case.seed + layer * LAYER_SEED)
    return q, k, v, inputs


def context_chunks(case, module, dtype, device, layer=0):
    """The context's (q, k, v, inputs) chunks, (B, H, r, D) each, in order, from the seed
    (the queries serve a reference that runs the causal forward; the decoder takes k, v);
    `layer`: a stack's layer, which draws its own."""
    for i, s in enumerate(range(0, case.seq_len, CHUNK)):
        r = min(CHUNK, case.seq_len - s)
        yield _draw(case, module, r, dtype, device, case.seed * 1_000_003 + i, layer)


def new_tokens(case, module, dtype, device, layer=0):
    """q, k, v (B, H, T, D) of the T generated tokens, and their inputs (of `layer`)."""
    return _draw(case, module, case.decode_tokens, dtype, device,
                 case.seed * 1_000_003 + _NEW_TOKENS_SEED, layer)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(case, module, dtype, device, reference=None, layer=0):
    """(state, prefill seconds): the context (of `layer`) fed into the state chunk by chunk
    (and into `reference`, a softmax or recurrence reference below, when given)."""
    max_len = case.seq_len + case.decode_tokens
    chunks = context_chunks(case, module, dtype, device, layer)
    if reference is not None:
        chunks = _fed(chunks, reference)
    if not module.has_extend():  # one prefill of the whole context
        ks, vs, ins = zip(*((k, v, i) for _, k, v, i in chunks))
        k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
        inputs = {n: _joined(module, n, [i[n] for i in ins]) for n in ins[0]}
        del ks, vs, ins
        _sync(device)
        start = time.perf_counter()
        state = module.prefill(k, v, max_len=max_len, q_heads=case.heads, **inputs)
        _sync(device)
        return state, time.perf_counter() - start
    spent, state = 0.0, None
    for _, k, v, inputs in chunks:
        _sync(device)
        start = time.perf_counter()
        state = (module.prefill(k, v, max_len=max_len, q_heads=case.heads, **inputs)
                 if state is None
                 else module.extend(state, k, v, **inputs))
        _sync(device)
        spent += time.perf_counter() - start
    return state, spent


def _per_token(module, name: str) -> bool:
    """Whether the declared input `name` has one value a token (gates: cut and joined with
    the tokens) or not (a sink a head: the same whole tensor in every piece)."""
    return next((per_token(s) for s in module.contract.inputs if s.name == name), True)


def _joined(module, name, pieces):
    return torch.cat(pieces, dim=2) if _per_token(module, name) else pieces[0]


def _fed(chunks, reference):
    for q, k, v, inputs in chunks:
        reference.add(q, k, v, inputs)
        yield q, k, v, inputs


class RecurrenceReference:
    """For err_ref = recurrence: the variant's float64 causal forward over the context and
    then the new tokens, its state carried from piece to piece (`reference_from`)."""

    def __init__(self, module):
        self.module, self.state = module, None

    def add(self, q, k, v, inputs):
        _, self.state = self.module.reference_from(self.state, *expand_heads(q, k, v),
                                                   **inputs)

    def finish(self, q, k, v, inputs):
        return self.module.reference_from(self.state, *expand_heads(q, k, v), **inputs)[0]


class SoftmaxReference:
    """Exact causal attention in float64 over the context and the new tokens
    (`accuracy.DecodeReference`, for the new tokens' queries)."""

    def __init__(self, q):
        self.ref = accuracy.DecodeReference(q)

    def add(self, q, k, v, inputs):
        self.ref.add(k, v)

    def finish(self, q, k, v, inputs):
        return self.ref.finish(k, v, sinks=inputs.get("sinks"))


def tokens(module, q, k, v, inputs) -> list[tuple]:
    """The T new tokens as (q, k, v, inputs) of (B, H, 1, D) slices, checked once here
    (`Variant.check_tokens`: what `step` checks on every token) and sliced before any
    timing, so that the timed loop holds the steps and nothing else."""
    module.check_tokens(q, k, v, **inputs)
    cut = {n: _per_token(module, n) for n in inputs}
    return [(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
             {n: x[:, :, t:t + 1] if cut[n] else x for n, x in inputs.items()})
            for t in range(q.shape[-2])]


def steps(mods, states, toks):
    """A callable: the decoding steps of the T tokens, each token through every layer in
    turn (`mods`, `states` and `toks`, each layer's tokens from `tokens`, one entry a
    layer), from the states as they are: the method alone (`unchecked_step`: the tokens
    were checked by `tokens`; a `repeat` grouping's repeat of the token's heads, then
    `decode_step`), its arguments laid out beforehand; returns the outputs in that
    order (token-major: token t of layer l is entry t * layers + l)."""
    plan = [(m.unchecked_step, s, *tok[t]) for t in range(len(toks[0]))
            for m, s, tok in zip(mods, states, toks)]

    def run():
        return [step(state, q, k, v, **i)[0] for step, state, q, k, v, i in plan]

    return run


def traffic_mib(case, module, state) -> float | None:
    """MiB a step moves at context N, batch and heads included: what it reads of its state
    (`decode_read_size_at`: all of it, or a sparse decoder's chosen blocks, and shared
    indexer keys once) and what it writes (the new token, or the whole state again where
    the step rewrites it), in the state's own element size (`state_nbytes` over its
    elements: a recurrence keeps a float32 state for a bfloat16 case)."""
    N, D, s = case.seq_len, case.head_dim, case.shape
    read = module.decode_read_size_at(N, s)  # per batch element, all heads, Dv wide
    if read is None:
        return None
    # A cache that appends writes the new token's key and value in each head it holds (Hk
    # natively, one per output head where the grouping repeats); any other state is
    # rewritten whole: what it reads.
    write = state.heads() * (D + s.Dv) if state.appends else read
    elements = sum(t.numel() for t in state.tensors())
    per_element = module.state_nbytes(state) / elements if elements else 0.0
    return case.batch * (read + write) * per_element / memory.MIB


def step_flops(case, module) -> int | None:
    """FLOPs of one generated token at context N, batch included: the variant's
    `decode_flops_at` (a stack's: the sum over its layers) times B; None where it does not
    say."""
    per = module.decode_flops_at(case.seq_len, case.shape)
    return None if per is None else case.batch * per


def _sum_or_none(values):
    values = list(values)
    return None if None in values else sum(values)


def measure(case, module, device, part: str) -> dict:
    """One part ("memory", "time", "retime") of a decode case: result fields. `module`: the
    case's (harness.measure.layers.build), a variant or a stack of layers."""
    dtype = getattr(torch, case.dtype)
    T = case.decode_tokens
    mods = layers.of(module)
    with torch.no_grad():
        drawn = [new_tokens(case, m, dtype, device, layer) for layer, m in enumerate(mods)]
        toks = [tokens(m, *d) for m, d in zip(mods, drawn)]
        reference = None
        if part == "time" and module.contract.err_ref is not None:  # a plain variant: one layer
            q, k, v, inputs = drawn[0]
            reference = module.decode_reference(q, k, v, **inputs) or (
                RecurrenceReference(module) if module.contract.err_ref == "recurrence"
                else SoftmaxReference(q))
        before = memory.resident_mib(device)
        states, prefill_s = [], 0.0
        for layer, m in enumerate(mods):
            state, spent = prefill(case, m, dtype, device, reference, layer)
            states.append(state)
            prefill_s += spent
        kept = max(0.0, memory.resident_mib(device) - before)
        marks = [s.mark() for s in states]

        def rewind():
            for s, mark in zip(states, marks):
                s.rewind(mark)

        if part == "memory":
            one = steps(mods, states, [t[:1] for t in toks])
            one()  # the first step's one-time costs (lazy kernels) are not its peak
            rewind()
            return {"status": "ok", "reason": "", "state_mib": kept,
                    "peak_mem_mib": memory.peak_mib(lambda: (one(), rewind()), device)}
        run = steps(mods, states, toks)
        start = time.perf_counter()
        out = run()  # warm-up; its outputs are the ones checked
        call_s = time.perf_counter() - start
        fields, reason = {}, ""
        if part == "time":
            if not all(bool(torch.isfinite(o).all()) for o in out):
                return {"status": "nonfinite", "reason": "a generated token's output has NaN "
                                                         "or Inf"}
            if reference is None:
                reason = layers.NO_REFERENCE
            else:
                q, k, v, inputs = drawn[0]
                err = accuracy.decode_error(torch.cat(out, dim=-2),  # (B, H, T, D)
                                            reference.finish(q, k, v, inputs))
                fields = {"rel_err": err.rel_err, "max_abs_err": err.max_abs_err,
                          "err_rows": err.err_rows, "row_cos": err.row_cos}
            fields.update(
                prefill_ms=prefill_s * 1e3,
                decode_state_mib=sum(m.state_nbytes(s) for m, s in zip(mods, states))
                / memory.MIB,
                decode_read_mib=_sum_or_none(traffic_mib(case, m, s)
                                             for m, s in zip(mods, states)),
                decode_flops=step_flops(case, module))
        t = timing.time_call(run, min_run_time=case.min_run_time_s / case.rounds,
                             min_repeats=-(-case.min_repeats // case.rounds), warmup=0,
                             call_s=call_s, device=device, setup=rewind)
        return {"status": "ok", "reason": reason, "time_ms": t.time_ms / T,
                "time_ms_iqr": t.time_ms_iqr / T, "repeats": t.repeats,
                "samples_ms": [s / T for s in t.samples_ms], **fields}
