"""The registry: the one list of variants. `build`, `names`, `spec`, `origin`, `@register`."""

from __future__ import annotations

import contextlib
import dataclasses
import typing

from .contract import Contract, ContractError
from .decoder import Decoder
from .interface import Variant

_REGISTRY: dict[str, type[Variant]] = {}
# Where each variant was registered from (`origin`); `loading` sets it for a module that
# modules.py imports (a file, a module named on the command line, an entry point).
_ORIGIN: dict[str, str] = {}
_LOADING: list[tuple[str, list[str]]] = []  # (origin, names registered meanwhile), innermost last


class DuplicateName(ValueError):
    """A variant name that is already registered."""


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str
    default: object
    doc: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """What `variants.spec(name)` tells about a variant: its name, family, paper, summary,
    parameters and origin, and its declared `contract` (`contract.py`); the other fields
    read the contract."""
    name: str
    family: str
    paper: str
    summary: str
    params: tuple[ParamSpec, ...]
    contract: Contract
    origin: str = ""  # where it was registered from (`origin`)

    @property
    def defaults(self) -> dict:
        return {p.name: p.default for p in self.params}

    exact = property(lambda self: self.contract.exact)
    pattern_exact = property(lambda self: self.contract.pattern_exact)
    supports_causal = property(lambda self: self.contract.supports_causal)
    causal_only = property(lambda self: self.contract.causal_only)
    supports_backward = property(lambda self: self.contract.backward)
    inputs = property(lambda self: self.contract.inputs)
    err_ref = property(lambda self: self.contract.err_ref)
    reference_ceiling = property(lambda self: self.contract.reference_ceiling)
    grouping = property(lambda self: self.contract.grouping)
    output_layer = property(lambda self: self.contract.output_layer)


# Class-level flags of the interface before `contract`: a class that still sets one
# is refused (it would be read by nobody).
LEGACY_FLAGS = ("exact", "supports_causal", "causal_only", "supports_backward", "compiles",
                "prepare_calls", "reference_ceiling", "err_ref", "inputs", "per_head_schedule",
                "output_layer", "non_causal_why", "floor")


def declaration_faults(cls: type[Variant]) -> list[str]:
    """What a class declares in its contract and cannot honour (or declares outside it):
    one line each; empty when the declaration holds. Registration refuses the first."""
    c = cls.contract
    who = cls.__qualname__
    if not isinstance(c, Contract):
        return [f"{who}.contract must be a Contract, got {type(c).__name__}"]
    faults = []
    for k in LEGACY_FLAGS:
        owner = next((b for b in cls.__mro__ if k in vars(b)), None)
        if owner is not None and owner not in (Variant, Decoder):
            faults.append(f"{who} sets {k!r} in class {owner.__qualname__}: declare it in its "
                          "contract (variants/core/contract.py)")
    own = lambda m: getattr(cls, m) is not getattr(Variant, m)  # noqa: E731
    if c.exactness == "pattern" and not own("key_mask"):
        faults.append(f"{who} declares exactness 'pattern' but has no key_mask to say the pattern")
    if c.exactness == "own" and not own("reference"):
        faults.append(f"{who} declares exactness 'own' but has no float64 reference method")
    if c.decoding and not (own("decode_prefill") and own("decode_step")):
        faults.append(f"{who} declares decoding but has no decode_prefill and decode_step")
    if c.decoding and c.exactness == "own" and not own("reference_from"):
        faults.append(f"{who} declares decoding, measured against its own form, but has no "
                      "reference_from to check its generated tokens by")
    if c.extend and not own("decode_extend"):
        faults.append(f"{who} declares extend but has no decode_extend")
    if c.weights and not own("attention_weights"):
        faults.append(f"{who} declares weights but has no attention_weights")
    return faults


def register(cls: type[Variant]) -> type[Variant]:
    """Class decorator adding a variant to the registry; refuses duplicate names and a
    contract the class cannot honour (`declaration_faults`), with one line."""
    for attr in ("name", "family"):
        if not isinstance(getattr(cls, attr, None), str):
            raise TypeError(f"{cls.__qualname__} must set a string class attribute {attr!r}")
    if cls.name in _REGISTRY:
        raise DuplicateName(f"variant {cls.name!r} is already registered "
                            f"by {_REGISTRY[cls.name].__module__} ({_ORIGIN[cls.name]})")
    if not (dataclasses.is_dataclass(cls.Params) and cls.Params.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__qualname__}.Params must be a frozen dataclass")
    faults = declaration_faults(cls)
    if faults:
        raise ContractError(f"variant {cls.name!r}: {faults[0]}")
    _REGISTRY[cls.name] = cls
    _ORIGIN[cls.name] = _LOADING[-1][0] if _LOADING else _default_origin(cls)
    if _LOADING:
        _LOADING[-1][1].append(cls.name)
    return cls


def _default_origin(cls: type[Variant]) -> str:
    """`variants/<family>` for the package's own variants, else `module <name>`."""
    parts = cls.__module__.split(".")
    if parts[0] == "variants" and len(parts) > 1:
        return f"variants/{parts[1]}"
    return f"module {cls.__module__}"


@contextlib.contextmanager
def loading(origin: str):
    """Variants registered inside this block get `origin`; yields the list of their names.
    If the block raises, they are unregistered again (a module that failed half-way)."""
    names: list[str] = []
    _LOADING.append((origin, names))
    try:
        yield names
    except BaseException:
        for n in names:
            _REGISTRY.pop(n, None)
            _ORIGIN.pop(n, None)
        raise
    finally:
        _LOADING.pop()


def origin(name: str) -> str:
    """Where a registered variant comes from: `variants/<family>` (this package), `module
    <path or name>` (a variant module), or `entry point <name> = <module> (<package>)`."""
    _cls(name)
    return _ORIGIN[name]


def names(private: bool = False) -> list[str]:
    """Every registered variant name, in registration order.

    Names starting with "_" are private (test fixtures such as deliberately failing
    variants), and floors (`floor`: `none`, the trained comparisons' mixer that mixes
    nothing) are no benchmark variant: listed only with private=True, but `build` and
    `spec` take them.
    """
    return [n for n in _REGISTRY if private or not (
        n.startswith("_") or _REGISTRY[n].contract.floor)]


def _cls(name: str) -> type[Variant]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def _param_specs(cls: type[Variant]) -> tuple[ParamSpec, ...]:
    hints = typing.get_type_hints(cls.Params)
    out = []
    for f in dataclasses.fields(cls.Params):
        t = hints[f.name]
        m = f.metadata
        out.append(ParamSpec(f.name, getattr(t, "__name__", str(t)), f.default, m.get("doc", ""),
                             m.get("choices"), m.get("min"), m.get("max")))
    return tuple(out)


def spec(name: str) -> VariantSpec:
    """Family, parameters with defaults, paper and declared contract of a registered variant."""
    cls = _cls(name)
    doc = (cls.__doc__ or "").strip().splitlines()
    return VariantSpec(cls.name, cls.family, cls.paper, doc[0] if doc else "",
                       _param_specs(cls), cls.contract, _ORIGIN[name])


def _check_value(variant: str, p: ParamSpec, value):
    """Return value coerced to p's type, or raise ValueError naming what is allowed."""
    where = f"{variant}: parameter {p.name!r}"
    if p.type == "bool":
        ok = isinstance(value, bool)
    elif p.type == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif p.type == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif p.type == "str":
        ok = isinstance(value, str)
    else:  # Optional or other annotations: accept None or the default's type
        ok = value is None or p.default is None or isinstance(value, type(p.default))
    if not ok:
        raise ValueError(f"{where} must be of type {p.type}, got {value!r}")
    if p.choices is not None and value not in p.choices:
        raise ValueError(f"{where} must be one of {list(p.choices)}, got {value!r}")
    if p.min is not None and value is not None and value < p.min:
        raise ValueError(f"{where} must be >= {p.min}, got {value!r}")
    if p.max is not None and value is not None and value > p.max:
        raise ValueError(f"{where} must be <= {p.max}, got {value!r}")
    return value


def make_params(name: str, **params):
    """The validated, frozen parameter dataclass of a variant."""
    cls = _cls(name)
    specs = {p.name: p for p in _param_specs(cls)}
    unknown = sorted(set(params) - set(specs))
    if unknown:
        allowed = ", ".join(specs) if specs else "none"
        raise ValueError(f"{name}: unknown parameter(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {allowed}")
    checked = {k: _check_value(name, specs[k], v) for k, v in params.items()}
    try:
        return cls.Params(**checked)
    except ValueError as e:  # cross-field checks in __post_init__
        raise ValueError(f"{name}: {e}") from None


def stored_params(name: str, **params) -> dict:
    """A setting's full parameters as results store them (the `params` column, the ids):
    make_params' fields, those declared `later` (param(later=True)) left out at their
    default, which is what a setting stored before them ran."""
    made = make_params(name, **params)
    out = dataclasses.asdict(made)
    for f in dataclasses.fields(made):
        if f.metadata.get("later") and out[f.name] == f.default:
            del out[f.name]
    return out


def build(name: str, **params) -> Variant:
    """A built variant module; unknown names or invalid parameters raise ValueError."""
    return _cls(name)(make_params(name, **params))
