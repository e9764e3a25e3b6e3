"""A verifier of math answers for reward functions: find the final answer, decide whether it equals a label.

The names and signatures are those OpenRLHF's ``math_reward_func.py`` imports from ``openrlhf.utils``; such a
file runs as it is (:mod:`rlhf_agents.openrlhf_compat` serves the import), and new files write::

    from rlhf_agents import extract_boxed_answer, grade_answer

``grade_answer(given, truth)`` accepts an answer that is

- the same text once LaTeX and formatting are normalised (``\\dfrac{1}{2}``, ``\\frac12``, ``$\\frac{1}{2}$``,
  ``\\text{1/2}``; ``x = 5``; ``5 cm``; ``90^\\circ``; ``50\\%``; ``1,000``);
- the same number, exactly (``0.75``, ``3/4``, ``\\frac{3}{4}``; ``0.333`` is not ``1/3``);
- the same expression under sympy (``\\frac{\\sqrt{2}}{2}`` and ``1/\\sqrt2``, ``2x+2`` and ``2(x+1)``);
- a tuple or interval with the same brackets and equal elements in order, or a bare comma list with the
  same elements in any order (the solutions ``2, -3``).

Model output is never evaluated as Python: an expression reaches sympy only when it consists of digits,
operators, brackets, single-letter variables and ``sqrt``/``pi``, with no exponent above 99."""

from __future__ import annotations

import re
from fractions import Fraction

# words dropped after a number ("5 cm", "90 degrees", "3 sq units")
_UNITS = (
    "cm|mm|km|m|meters?|metres?|inch(?:es)?|in|feet|foot|ft|yards?|miles?|units?|sq|square|cubic|"
    "degrees?|dollars?|cents?|seconds?|minutes?|hours?|days?|weeks?|months?|years?"
)
_MAX_SYMBOLIC_LEN = 120


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, or the token
    after ``\\boxed `` in its brace-less form; None when there is none or its braces never close."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].split("{", 1)[0]
    if rest in ("\\boxed", "\\fbox"):
        depth = 0
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if text[i] == "}" and depth == 0:
                return text[text.index("{", start) + 1 : i]
        return None
    token = re.match(r"\\boxed\s+([^\s$]+)", text[start:])
    return token.group(1) if token else None


def normalize_answer(answer: str) -> str:
    """A canonical spelling of ``answer``: LaTeX wrappers, spacing, units, degrees, percent and dollar signs,
    thousands separators and a leading ``x =`` removed; fractions, roots, products and powers written as
    plain expressions (``\\frac{a}{b}`` -> ``(a)/(b)``, ``\\sqrt{x}`` -> ``sqrt(x)``, ``^`` -> ``**``)."""
    s = str(answer).strip()
    boxed = extract_boxed_answer(s)
    if boxed is not None and s.startswith(("\\boxed", "\\fbox")):
        s = boxed
    for command in ("text", "textbf", "mathrm", "mbox", "mathbf"):  # \command{x} -> x (x without braces)
        s = re.sub(r"\\" + command + r"\s*\{([^{}]*)\}", r"\1", s)
    for junk in (
        "\\left",
        "\\right",
        "\\displaystyle",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\quad",
        "\\$",
        "$",
        "\\%",
        "%",
        "^{\\circ}",
        "^\\circ",
        "\\circ",
        "°",
    ):
        s = s.replace(junk, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.strip().rstrip(".").strip()
    if s.count("=") == 1 and re.fullmatch(r"[A-Za-z]\w{0,2}", s.split("=")[0].strip()):
        s = s.split("=")[1].strip()  # "x = 5"
    s = re.sub(r"^(-?[\d.,/]+)(?:\s+(?:" + _UNITS + r")\.?)+$", r"\1", s, flags=re.IGNORECASE)
    # thousands separators: 1,000,000 (but not the list 1,2)
    s = re.sub(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,])", lambda m: m.group().replace(",", ""), s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)  # \sqrt2
    s = re.sub(r"\\sqrt\[([^\]]+)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
    while True:  # innermost first: \frac{\sqrt{2}}{2}, \frac{\frac{1}{2}}{3}
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", new)
        if new == s:
            break
        s = new
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("\\infty", "oo")
    s = s.replace("^", "**").replace("{", "(").replace("}", ")")
    return re.sub(r"\s+", "", s).lower()


def _number(s: str) -> Fraction | None:
    """An exact number from a normalised answer: ``12``, ``-3.5``, ``3/4``, ``((3)/(4))``; else None."""
    s = s.replace("(", "").replace(")", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _symbolic(s: str):
    """``s`` as a sympy expression when it is safe and small enough to parse, else None."""
    if len(s) > _MAX_SYMBOLIC_LEN or not re.fullmatch(r"[0-9a-z+\-*/().]+", s):
        return None
    if any(w not in ("sqrt", "pi", "oo") and len(w) > 1 for w in re.findall(r"[a-z]+", s)):
        return None  # only single-letter variables and known names: nothing else gets evaluated
    if re.search(r"\*\*\(?-?\d{3,}", s) or re.search(r"\*\*[^*]*\*\*", s):
        return None  # huge or stacked exponents
    from sympy.parsing import sympy_parser as sp

    try:
        transformations = (*sp.standard_transformations, sp.implicit_multiplication_application)
        return sp.parse_expr(s, transformations=transformations, evaluate=True)
    except Exception:  # not an expression after all ("1.2.3", unbalanced brackets)
        return None


def _equal(a: str, b: str) -> bool:
    """Whether two normalised single answers are the same."""
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    ea, eb = _symbolic(a), _symbolic(b)
    if ea is None or eb is None:
        return False
    import sympy

    try:
        return sympy.simplify(ea - eb) == 0
    except Exception:  # sympy gives up on some inputs (TypeError, RecursionError, ...)
        return False


def _split(s: str) -> tuple[str, list[str]]:
    """A normalised answer as (brackets, elements): ``"(1,2)"`` -> ``("()", ["1", "2"])``,
    ``"2,-3"`` -> ``("", ["2", "-3"])``, ``"5"`` -> ``("", ["5"])``."""
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and s.count(",") and not re.search(r"[()\[\]]", s[1:-1]):
        return s[0] + s[-1], s[1:-1].split(",")
    return "", s.split(",") if "," in s and not re.search(r"[()\[\]]", s) else [s]


def grade_answer(given_answer: str | None, ground_truth: str | None) -> bool:
    """Whether ``given_answer`` (already taken out of ``\\boxed{}``) equals ``ground_truth`` (see the module
    docstring for what counts as equal). None on either side is False."""
    if given_answer is None or ground_truth is None:
        return False
    given, truth = normalize_answer(given_answer), normalize_answer(ground_truth)
    if not given or not truth:
        return False
    (given_brackets, given_parts), (truth_brackets, truth_parts) = _split(given), _split(truth)
    if given_brackets != truth_brackets or len(given_parts) != len(truth_parts):
        return False
    if given_brackets or len(truth_parts) == 1:  # ordered
        return all(_equal(g, t) for g, t in zip(given_parts, truth_parts))
    left = list(given_parts)  # a bare list of solutions: any order
    for t in truth_parts:
        match = next((g for g in left if _equal(g, t)), None)
        if match is None:
            return False
        left.remove(match)
    return True
