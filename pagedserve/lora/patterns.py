"""The regular expressions an adapter's config may hold (target_modules as one string, the keys of
rank_pattern and alpha_pattern), matched as PEFT matches them, with the matcher's work bounded.

Python's `re` backtracks: `(.*)*x` against one module name would hold the matching thread, and
with it its process's GIL (every other thread of the API process), for hours. A pattern is
accepted only if it is at most MAX_PATTERN_CHARS long, has at most MAX_REPEATS repeats (`*`, `+`,
`{m,n}`), none of which repeats a part that itself repeats or alternates, and no backreference:
then a match against a name of n characters takes at most about n ** MAX_REPEATS steps. The
patterns PEFT's users write (module names, `.*\\.(q|v)_proj`, `layers\\.\\d+\\.mlp\\..*`) all are.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from re import _parser as _sre  # Python 3.11+
except ImportError:  # Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

MAX_PATTERN_CHARS = 1000
MAX_REPEATS = 3
_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def pattern_problem(pattern: str, suffix: bool) -> str | None:
    """Why `pattern` cannot be matched safely (or is not a regular expression), or None.
    `suffix`: it is matched as rank_pattern's keys are, in PEFT's `(.*\\.)?(pattern)$`, which must
    compile too (a global flag such as `(?i)` then fails there, as it does in PEFT)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"is {len(pattern):,} characters long, above the bound of {MAX_PATTERN_CHARS:,}"
    try:
        re.compile(rf"(.*\.)?({pattern})$" if suffix else pattern)
        parsed = _sre.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return f"is not a valid regular expression: {e}"
    repeats = [0]
    problem = _shape_problem(parsed, False, repeats)
    if problem is None and repeats[0] > MAX_REPEATS:
        problem = f"it has {repeats[0]} repeats"
    if problem is None:
        return None
    return (f"is a regular expression too costly to match safely ({problem}): at most {MAX_REPEATS} repeats "
            "(*, +, {m,n}), none of a part that repeats or alternates, and no backreference; name the modules "
            "plainly or with simpler patterns")


def suffix_matcher(pattern: str) -> re.Pattern:
    """`pattern` compiled for suffix_matches (after pattern_problem accepted it)."""
    return re.compile(pattern)


def suffix_matches(matcher: re.Pattern, name: str) -> bool:
    """PEFT's re.match(rf"(.*\\.)?({pattern})$", name): the pattern matches the whole of a suffix of
    the name that is all of it or starts after a dot. Tried at each such start (a few per name)
    rather than through the `.*` that would add a repeat; the same without backreferences, which
    pattern_problem refuses (a `^` or a lookbehind sees the whole name either way)."""
    starts = [0, *(i + 1 for i, c in enumerate(name) if c == ".")]
    return any(matcher.fullmatch(name, start) for start in starts)


def _shape_problem(items: Any, repeated: bool, repeats: list[int]) -> str | None:
    """What in the parsed pattern `items` makes matching it costly (`repeated`: it is inside a
    repeat), counting its repeats into repeats[0]."""
    for op, av in items:
        name = str(op)
        bodies: list[Any] = []
        if name in _REPEATS:
            low, high, body = av
            if high > 1:
                if repeated:
                    return "it repeats a part that repeats"
                repeats[0] += 1
                problem = _shape_problem(body, True, repeats)
                if problem is not None:
                    return problem
                continue
            bodies = [body]  # `?`, `{0,1}`: at most once, no backtracking of its own to speak of
        elif name == "BRANCH":
            if repeated:
                return "it repeats an alternation"
            bodies = list(av[1])
        elif name in ("GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE", "GROUPREF_UNI_IGNORE"):
            return "it has a backreference"
        elif name == "SUBPATTERN":
            bodies = [av[-1]]
        elif name in ("ASSERT", "ASSERT_NOT"):
            bodies = [av[1]]
        elif name == "ATOMIC_GROUP":
            bodies = [av]
        for body in bodies:
            problem = _shape_problem(body, repeated, repeats)
            if problem is not None:
                return problem
    return None
