"""Drift of a pretrained model when a variant replaces its attention: the `model` command.

For each (variant setting, N) the model runs on `windows` seeded token windows of N tokens
(harness.models.source.token_windows), once with transformers' own exact attention (its
native "sdpa" implementation, float32; "eager" where a model has no SDPA path) and once
with the variant registered through transformers.AttentionInterface
(harness.models.attention). The model is loaded once and switched with
`set_attn_implementation(name)`, the setting `from_pretrained(attn_implementation=name)`
makes. Everything else in the model runs unchanged. Per case:

- encoders: `emb_cos`, the mean over windows of the cosine similarity of the pooled
  sentence embeddings (the model's sentence-transformers pooling, 1_Pooling/config.json;
  mean over tokens where there is none), and `hidden_rel_err`,
  ||h - h_ref||_F / ||h_ref||_F of the last hidden state over all windows;
- causal LMs: `kl`, the mean over windows and positions of KL(p_exact || p_variant) of the
  next-token distributions (float64), and `ppl_ratio`, the variant's perplexity of the
  windows' next tokens over the exact model's;
- `time_ms`: median whole-model forward of one window (B = 1) after the untimed accuracy
  forwards of the same shape (harness.measure.timing.time_call), with no other work on the cores;
- `peak_mem_mib`: peak resident memory of one such forward above what was resident before,
  measured in a child process (harness.drift.memory, one thread) whose environment has
  the malloc settings of docs/measurement.md (harness.measure.memory.MALLOC_ENV). The
  child runs while this process computes the accuracies (numbers that do not depend on
  load; one thread, so the two share the cores without oversubscribing them), and is
  waited for before anything is timed.

A case no variant or model can do (causal for a non-causal variant, N above the model's
positions or too long for the text, a model scaling other than 1/sqrt(D), ...) is a
`skipped` row with its reason. Rows are appended to model.csv (harness.drift.store): a
skipped case's at once, a measured case's after its timing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import torch

import variants
from harness.models import attention as ha
from harness.models import source as hf
from harness.errors import UsageError
from harness.measure.memory import is_oom_message
from harness.drift.store import ModelStore, row_key



def default_variants() -> list[str]:
    """The quick preset's variants that are not exact, with their defaults, after sdpa (the
    exact path through the same adapter: its drift is the adapter's own, zero to rounding).

    Taken from the preset (data), so no variant is named here; library kernels are not in
    it (compiling would take longer than the default job's whole budget): name them with
    --variants.
    """
    from harness.measure.matrix import read_toml
    from harness.files import EXACT_PATHS

    names = read_toml("quick")["variants"]
    return [EXACT_PATHS[0]] + [n for n in names if not variants.spec(n).exact]


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str
    params: dict
    seq_len: int

    @property
    def params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)


@dataclasses.dataclass
class Source:
    """The model, its facts, the token windows per N (or why there are none) and the text id."""
    path: str
    info: hf.ModelInfo
    windows: dict[int, torch.Tensor]
    too_short: dict[int, str]
    text_sha: str


def full_params(name: str, params: dict) -> dict:
    """Every parameter of a variant setting, defaults included (the params column)."""
    return variants.stored_params(name, **params)


def open_source(model: str | None, text_path, seq_lens: list[int], windows: int,
                seed: int) -> Source:
    """Resolve and check the model and the text; cut the windows. UsageError on bad input."""
    path = str(hf.resolve_model(model))
    info = hf.model_info(path)
    ha.check_swappable(path, info.causal)
    text = hf.load_text(text_path)
    tokenizer = hf.load_tokenizer(path)
    cut, short = {}, {}
    for n in seq_lens:
        try:
            cut[n] = hf.token_windows(tokenizer, text, n, windows, seed)
        except hf.TextTooShort as e:
            short[n] = str(e)
    if not cut:
        raise UsageError(f"the text is too short for every requested N: {short[min(short)]}")
    return Source(path, info, cut, short, hashlib.sha256(text.encode()).hexdigest()[:16])


def case_reasons(case: Case, module, model, source: Source) -> list[str]:
    """Why this case cannot run (empty when it can): the text, the model, then the variant."""
    why = [source.too_short[case.seq_len]] if case.seq_len in source.too_short else []
    why += ha.model_reasons(model, source.info.head_dim, case.seq_len)
    if module.contract.inputs:  # a recurrence's gates: nothing in a softmax model makes them
        names = ", ".join(s.name for s in module.contract.inputs)
        why.append(f"{case.variant} takes {names} beyond "
                   "q, k, v: the pretrained model has no gates to give it")
    return why + module.unsupported_reasons(device="cpu", dtype=torch.float32,
                                            causal=source.info.causal, seq_len=case.seq_len,
                                            head_dim=source.info.head_dim)


def set_variant(model, module, case: Case) -> None:
    model.set_attn_implementation(ha.register(module, case.params))


def set_exact(model) -> None:
    model.set_attn_implementation("sdpa" if type(model)._supports_sdpa else "eager")


def forward(model, ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """(1, N) ids -> last hidden state (1, N, hidden) of an encoder, logits (1, N, V) of an LM."""
    with torch.no_grad():
        if causal:
            return model(input_ids=ids, use_cache=False).logits
        return model(input_ids=ids).last_hidden_state


def pooling_mode(path: str) -> str:
    """The sentence-transformers pooling of the model ('mean', 'cls' or 'max'); 'mean' if none."""
    cfg = Path(path) / "1_Pooling" / "config.json"
    if cfg.is_file():
        flags = json.loads(cfg.read_text())
        for mode in ("cls", "max"):
            if flags.get(f"pooling_mode_{mode}_token" if mode == "cls" else
                         f"pooling_mode_{mode}_tokens"):
                return mode
    return "mean"


def pool(h: torch.Tensor, mode: str) -> torch.Tensor:
    """(W, N, hidden) -> (W, hidden): the sentence embedding of each unpadded window."""
    if mode == "cls":
        return h[:, 0]
    return h.amax(dim=1) if mode == "max" else h.mean(dim=1)


def drift(out: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor, causal: bool,
          pooling: str) -> dict:
    """The drift metrics of a variant's outputs against the exact model's, over all windows."""
    if not causal:  # (W, N, hidden)
        cos = torch.nn.functional.cosine_similarity(pool(out.double(), pooling),
                                                    pool(ref.double(), pooling), dim=-1)
        rel = (out.double() - ref.double()).norm() / ref.double().norm()
        return {"emb_cos": cos.mean().item(), "hidden_rel_err": rel.item()}
    # (W, N, V): position i predicts token i + 1; the last position has no target.
    lp = torch.log_softmax(out[:, :-1].double(), dim=-1)
    lp_ref = torch.log_softmax(ref[:, :-1].double(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean()
    target = ids[:, 1:, None]
    nll, nll_ref = -lp.gather(-1, target).mean(), -lp_ref.gather(-1, target).mean()
    return {"kl": kl.item(), "ppl_ratio": math.exp((nll - nll_ref).item())}


def base_row(case: Case, source: Source, windows: int, seed: int,
             threads: int | None = None) -> dict:
    threads = threads or torch.get_num_threads()
    return {"model": source.info.name, "variant": case.variant,
            "family": variants.spec(case.variant).family, "params": case.params_json,
            "device": "cpu", "dtype": "float32", "seq_len": case.seq_len, "windows": windows,
            "causal": source.info.causal, "threads": threads, "seed": seed}


def settings_of(source: Source, windows: int, seed: int) -> dict:
    """What must match for a rerun into the same folder to resume (model_meta.json)."""
    return {"model": source.info.name, "model_path": source.path, "text_sha256": source.text_sha,
            "windows": windows, "seed": seed}


def plan(variant_specs: list[tuple[str, dict]], seq_lens: list[int]) -> list[Case]:
    return [Case(name, full_params(name, params), n)
            for n in seq_lens for name, params in variant_specs]


def run(source: Source, model, cases: list[Case], store: ModelStore, windows: int,
        seed: int, threads: int, memory_probe) -> dict[str, int]:
    """Measure `cases` (those not yet in the store); returns the count of rows per status.

    `model` is hf_source.load_model's, `memory_probe` a started harness.drift.memory.Probe
    (or None: no memory column). While the probe runs (one thread), the accuracies are
    computed on one thread too, so the two processes do not oversubscribe the cores; the
    timings then use `threads`.
    """
    from harness.measure.timing import time_call

    torch.set_num_threads(1 if memory_probe is not None else threads)
    causal, pooling = source.info.causal, pooling_mode(source.path)
    counts: dict[str, int] = {}
    refs = {}  # N -> the exact model's outputs, computed when a case at N first runs
    measured = []
    for case in cases:
        module = variants.build(case.variant, **case.params)
        row = base_row(case, source, windows, seed, threads)
        why = case_reasons(case, module, model, source)
        if why:
            store.append({**row, "status": "skipped", "reason": "; ".join(why)})
            counts["skipped"] = counts.get("skipped", 0) + 1
            continue
        ids = source.windows[case.seq_len]
        if case.seq_len not in refs:
            set_exact(model)
            refs[case.seq_len] = torch.cat([forward(model, ids[i:i + 1], causal)
                                            for i in range(len(ids))])
        set_variant(model, module, case)
        try:
            start = time.perf_counter()
            outs = [forward(model, ids[i:i + 1], causal) for i in range(len(ids))]
            call_s = (time.perf_counter() - start) / len(ids)
        except RuntimeError as e:  # only memory exhaustion is a row; anything else is a bug
            if not is_oom_message(str(e)):
                raise
            store.append({**row, "status": "oom", "reason": str(e).splitlines()[0][:200]})
            counts["oom"] = counts.get("oom", 0) + 1
            continue
        out = torch.cat(outs)
        if not torch.isfinite(out).all():
            store.append({**row, "status": "nonfinite", "reason": "non-finite model outputs"})
            counts["nonfinite"] = counts.get("nonfinite", 0) + 1
            continue
        measured.append((case, module, row, call_s,
                         drift(out, refs[case.seq_len], ids, causal, pooling)))
    peaks = memory_probe.collect() if memory_probe is not None else {}
    torch.set_num_threads(threads)
    for case, module, row, call_s, metrics in measured:  # the cores are quiet now: time
        set_variant(model, module, case)
        one = source.windows[case.seq_len][:1]
        # No warm-up: the accuracy forwards above ran this variant at this shape already.
        t = time_call(lambda: forward(model, one, causal), min_run_time=0.2, min_repeats=3,
                      warmup=0, call_s=call_s)
        store.append({**row, **metrics, "status": "ok", "time_ms": t.time_ms,
                      "time_ms_iqr": t.time_ms_iqr, "repeats": t.repeats,
                      "peak_mem_mib": peaks.get(row_key(row))})
        counts["ok"] = counts.get("ok", 0) + 1
    return counts
