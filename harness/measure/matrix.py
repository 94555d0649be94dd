"""The benchmark matrix: a TOML table expanded by product into cases.

A matrix file holds the keys below at top level (the defaults of every group) and
optionally `[[groups]]` tables, each overriding some keys; each group is expanded by
product and the union (first occurrence of each case id wins) is the run. Without
`[[groups]]` the top level is the one group.

    variants = "all"            # every registered variant not starting with "_",
                                # or ["sdpa", "standard"], or {name = [{param = ...}, ...]}
    params = {linformer = [{k = 64}, {k = 256}]}   # settings for names taken from "all"/a list
    seq_lens = [512, 1024]      # ascending order is kept: the memory guard extrapolates
    batch = 1                   # an int or a list, likewise heads, head_dim
    heads = 4
    head_dim = 64
    kv_heads = [4, 1]           # softmax variants: key-value heads, dividing heads (default: heads)
    value_heads = [4, 8]        # recurrences: value heads, a multiple of heads (default: heads)
    value_dim = [64]            # values' width where a variant declares it (default: head_dim)
    dtypes = ["float32"]        # float32, float64, float16, bfloat16
    devices = ["cpu"]           # cpu, cuda
    inputs = ["gaussian"]       # harness.measure.inputs.DISTRIBUTIONS, "minilm", or a [captures.NAME]
    passes = ["forward", "forward_backward"]   # or "decode": time per generated token
    causal = [false]            # a decode case must be causal
    decode_tokens = 16          # decode: tokens generated (and timed) after each context
    seed = 0                    # inputs and variant state
    min_run_time_s = 0.2        # torch.utils.benchmark blocked_autorange budget per case
    min_repeats = 5             # at least this many timed measurements
    rounds = 1                  # time each case in this many rounds spread over the run (below)
    timeout_s = 120             # per case, wall clock, worker killed after it
    threads = 0                 # torch.set_num_threads in the worker; 0: all cores
    err_rows = 1024             # error on a seeded sample of this many query rows when N is larger
    selection = false           # also measure a sparse variant's selection: mass, select_ms (below)
    budgets = [0.0625, 0.25]    # a sparse variant at each budget: mean keys a query attends / N
    mem_limit_mib = 0           # worker address-space cap above its baseline; 0: MemAvailable * 0.9

    [baseline]                  # decode: the decoder every ratio is against (the report's
    variant = "sdpa"            # served baseline), a variant the matrix runs, with its
    kv_heads = 8                # params = {...}, kv_heads, value_heads, value_dim if not default

    [captures.NAME]             # a captured input of your own (harness.models.capture): a local
    model = "PATH"              # Hugging Face model directory and a UTF-8 text file;
    text = "PATH"               # then inputs = ["NAME"]

With `rounds = R` > 1 the run times round 1 of every case, then round 2 of every case, ...,
in the matrix's order, each round a fresh measurement with min_run_time_s / R and at least
ceil(min_repeats / R) timings (harness.measure.loop): the total stays about the same, and
a drift of the machine's speed between minutes shows as the spread between the rounds'
medians instead of hiding in one slow minute. Memory and error are measured once.

With `selection = true` (the `sparse-frontier` preset) a forward case of a variant that
selects keys (its `selection` is not None: routed, learned sparse, pattern variants) also
records `mass` (the share of exact attention's mass on the keys it selects, on the
error's rows: harness.measure.accuracy.mass_captured) and `select_ms` (the selection
alone, timed as the call is). A run setting, not in the case id. `budgets` (fractions of
N in (0, 1]) sets each variant that has a budget parameter (`Variant.budget_param`: top_k,
random_blocks) at each length to the value whose mean keys per query is closest to the
budget times N (`Variant.budget_params`), its other parameters as the matrix gives them;
a variant without one (sdpa, the time baseline) runs once.

A top-level `modules = ["my_attention.py", "mypkg.attention"]` names variant modules to
import first (paths relative to the TOML; harness.cli.modules): how the names in `variants`
exist, not part of what is run.

A captured input's case records the model's real shape: batch = layers x the group's
`batch` (token windows), heads and head_dim the model's; a causal model's cases are causal.

Heads and widths of their own (variants.core.contract): `kv_heads` applies to variants
whose contract groups key-value heads (softmax), `value_heads` to those that group value
heads (recurrences); each other variant takes the default. A case records kv_heads,
value_heads and value_dim only where they differ from heads and head_dim: a case at the
default keeps the id it had before the axes existed. A value that does not divide (kv_heads
3 with 8 heads), value_dim on a variant that does not declare it, and grouped heads on a
captured input other than the model's own are refused with the matrix's other errors.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

import variants
from harness.models import capture
from harness.errors import UsageError
from harness.measure import stack
from harness.measure.inputs import DISTRIBUTIONS

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
DTYPES = ("float32", "float64", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")
PASSES = ("forward", "forward_backward", "decode")

# key -> (default, kind); kind "list" keys accept a scalar and become one-element lists.
_KEYS: dict[str, tuple[object, str]] = {
    "variants": ("all", "variants"), "params": ({}, "params"),
    "seq_lens": ([1024], "list:int"), "batch": ([1], "list:int"), "heads": ([4], "list:int"),
    "head_dim": ([64], "list:int"), "dtypes": (["float32"], "list:str"),
    "devices": (["cpu"], "list:str"), "inputs": (["gaussian"], "list:str"),
    "passes": (["forward"], "list:str"), "causal": ([False], "list:bool"),
    "seed": (0, "int"), "min_run_time_s": (0.2, "float"), "min_repeats": (5, "int"),
    "rounds": (1, "int"),
    "timeout_s": (120.0, "float"), "threads": (0, "int"), "err_rows": (1024, "int"),
    "mem_limit_mib": (0, "int"), "decode_tokens": (16, "int"),
    "kv_heads": ([None], "list:int"), "value_heads": ([None], "list:int"),
    "value_dim": ([None], "list:int"), "selection": (False, "bool"),
    "budgets": ([None], "list:float"),
}
# Axes a case records only where they differ from the default: not in the id otherwise.
SHAPE_FIELDS = ("kv_heads", "value_heads", "value_dim")
# Run settings added later, left out of a normalised matrix at their default, so that a
# folder written before them resumes (its stored matrix reads as before).
LATER_SETTINGS = {"selection": False, "budgets": [None]}
_ALLOWED = {"dtypes": DTYPES, "devices": DEVICES, "inputs": DISTRIBUTIONS, "passes": PASSES}
# Keys that make a case: its id is the hash of these. Run settings (time budget, threads,
# limits) are not in it, so runs on different machines compare case by case.
KEY_FIELDS = ("variant", "params", "device", "dtype", "batch", "heads", "head_dim",
              "seq_len", "causal", "pass_", "input", "seed")


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str
    params: str  # JSON, sorted keys, every parameter with its default filled in
    device: str
    dtype: str
    batch: int
    heads: int
    head_dim: int
    seq_len: int
    causal: bool
    pass_: str
    input: str
    seed: int
    min_run_time_s: float
    min_repeats: int
    timeout_s: float
    threads: int
    err_rows: int
    mem_limit_mib: int
    capture: str = ""  # a declared captured input: JSON {"model", "text"} paths (harness.models.capture)
    rounds: int = 1  # timing rounds spread over the run (a run setting, not in the case id)
    decode_tokens: int = 16  # a decode case: tokens generated after its context of seq_len
    kv_heads: int | None = None  # grouped keys (Hk = Hv < heads); None: heads
    value_heads: int | None = None  # grouped values (Hv > heads = Hk); None: heads
    value_dim: int | None = None  # values' width (Dv != head_dim); None: head_dim
    selection: bool = False  # also measure the selection (mass, select_ms): a run setting

    @property
    def decode(self) -> bool:
        return self.pass_ == "decode"

    @property
    def case_id(self) -> str:
        key = {f: getattr(self, f) for f in KEY_FIELDS}
        if self.capture:  # a user's source is its paths, not only its name
            key["capture"] = self.capture
        if self.decode:  # what a decode case measures; other cases' ids stay as they were
            key["decode_tokens"] = self.decode_tokens
        for f in SHAPE_FIELDS:  # only where not the default: older ids stay as they were
            if getattr(self, f) is not None:
                key[f] = getattr(self, f)
        return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def param_dict(self) -> dict:
        return json.loads(self.params)

    @property
    def backward(self) -> bool:
        return self.pass_ == "forward_backward"

    def series(self) -> tuple:
        """Cases that differ only in seq_len (and input, seed): the memory guard's unit."""
        return (self.variant, self.params, self.device, self.dtype, self.batch, self.heads,
                self.head_dim, self.causal, self.pass_, self.kv_heads, self.value_heads,
                self.value_dim)

    @property
    def shape(self) -> variants.Shape:
        """Its heads and widths (variants.core.contract.Shape) at its length."""
        return variants.Shape(self.batch, self.heads, self.seq_len, self.head_dim, self.kv_heads,
                     self.value_heads, self.value_dim)

    def label(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in self.param_dict.items())
        grouped = "".join(f" {f}={getattr(self, f)}" for f in SHAPE_FIELDS
                          if getattr(self, f) is not None)
        return (f"{self.variant}({p}) N={self.seq_len}{grouped} {self.pass_} {self.input} "
                f"{self.dtype} {self.device}{' causal' if self.causal else ''}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def read_toml(source: str) -> dict:
    """The raw table of a preset name (quick, cpu, gpu) or of a .toml path."""
    path = Path(source)
    if not path.suffix and not path.exists():
        path = PRESET_DIR / f"{source}.toml"
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.toml")))
            raise UsageError(f"unknown preset {source!r}; presets: {known}, or a .toml file")
    if not path.is_file():
        raise UsageError(f"matrix file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"malformed TOML in {path}: {e}") from None


def normalise(raw: dict, overrides: dict | None = None) -> dict:
    """Check every key of a raw matrix; return {"groups": [full group, ...]}.

    All problems are collected and raised together as one UsageError ("; "-joined).
    `overrides` (from the CLI) replace keys in every group; "variants" there narrows.
    """
    errors: list[str] = []
    raw = copy.deepcopy(raw)
    captures = capture.parse_sources(raw.pop("captures", None), DISTRIBUTIONS, errors)
    inputs = DISTRIBUTIONS + tuple(capture.BUILTIN) + tuple(captures)
    baseline = raw.pop("baseline", None)
    groups_raw = raw.pop("groups", None)
    if groups_raw is not None and not (isinstance(groups_raw, list)
                                       and all(isinstance(g, dict) for g in groups_raw)):
        errors.append("'groups' must be an array of tables ([[groups]])")
        groups_raw = None
    base = _check_group(raw, "top level", errors, inputs)
    groups = []
    for i, g in enumerate(groups_raw or [{}]):
        if "groups" in g:
            errors.append(f"groups[{i}]: groups do not nest")
        merged = {**base, **_check_group(g, f"groups[{i}]", errors, inputs)}
        groups.append(merged)
    overrides = dict(overrides or {})
    narrow = overrides.pop("variants", None)
    ov = _check_group(overrides, "command line", errors, inputs)
    full, acausal = [], []  # acausal: the groups that decode non-causally
    for i, g in enumerate(groups):
        g = {**{k: d for k, (d, _) in _KEYS.items()}, **g, **ov}
        g["variants"] = _resolve_variants(g["variants"], g["params"], f"groups[{i}]", errors)
        if "decode" in g["passes"] and False in g["causal"]:
            acausal.append(i)
        full.append(g)
    for g in full:  # at the default the matrix reads as before (old folders resume)
        for f in SHAPE_FIELDS:
            if g[f] == [None]:
                del g[f]
        for f, default in LATER_SETTINGS.items():
            if g[f] == default:
                del g[f]
    if acausal:  # one message, however many groups
        where = ("command line" if {"passes", "causal"} & set(ov)
                 else f"groups[{', '.join(map(str, acausal))}]")
        errors.append(f"{where}: passes = [\"decode\"] generates tokens causally: it needs "
                      "causal = [true] (--causal true; put decode in a group of its own)")
    if baseline is not None:  # against the TOML's own groups: an override may leave it out
        baseline = _check_baseline(baseline, _as_written(groups), errors)
    if narrow is not None:
        narrow_variants(full, narrow, errors)
    if errors:  # top-level keys are checked once per group: report each problem once
        raise UsageError("; ".join(dict.fromkeys(errors)))
    for g in full:
        g.pop("params")
    return {"groups": full, **({"captures": captures} if captures else {}),
            **({"baseline": baseline} if baseline else {})}


def _as_written(groups: list[dict]) -> list[dict]:
    """The groups as the TOML writes them, with every default, variants resolved (their
    errors are reported where the groups are resolved with the overrides)."""
    out = []
    for g in groups:
        g = {**{k: d for k, (d, _) in _KEYS.items()}, **g}
        g["variants"] = _resolve_variants(g["variants"], g["params"], "", [])
        out.append(g)
    return out


def _check_baseline(table, groups: list[dict], errors: list[str]) -> dict | None:
    """The [baseline] table as stored: {"variant", "params" (its full stored JSON),
    "kv_heads", "value_heads", "value_dim" (None: the default)}; an error unless it names a
    variant setting one of the matrix's groups runs as the TOML writes them (the command
    line's overrides and --variants may leave it out of a run: its report then has no
    baseline row and says so)."""
    keys = ("variant", "params", *SHAPE_FIELDS)
    if not isinstance(table, dict) or not isinstance(table.get("variant"), str) \
            or set(table) - set(keys):
        errors.append(f"baseline: a table with variant = NAME and optionally "
                      f"{', '.join(keys[1:])}, got {table!r}")
        return None
    name, params = table["variant"], table.get("params", {})
    try:
        full = json.dumps(variants.stored_params(name, **params), sort_keys=True) \
            if isinstance(params, dict) else None
    except ValueError as e:
        errors.append(f"baseline: {e}")
        return None
    bad = [f for f in SHAPE_FIELDS if f in table and not (
        isinstance(table[f], int) and not isinstance(table[f], bool) and table[f] > 0)]
    if full is None or bad:
        errors.append(f"baseline: params must be a table and {', '.join(SHAPE_FIELDS)} "
                      f"positive ints, got {table!r}")
        return None
    if not any(full in g["variants"].get(name, []) and all(
            f not in table or table[f] in g.get(f, [None]) for f in SHAPE_FIELDS)
            for g in groups):
        errors.append(f"baseline: no group of the matrix runs {name} with params {full}"
                      + "".join(f", {f} {table[f]}" for f in SHAPE_FIELDS if f in table))
        return None
    return {"variant": name, "params": full, **{f: table.get(f) for f in SHAPE_FIELDS}}


def _check_group(table: dict, where: str, errors: list[str], inputs=DISTRIBUTIONS) -> dict:
    out = {}
    for key, value in table.items():
        if key not in _KEYS:
            top = ", captures, modules, executor" if where == "top level" else ""
            errors.append(f"{where}: unknown key {key!r}; allowed: {', '.join(_KEYS)}, "
                          f"groups{top}")
            continue
        kind = _KEYS[key][1]
        if kind.startswith("list:"):
            value = value if isinstance(value, list) else [value]
            typ = {"int": int, "str": str, "bool": bool, "float": (int, float)}[kind[5:]]
            bad = [v for v in value if not isinstance(v, typ)
                   or (typ in (int, (int, float)) and isinstance(v, bool))
                   or (kind == "list:float" and not 0 < v <= 1)]
            if bad or not value:
                what = "fractions in (0, 1]" if kind == "list:float" else kind[5:]
                errors.append(f"{where}: {key!r} must be a non-empty list of {what}, got {value!r}")
                continue
            allowed = inputs if key == "inputs" else _ALLOWED.get(key)
            wrong = [v for v in value if allowed is not None and v not in allowed]
            if wrong:
                errors.append(f"{where}: {key}: unknown {', '.join(map(repr, wrong))}; "
                              f"allowed: {', '.join(allowed)}")
                continue
            if typ is int and any(v < 1 for v in value):
                errors.append(f"{where}: {key!r} must be positive, got {value!r}")
                continue
        elif kind in ("int", "float"):
            ok = isinstance(value, (int, float) if kind == "float" else int) and not isinstance(value, bool)
            if not ok or value < 0:
                errors.append(f"{where}: {key!r} must be a non-negative {kind}, got {value!r}")
                continue
            if key in ("rounds", "decode_tokens") and value < 1:
                errors.append(f"{where}: {key!r} must be at least 1, got {value!r}")
                continue
        elif kind == "bool" and not isinstance(value, bool):
            errors.append(f"{where}: {key!r} must be true or false, got {value!r}")
            continue
        elif kind == "params" and not isinstance(value, dict):
            errors.append(f"{where}: 'params' must be a table name -> list of settings")
            continue
        out[key] = value
    return out


def narrow_variants(groups: list[dict], narrow, errors: list[str]) -> None:
    """Keep only the variants named in `narrow` (--variants) in each expanded group; a name
    that is not registered, or not in the matrix, is an error, except a variant from
    outside the package (a variant module, an entry point): it joins every group with its
    defaults, so that a preset's settings run on one's own variant; and a layer pattern,
    which joins every group with each mixer on that group's settings of it. An entry
    (name, params) (`--variants 'name(param=value)'`) keeps that variant at that setting
    (its other settings replaced) in every group that has it, or in every group when none
    has it."""
    present = {n for g in groups for n in g["variants"]}
    given: dict[str, list[str]] = {}  # name -> the settings given with it
    for item in narrow:
        if isinstance(item, str):
            continue
        n, params = item
        if stack.is_pattern(n) or n not in variants.names(private=True):
            errors.append(f"unknown variant {n!r}; registered: {', '.join(variants.names())}")
            continue
        try:
            full = json.dumps(variants.stored_params(n, **params), sort_keys=True)
        except ValueError as e:
            errors.append(str(e))
            continue
        given.setdefault(n, []).append(full)
    for n, settings in given.items():
        for g in groups:
            if n in g["variants"] or n not in present:
                g["variants"][n] = list(dict.fromkeys(settings))
    wanted = [(n if isinstance(n, str) else n[0]).strip() for n in narrow]
    wanted = [n for n in wanted if n]
    for n in wanted:
        if n in given:
            continue
        if stack.is_pattern(n):
            if n not in present:  # a stack joins every group, its mixers on its settings
                for g in groups:
                    g["variants"].update(_resolve_pattern(n, None, g.get("params", {}),
                                                          "command line", errors))
        elif n not in variants.names(private=True):
            errors.append(f"unknown variant {n!r}; registered: {', '.join(variants.names())}")
        elif n not in present and variants.origin(n).startswith("variants/"):
            errors.append(f"variant {n!r} is not in this matrix")
        elif n not in present:
            defaults = json.dumps(variants.stored_params(n), sort_keys=True)
            for g in groups:
                g["variants"][n] = [defaults]
    for g in groups:
        g["variants"] = {n: s for n, s in g["variants"].items() if n in wanted}


def _resolve_variants(spec, params: dict, where: str, errors: list[str]) -> dict:
    """{name: [full param JSON, ...]} from "all", a list of names, or a table."""
    registered = variants.names(private=True)
    if spec == "all":
        table = {n: None for n in variants.names()}
    elif isinstance(spec, list) and all(isinstance(n, str) for n in spec):
        table = {n: None for n in spec}
    elif isinstance(spec, dict):
        table = dict(spec)
    else:
        errors.append(f"{where}: 'variants' must be \"all\", a list of names or a table, got {spec!r}")
        return {}
    for n in params:
        if n not in registered:
            errors.append(f"{where}: params: unknown variant {n!r}; registered: {', '.join(registered)}")
    out = {}
    for name, settings in table.items():
        if stack.is_pattern(name):
            out.update(_resolve_pattern(name, settings, params, where, errors))
            continue
        if name not in registered:
            errors.append(f"{where}: unknown variant {name!r}; registered: {', '.join(registered)}")
            continue
        settings = params.get(name, [{}]) if settings is None else settings
        if isinstance(settings, dict):
            settings = [settings]
        if not (isinstance(settings, list) and all(isinstance(s, dict) for s in settings)):
            errors.append(f"{where}: {name}: settings must be a list of tables, got {settings!r}")
            continue
        resolved = []
        for s in settings:
            try:
                full = variants.stored_params(name, **s)
            except ValueError as e:
                errors.append(str(e))
                continue
            resolved.append(json.dumps(full, sort_keys=True))
        out[name] = list(dict.fromkeys(resolved))
    return out


def _resolve_pattern(name: str, settings, params: dict, where: str, errors: list[str]) -> dict:
    """{pattern: [JSON {mixer: full params}, ...]}: each mixer of a layer pattern takes the
    group's settings of that mixer (its `params` entry), the product over the mixers when
    several have more than one; a pattern's own table entry maps mixer -> settings."""
    try:
        mixers = stack.mixers(name)
    except ValueError as e:
        errors.append(f"{where}: {e}")
        return {}
    given = {} if settings is None else settings
    if not isinstance(given, dict) or set(given) - set(mixers):
        errors.append(f"{where}: {name}: settings must be a table of its mixers "
                      f"({', '.join(mixers)}) -> their settings, got {settings!r}")
        return {}
    per_mixer = []
    for mixer in mixers:
        resolved = _resolve_variants({mixer: given.get(mixer)}, {mixer: params[mixer]}
                                     if mixer in params else {}, where, errors).get(mixer, [])
        per_mixer.append([json.loads(r) for r in resolved])
    combos = [json.dumps(dict(zip(mixers, combo)), sort_keys=True)
              for combo in itertools.product(*per_mixer)]
    return {name: list(dict.fromkeys(combos))}


resolve_variants = _resolve_variants  # the training matrix (harness.train.matrix) takes it too


def expand(matrix: dict) -> list[Case]:
    """Every case of a normalised matrix, seq_len innermost and ascending, deduplicated.
    A grouping the matrix cannot have (`grouped`) raises UsageError, every one named."""
    cases: dict[str, Case] = {}
    errors: list[str] = []
    captures = matrix.get("captures", {})
    for g in matrix["groups"]:
        settings = [(n, p) for n, ps in g["variants"].items() for p in ps]
        axes = (settings, g["devices"], g["dtypes"], g["batch"], g["heads"], g["head_dim"],
                g.get("kv_heads", [None]), g.get("value_heads", [None]),
                g.get("value_dim", [None]), g["causal"], g["passes"], g["inputs"],
                sorted(g["seq_lens"]))
        for ((name, params), device, dtype, B, H, D, Hk, Hv, Dv, causal, pass_, dist,
             N) in itertools.product(*axes):
            src = ""
            if dist not in DISTRIBUTIONS:  # captured: the model fixes the shape (harness.models.capture)
                info = capture.model_info(capture.source_of(dist, captures)["model"])
                asked = (Hk, Hv, Dv)
                B, H, D, causal = info.layers * B, info.heads, info.head_dim, causal or info.causal
                src = json.dumps(captures[dist], sort_keys=True) if dist in captures else ""
                Hk, Hv, Dv = _captured_grouping(dist, info, asked, errors)
            Hk, Hv, Dv = grouped(name, H, D, Hk, Hv, Dv, errors)
            if (Hk, Hv, Dv) != (None, None, None) and not stack.is_pattern(name):
                # widths the setting's own parameters fix (mla's latent): bad input here
                errors += _setting(name, params).shape_reasons(
                    variants.Shape(B, H, N, D, Hk, Hv, Dv))
            for p in at_budgets(name, params, N, causal, g.get("budgets", [None])):
                c = Case(name, p, device, dtype, B, H, D, N, causal, pass_, dist, g["seed"],
                         float(g["min_run_time_s"]), g["min_repeats"], float(g["timeout_s"]),
                         g["threads"] or os.cpu_count() or 1, g["err_rows"],
                         g["mem_limit_mib"], src, g["rounds"], g["decode_tokens"], Hk, Hv, Dv,
                         g.get("selection", False))
                cases.setdefault(c.case_id, c)
    if errors:
        raise UsageError("; ".join(dict.fromkeys(errors)))
    return list(cases.values())


@functools.lru_cache(maxsize=None)
def _setting(name: str, params: str):
    """The variant of a setting (params JSON), built once for the plan's shape checks."""
    return variants.build(name, **json.loads(params))


def at_budgets(name: str, params: str, N: int, causal: bool, budgets: list) -> list[str]:
    """The stored parameters of `name` at each budget (a fraction of N: the mean keys a
    query attends to, `Variant.budget_params`), first budget first; [params] without
    budgets, for a layer pattern, or for a variant without a budget parameter."""
    if budgets == [None] or stack.is_pattern(name):
        return [params]
    base = json.loads(params)
    module = variants.build(name, **base)
    out = []
    for b in budgets:
        set_ = module.budget_params(b * N, N, causal)
        if set_ is None:
            return [params]
        out.append(json.dumps(variants.stored_params(name, **{**base, **set_}),
                              sort_keys=True))
    return list(dict.fromkeys(out))


def grouped(name: str, H: int, D: int, Hk, Hv, Dv, errors: list[str]) -> tuple:
    """(kv_heads, value_heads, value_dim) of a case of variant `name` at H heads of width D:
    each axis the variant's contract does not group is dropped (the default), a value equal
    to the default is None (the case keeps its old id); what it cannot take is an error."""
    if stack.is_pattern(name):  # a model's layers: each mixer at its own default heads
        return None, None, None
    grouping = variants.spec(name).contract.grouping
    Hk = None if Hk == H or grouping.heads != "kv" else Hk
    Hv = None if Hv == H or grouping.heads != "value" else Hv
    Dv = None if Dv == D else Dv
    if Hk is not None and H % Hk:
        errors.append(f"kv_heads {Hk} does not divide heads {H} (query head h reads key-value "
                      "head h // (heads / kv_heads))")
    if Hv is not None and Hv % H:
        errors.append(f"value_heads {Hv} is not a multiple of heads {H} (value head j reads "
                      "query-key head j // (value_heads / heads))")
    if Dv is not None and not grouping.value_dim:
        errors.append(f"value_dim {Dv}: {name} does not declare values of their own width "
                      "(its contract's grouping.value_dim)")
    return Hk, Hv, Dv


def _captured_grouping(dist: str, info, asked: tuple, errors: list[str]) -> tuple:
    """A captured input has the model's own heads: kv_heads other than the model's (its
    captured keys are repeated to its heads), value_heads or value_dim are errors."""
    Hk, Hv, Dv = asked
    if Hk not in (None, info.heads, info.kv_heads):
        errors.append(f"kv_heads {Hk} with the captured input {dist!r}: the model has "
                      f"{info.kv_heads} key-value heads of {info.heads}")
    if Hv not in (None, info.heads) or Dv not in (None, info.head_dim):
        errors.append(f"value_heads/value_dim with the captured input {dist!r}: the model's "
                      f"values are {info.heads} heads of {info.head_dim}")
    return None, None, None


def is_training(raw: dict) -> bool:
    """Whether a raw TOML table is a training matrix (harness.train.matrix), not a benchmark."""
    return bool({"task", "lrs", "d_model", "max_steps"} & set(raw))


def load(source: str, overrides: dict | None = None) -> tuple[dict, list[Case]]:
    """Read, check and expand a preset or TOML file: (normalised matrix, cases)."""
    raw = read_toml(source)
    raw.pop("executor", None)  # how to run it (harness.cluster.executors), not part of what is run
    raw.pop("modules", None)  # variant modules to import (harness.cli.modules), loaded before
    if is_training(raw):
        raise UsageError(f"{source} is a training matrix (for `attnbench train`), not a "
                         "benchmark matrix")
    matrix = normalise(raw, overrides)
    return matrix, expand(matrix)
