"""Extract the headline fields of a free-text invoice: pure and deterministic, so the
worker wrapping it can retry freely and report progress one field group at a time."""

import re
from datetime import date
from decimal import ROUND_HALF_UP, Decimal, localcontext

FIELD_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("identity", ("number", "date")),
    ("amounts", ("total", "currency")),
    ("parties", ("seller",)),
)

# "Invoice ..." labels beat a bare "No.", which may label a phone or order. The
# lookahead wants a digit so "Invoice Number: pending" gives None, not "pending"; within
# the number's first 40 characters, so that it reads no further than a number could be
# (unbounded, a 200 KB payload of "no.no.no..." read the rest of it at every "no.":
# quadratic, longer than the agent's time limit).
_NUMBER_PATTERNS = tuple(
    re.compile(label + r"[ \t]*[:#]?[ \t]*(?P<value>(?=[\w/.-]{0,40}\d)[A-Z0-9][\w/.-]*)", re.I)
    for label in (r"\binvoice[ \t]*(?:no\b\.?|number\b|#)", r"\bno\.")
)

_MONTH_NAMES = ("january", "february", "march", "april", "may", "june", "july",
                "august", "september", "october", "november", "december")  # fmt: skip
_MONTH_NUMBERS = {name[:3]: number for number, name in enumerate(_MONTH_NAMES, start=1)}
# A month is its full name or three-letter abbreviation ("Mar", "March").
_MONTHS = "|".join(f"{name[:3]}(?:{name[3:]})?" for name in _MONTH_NAMES)
_MON = rf"\b(?P<m>{_MONTHS})\b\.?,?[ \t]+"
_DAY, _YEAR = r"(?<!\d)(?P<d>\d{1,2})(?:st|nd|rd|th)?", r"(?P<y>\d{4})(?!\d)"
# Slashed dates are read day first, as on most non-US invoices.
_DATE_PATTERNS = tuple(
    re.compile(pattern, re.I)
    for pattern in (
        r"(?<!\d)(?P<y>\d{4})-(?P<m>\d{1,2})-(?P<d>\d{1,2})(?!\d)",
        r"(?<!\d)(?P<d>\d{1,2})/(?P<m>\d{1,2})/(?P<y>\d{4})(?!\d)",
        _MON + _DAY + r",?[ \t]+" + _YEAR,
        _DAY + r"[ \t]+" + _MON + _YEAR,
    )
)

# The lookbehinds reject "Subtotal"/"Sub-total"/"Sub total". Only a bracketed note (of at
# most 80 characters: "total(total(..." read the rest of its line at every "total"), a
# colon and a currency may sit between label and amount, so "Total Qty: 5" is no total.
_TOTAL = re.compile(
    r"(?<![a-z])(?<!sub[ -])(?P<label>grand[ \t]+total|amount[ \t]+due"
    r"|total(?:[ \t]+(?:due|amount))?)\b[ \t]*(?:\([^)\n]{0,80}\))?[ \t]*[:-]?[ \t]*"
    r"(?:[A-Z]{3}|[$€£¥￥])?[ \t]*(?P<amount>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)",
    re.I,
)

# Codes are matched case-sensitively and without \b so "CNY1,024" still counts
# while ordinary words such as "Eur" in a street name do not.
_CODE = re.compile(r"(?<![A-Z])(CNY|RMB|USD|EUR|GBP|JPY|HKD|AUD|CAD|CHF|SGD|INR|KRW)(?![A-Z])")
_CODE_ALIASES = {"RMB": "CNY"}
_SYMBOLS = {"$": "USD", "€": "EUR", "£": "GBP", "¥": "CNY", "￥": "CNY"}

_SELLER = re.compile(r"^(?:seller|from|vendor)[ \t]*:[ \t]*(?P<value>\S.*)$", re.I)
_HEADING = re.compile(r"^(?:(?:tax|commercial|pro ?forma)\s+)?(?:invoice|receipt|bill)$", re.I)
_LABELLED = re.compile(r"^[^:]{1,40}:")


def _number(lines: list[str]) -> str | None:
    for pattern in _NUMBER_PATTERNS:
        for line in lines:
            if match := pattern.search(line):
                return match["value"].rstrip("./-")
    return None


def _date(lines: list[str]) -> str | None:
    # A "Date" line (not "Due Date") holds the issue date; else the first date anywhere.
    labelled = [ln for ln in lines if "date" in ln.lower() and "due" not in ln.lower()]
    for line in labelled + lines:
        if matches := [m for p in _DATE_PATTERNS if (m := p.search(line))]:
            return _iso_date(min(matches, key=lambda m: m.start()))
    return None


def _iso_date(found: re.Match[str]) -> str | None:
    month = found["m"]
    number = int(month) if month.isdigit() else _MONTH_NUMBERS[month[:3].lower()]
    try:
        return date(int(found["y"]), number, int(found["d"])).isoformat()
    except ValueError:
        # An impossible date (2024-02-30) is a misprint; guessing another date
        # from the text, such as a due date, would be worse than None.
        return None


def _total_match(lines: list[str]) -> re.Match[str] | None:
    # Grand Total / Amount Due outrank a plain Total, which may be a section
    # sum. Among equals the last wins because invoices summarise downwards.
    matches = [m for line in lines if (m := _TOTAL.search(line))]
    return min(reversed(matches), key=lambda m: m["label"].lower() == "total", default=None)


def _total(lines: list[str]) -> str | None:
    if (match := _total_match(lines)) is None:
        return None
    amount = Decimal(match["amount"].replace(",", ""))
    # Cents of an amount of any length (the default context's 28 digits raised
    # InvalidOperation for a total of 29).
    with localcontext(prec=len(match["amount"]) + 3):
        return str(amount.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def _currency(lines: list[str]) -> str | None:
    # The total's own line is the most specific evidence; then the whole text.
    total = _total_match(lines)
    scopes = ([total.string] if total else []) + ["\n".join(lines)]
    for scope in scopes:
        if code := _CODE.search(scope):
            return _CODE_ALIASES.get(code[1], code[1])
        if symbol := next((s for s in scope if s in _SYMBOLS), None):
            # "¥" is shared by yuan and yen; yen only when the text says JPY.
            is_yen = symbol in "¥￥" and any("JPY" in line for line in lines)
            return "JPY" if is_yen else _SYMBOLS[symbol]
    return None


def _seller(lines: list[str]) -> str | None:
    for line in lines:
        if match := _SELLER.match(line):
            return match["value"]
    # Else the letterhead: the first line after any "INVOICE" heading. If that is a
    # field, there is no letterhead, and a later line may as well be the buyer.
    for line in lines:
        if not line or _HEADING.match(re.sub(r"[^A-Za-z ]", "", line).strip()):
            continue
        is_field = _LABELLED.match(line) or _NUMBER_PATTERNS[1].search(line)
        return None if is_field else line
    return None


_EXTRACTORS = {
    "number": _number,
    "date": _date,
    "total": _total,
    "currency": _currency,
    "seller": _seller,
}


def parse_group(text: str, fields: tuple[str, ...]) -> dict[str, str | None]:
    """Parse only ``fields`` from ``text``; unknown field names raise ValueError."""
    if unknown := [field for field in fields if field not in _EXTRACTORS]:
        raise ValueError(f"unknown invoice fields: {', '.join(unknown)}")
    lines = [line.strip() for line in text.splitlines()]
    return {field: _EXTRACTORS[field](lines) for field in fields}


def parse_invoice(text: str) -> dict[str, str | None]:
    """Parse number, date, total, currency and seller; missing fields are None."""
    # Built from the groups so the whole and the per-group progress never diverge.
    return {k: v for _, fields in FIELD_GROUPS for k, v in parse_group(text, fields).items()}
