"""The kit's plumbing: a property's result, the inputs it draws, whether a case runs, and
the lines `attnbench check` prints.

A property is a function `(name) -> Result`: it builds the variant with its defaults,
asks it first whether it can run the case (`unsupported_reasons`) and, where it cannot,
checks that `forward` refuses with that reason instead of computing something else.
"""

from __future__ import annotations

import dataclasses

import torch

import variants

N_GENERIC = 300  # above every default budget (landmarks, projection rank, windows)
# Reasons that name something this machine lacks (a package, a device, a compiler): the
# only ones that make a property `skip`. Any other declared reason (non-causal only, no
# backward on CPU) is the variant's documented behaviour: checked as a refusal, `n/a`.
MACHINE_LACKS = ("not installed", "CUDA is not available", "C++ compiler", "needs Triton")
STATUSES = ("pass", "fail", "n/a", "skip")


def lacks(reasons: list[str]) -> bool:
    """Whether a declared reason names something this machine lacks (MACHINE_LACKS)."""
    return any(w in r for r in reasons for w in MACHINE_LACKS)


@dataclasses.dataclass(frozen=True)
class Result:
    """One property of one variant: pass, fail, n/a (declared not to apply) or skip (this
    machine lacks what it needs), with the numbers or the reason."""
    variant: str
    prop: str
    status: str
    detail: str

    def line(self, width: int = 0) -> str:
        return f"{self.status.upper():4s}  {self.variant:{width}s}  {self.prop:14s} {self.detail}"


class Refused(Exception):
    """A case the variant declares it cannot run (and forward refused as declared)."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.lacks = lacks(reasons)


class NotApplicable(Exception):
    """A property that does not apply to this variant (it declares no decoding form, no
    weights, no exactness)."""


class Failed(AssertionError):
    """A property that does not hold: the message says what, with the numbers."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise Failed(message)


def qkv(B=3, H=3, N=N_GENERIC, D=16, dtype=torch.float32, seed=0,
        requires_grad=False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype)
            .requires_grad_(requires_grad) for _ in range(3)]


def extra(m, q) -> dict:
    """The inputs beyond q, k, v the variant declares, drawn as the benchmark draws them."""
    B, H, N, D = q.shape
    return m.draw_inputs(B, H, N, D, seed=0, dtype=q.dtype, device=q.device)


def require(m, q, causal=False, backward=False) -> None:
    """Return when the variant can run the case; else check that forward refuses it with
    the declared reason (Failed when it does not) and raise Refused."""
    reasons = m.unsupported_reasons(device=q.device, dtype=q.dtype, causal=causal,
                                    seq_len=q.shape[-2], head_dim=q.shape[-1],
                                    backward=backward)
    if not reasons:
        return
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    try:
        m(q.detach().requires_grad_(backward), k, v, causal=causal)
    except ValueError as e:
        expect(reasons[0] in str(e), f"forward refused with {str(e)!r}, not the declared "
                                     f"reason {reasons[0]!r}")
        raise Refused(reasons) from None
    raise Failed(f"declares {reasons[0]!r} but forward ran the case")


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    """||o - ref|| / ||ref||; the absolute ||o - ref|| where ref is all zeros (the `none`
    floor's output), so that zero against zero is 0, not 0 / 0."""
    diff, norm = (o.double() - ref.double()).norm(), ref.double().norm()
    return float(diff / norm) if norm > 0 else float(diff)


def run_property(fn, name: str, *args) -> Result:
    """`fn(name, *args)`, one property of one variant, as a Result; an exception the
    property did not expect is a failure with its message (the kit never stops at one
    variant's bug)."""
    prop = fn.__name__
    try:
        detail = fn(name, *args)
    except Refused as r:
        return Result(name, prop, "skip" if r.lacks else "n/a", f"declared: {r}")
    except NotApplicable as e:
        return Result(name, prop, "n/a", str(e))
    except Failed as e:
        return Result(name, prop, "fail", str(e))
    except Exception as e:  # the variant raised: that is the finding
        return Result(name, prop, "fail", f"raised {type(e).__name__}: {e}".splitlines()[0])
    return Result(name, prop, "pass", detail)


def report(results: list[Result]) -> tuple[str, int]:
    """The lines `attnbench check` prints and its exit status (1 when a property fails)."""
    width = max((len(r.variant) for r in results), default=0)
    lines = [r.line(width) for r in results]
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    variants_n = len({r.variant for r in results})
    lines.append(f"{variants_n} variant(s), {len(results)} properties: "
                 + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines), 1 if counts["fail"] else 0


__all__ = ["Failed", "N_GENERIC", "NotApplicable", "Refused", "Result", "expect",
           "extra", "qkv", "rel_err", "report", "require", "run_property"]
