"""The `maps` command of attnbench: the attention-map grid of a chosen head, into a file.

    attnbench maps [--input minilm|local|gaussian|sharp|retrieval] [--layer L] [--head H]
                   [--seq-len N] [--variants 'sliding_window(window=64),performer']
                   [--causal] [--output FILE.png]

Every argument is checked before anything is computed (one line on stderr, exit 2). The
maps are computed by harness.measure.maps (saved beside the PNG as FILE.npz) and drawn by
harness.report.maps, as the report draws a run's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.errors import UsageError


def add_maps_args(p: argparse.ArgumentParser) -> None:
    from harness.measure import maps

    p.add_argument("--input", default="minilm",
                   help="minilm (q, k, v captured from all-MiniLM-L6-v2 on the shipped text) "
                        "or a synthetic distribution: local, gaussian, sharp, retrieval")
    p.add_argument("--layer", default=str(maps.LAYER),
                   help=f"model layer of a captured input (default {maps.LAYER})")
    p.add_argument("--head", default=str(maps.HEAD), help=f"attention head (default {maps.HEAD})")
    p.add_argument("--seq-len", dest="seq_len", default=str(maps.SEQ_LEN),
                   help=f"sequence length N (default {maps.SEQ_LEN}; at most 512 for minilm)")
    p.add_argument("--variants", default=None,
                   help="comma-separated settings, e.g. 'sliding_window(window=64),performer' "
                        "(default: the quick preset's approximate variants)")
    p.add_argument("--causal", nargs="?", const="true", default="false", metavar="BOOL",
                   help="causal maps (j <= i): --causal or --causal true, as `run` takes it "
                        "(default false)")
    p.add_argument("--head-dim", dest="head_dim", default="64",
                   help="head dimension D of a synthetic input (default 64)")
    p.add_argument("--output", default=None, type=Path,
                   help="the PNG to write (default results/maps/<input>-layer<L>-head<H>-N<N>.png)")


def _int(text: str, flag: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--{flag}: expected an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise UsageError(f"--{flag}: expected an integer >= {low}{upper}, got {text!r}")
    return value


def _cases(args, specs, N: int, D: int):
    """The cases (one per setting) that say what to draw: harness.measure.maps reads its
    head and variants from cases, as it does after a run."""
    from harness.measure import matrix as mx

    settings: dict[str, list[dict]] = {}
    for name, params in specs:
        settings.setdefault(name, []).append(params)
    raw = {"variants": settings, "inputs": [args.input], "seq_lens": [N],
           "causal": [bool(args.causal)], "batch": 1, "heads": 1, "head_dim": D,
           "passes": ["forward"]}
    return mx.expand(mx.normalise(raw))


def maps_command(args) -> int:
    import variants
    from harness.cli.model import parse_variants
    from harness.measure import maps
    from harness.measure.inputs import DISTRIBUTIONS
    from harness.models import capture
    from harness.report import maps as draw

    if args.input not in DISTRIBUTIONS + tuple(capture.BUILTIN):
        raise UsageError(f"--input: expected one of {', '.join(capture.BUILTIN)}, "
                         f"{', '.join(DISTRIBUTIONS)}; got {args.input!r}")
    if str(args.causal).lower() not in ("true", "false"):
        raise UsageError(f"--causal: expected true or false, got {args.causal!r}")
    args.causal = str(args.causal).lower() == "true"
    N = _int(args.seq_len, "seq-len", 1, variants.WEIGHTS_MAX_N)
    layer, head = _int(args.layer, "layer", 0), _int(args.head, "head", 0)
    D = _int(args.head_dim, "head-dim", 1)
    specs = parse_variants(args.variants)
    cases = _cases(args, specs, N, D)
    if capture.is_captured(cases[0]):
        info = capture.model_info(capture.case_source(cases[0])["model"])
        if info.max_positions is not None and N > info.max_positions:
            raise UsageError(f"--seq-len: {args.input} takes at most {info.max_positions} "
                             f"tokens, got {N}")
        if layer >= info.layers or head >= info.heads:
            raise UsageError(f"--layer/--head: {args.input} has layers 0..{info.layers - 1} "
                             f"and heads 0..{info.heads - 1}; got layer {layer}, head {head}")
        capture.prepare(cases[:1])
    elif head != 0:
        raise UsageError(f"--head: a synthetic input is one head (0), got {head}")
    out = args.output or Path("results") / "maps" / (
        f"{args.input}-layer{layer}-head{head}-N{N}{'-causal' if args.causal else ''}.png")
    if out.suffix != ".png":
        raise UsageError(f"--output must name a .png file, got {str(out)!r}")
    (q, k, v), about = maps.head_inputs(cases, layer, head, N)
    exact, records, arrays = maps.compute(q, k, v, about["causal"], maps.settings_of(cases))
    saved = maps.save(out.with_suffix(".npz"), exact, records, arrays, about)
    png = draw.draw(*draw.load(saved), out)
    for rec in records:
        if rec["status"] != "ok":
            print(f"no map for {rec['label']}: {rec['reason']}")
    print(f"maps: {png} (data: {saved})")
    return 0
