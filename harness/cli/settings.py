"""Variant settings as the command line writes them: 'a,b(k=1, c=x)', for `model`, `maps`
and `run --variants`."""

from __future__ import annotations

from harness.errors import UsageError


def _value(text: str):
    """A parameter value: true/false, an int, a float, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            pass
    return text.strip().strip("'\"")


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def split_setting(item: str) -> tuple[str, dict | None]:
    """'b(k=1, c=x)' -> ("b", {"k": 1, "c": "x"}); 'a' -> ("a", None). Not checked."""
    name, _, rest = item.partition("(")
    if not rest:
        return name.strip(), None
    if not rest.endswith(")"):
        raise UsageError(f"--variants: {item!r} must look like name(key=value, ...)")
    params = {}
    for pair in _split_top(rest[:-1]):
        key, eq, val = pair.partition("=")
        if not eq:
            raise UsageError(f"--variants: {pair!r} in {item!r} is not key=value")
        params[key.strip()] = _value(val)
    return name.strip(), params


def split_variants(text: str) -> list[str]:
    """The comma-separated items of a --variants value, commas inside parentheses kept."""
    return _split_top(text)
