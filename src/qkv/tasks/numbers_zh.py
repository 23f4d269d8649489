"""English number words and dates -> Chinese: a small real-language translation task, generated locally.

    "three hundred and forty-two"  -> "三百四十二"
    "one thousand and five"        -> "一千零五"
    "March 3, 2021"                -> "2021年3月3日"

English: British style, "and" after "hundred" when tens/units follow ("one hundred and ten") and before
a final group below 100 ("one thousand and five"), hyphenated tens ("forty-two"), short scale (thousand,
million, billion).
Chinese: standard numerals with 万/亿 grouping every 4 digits. 零 rules: one 零 for any run of zeros
between non-zero digits inside a 4-digit group (1005 -> 一千零五, 1050 -> 一千零五十); one 零 before a
group that is non-zero but below 1000 when a higher group precedes it (10001 -> 一万零一), or after an
all-zero group (100000001 -> 一亿零一); nothing for trailing zeros (1500 -> 一千五百). A leading 一十 is
written 十 (10 -> 十, 15 -> 十五, 100000 -> 十万) but kept inside a number (110 -> 一百一十). 2 is 二
everywhere (the formal 二百/二千, not the colloquial 两百/两千).
Dates: "<Month> <day>, <year>" -> "<year>年<month>月<day>日" with Arabic digits, valid calendar dates.

Examples: with probability date_fraction a date (years year_min..year_max), otherwise a number with a
uniformly drawn digit count 1..len(str(max_value)) (then uniform below max_value), so short and long
numbers are equally common. One character vocabulary shared by both sides. Split: hash of the English
source (see seq2seq.py). Metrics: exact match and BLEU (sacrebleu, tokenize='zh').
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from typing import Any

from qkv.config import setting
from qkv.tasks.base import Task, register_task
from qkv.tasks.options import check_options
from qkv.tasks.seq2seq import SyntheticTask
from qkv.tasks.tokenizers import CharTokenizer, Tokenizer

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
        "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
SCALES = [(10**9, "billion"), (10**6, "million"), (1000, "thousand")]
# spelled out, not calendar.month_name (which follows the process locale)
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

ZH_DIGITS = "零一二三四五六七八九"
ZH_GROUP_UNITS = ["", "万", "亿", "万亿"]  # 10^0, 10^4, 10^8, 10^12
MAX_NUMBER = 10**12 - 1  # the largest number both converters handle


def _below_100(n: int) -> str:
    if n < 20:
        return ONES[n]
    return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")


def _below_1000(n: int) -> str:
    h, r = divmod(n, 100)
    if not h:
        return _below_100(r)
    return f"{ONES[h]} hundred" + (f" and {_below_100(r)}" if r else "")


def english_number(n: int) -> str:
    """0 <= n <= 999,999,999,999 in British English words."""
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"english_number handles 0..{MAX_NUMBER}, got {n}")
    if n == 0:
        return "zero"
    parts = []
    rest = n
    for value, name in SCALES:
        q, rest = divmod(rest, value)
        if q:
            parts.append(f"{_below_1000(q)} {name}")
    if rest:
        # British "and" before a final part below 100 that follows a larger scale ("one thousand and five")
        parts.append(("and " if parts and rest < 100 else "") + _below_1000(rest))
    return " ".join(parts)


def _zh_group(n: int) -> str:
    """0 < n < 10000 -> Chinese, one 零 per inner run of zeros, none for trailing zeros."""
    out, pending_zero = "", False
    for value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d = n // value % 10
        if d == 0:
            pending_zero = pending_zero or bool(out)
        else:
            if pending_zero:
                out += "零"
                pending_zero = False
            out += ZH_DIGITS[d] + unit
    return out


def chinese_number(n: int) -> str:
    """0 <= n <= 999,999,999,999 in Chinese numerals (rules in the module docstring)."""
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"chinese_number handles 0..{MAX_NUMBER}, got {n}")
    if n == 0:
        return "零"
    groups = []
    while n:
        n, g = divmod(n, 10000)
        groups.append(g)
    out, zero_gap = "", False
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        if g == 0:
            zero_gap = zero_gap or bool(out)
            continue
        if out and (zero_gap or g < 1000):
            out += "零"
        out += _zh_group(g) + ZH_GROUP_UNITS[i]
        zero_gap = False
    return out[1:] if out.startswith("一十") else out


def _groups(n: int, base: int) -> list[int]:
    """n's digits in `base`, most significant first."""
    out = []
    while True:
        n, g = divmod(n, base)
        out.append(g)
        if not n:
            return out[::-1]


def _longest(limit: int, base: int, part_len: Any) -> int:
    """max over 0 < n <= limit of sum(part_len(i, g, state)) over n's groups g in `base` (i: the group's index
    from the lowest), by dynamic programming over the groups, most significant first. A state is (tight: the
    groups so far equal limit's, state): part_len returns (length added, next state); the first state is None.
    The longest form is not the one of any simple pattern (777 is not below 300, but 173 beats 222), so every
    group value is tried: at most 1000 or 10000 values a group, a few groups."""
    digits = _groups(limit, base)
    best: dict[tuple[bool, Any], int] = {(True, None): 0}
    for k, top in enumerate(digits):
        i = len(digits) - 1 - k
        nxt: dict[tuple[bool, Any], int] = {}
        for (tight, state), total in best.items():
            for g in range(top + 1 if tight else base):
                add, new = part_len(i, g, state)
                key = (tight and g == top, new)
                if nxt.get(key, -1) < total + add:
                    nxt[key] = total + add
        best = nxt
    return max(best.values())


def longest_english(limit: int) -> int:
    """max(len(english_number(n)) for n in range(limit + 1)), without enumerating the range."""
    below = [len(_below_1000(g)) for g in range(1000)]
    # group i from the lowest: "", thousand, million, ...
    names = [""] + [name for _, name in reversed(SCALES)]

    def part_len(i: int, g: int, parts: int | None) -> tuple[int, int]:
        parts = parts or 0  # the words so far ("" joined by spaces: a space before every part but the first)
        if not g:
            return 0, parts
        if i:
            return below[g] + 1 + len(names[i]) + (1 if parts else 0), parts + 1
        return below[g] + (4 if parts and g < 100 else 0) + (1 if parts else 0), parts + 1  # "and "

    return max(len("zero"), _longest(limit, 1000, part_len))


def longest_chinese(limit: int) -> int:
    """max(len(chinese_number(n)) for n in range(limit + 1)), without enumerating the range."""
    group = [len(_zh_group(g)) if g else 0 for g in range(10000)]

    def part_len(i: int, g: int, state: tuple[bool, bool] | None) -> tuple[int, tuple[bool, bool]]:
        started, zero_gap = state or (False, False)  # chinese_number's `out` non-empty, and its zero_gap
        if not g:
            return 0, (started, zero_gap or started)
        n = group[g] + len(ZH_GROUP_UNITS[i])
        if started and (zero_gap or g < 1000):
            n += 1  # 零
        if not started and 10 <= g < 20:
            n -= 1  # a leading 一十 is written 十
        return n, (True, False)

    return max(len("零"), _longest(limit, 10000, part_len))


def english_date(year: int, month: int, day: int) -> str:
    return f"{MONTHS[month - 1]} {day}, {year}"


def chinese_date(year: int, month: int, day: int) -> str:
    return f"{year}年{month}月{day}日"


def _all_chars() -> str:
    """Every character either side can contain (a fixed vocabulary: no need to scan samples)."""
    eng = set(" ,-0123456789") | set("".join(ONES + TENS + MONTHS + [s for _, s in SCALES]
                                             + ["hundred", "and"]))
    zh = set(ZH_DIGITS + "十百千" + "".join(ZH_GROUP_UNITS) + "年月日0123456789")
    return "".join(sorted(eng | zh))


@dataclass
class NumbersZhOptions:
    max_value: int = setting(99_999, "largest number (numbers are 0..max_value)", ge=0, le=MAX_NUMBER)
    date_fraction: float = setting(0.25, "share of examples that are dates", ge=0, le=1)
    year_min: int = setting(1900, "earliest year of a date", ge=1)
    year_max: int = setting(2099, "latest year of a date", le=9999)
    seed: int = setting(0, "seeds the train/val batch streams and the evaluation set")
    val_fraction: float = setting(0.1, "share of the example space (by source hash) held out", gt=0, lt=1)

    def validate(self) -> None:
        check_options(self, ("year_min", "year_max"))


class NumbersZhTask(SyntheticTask):
    bleu_tokenize = "zh"

    def token_symbols(self) -> str:
        return _all_chars()

    def max_lengths(self) -> tuple[int, int]:
        """Exact bounds: the longest English and Chinese forms of any number in 0..max_value
        (longest_english / longest_chinese), and the longest date."""
        o = self.options
        src = longest_english(o.max_value) if o.date_fraction < 1 else 0
        tgt = longest_chinese(o.max_value) if o.date_fraction < 1 else 0
        if o.date_fraction > 0:
            src = max(src, max(len(english_date(o.year_max, m, 28)) for m in range(1, 13)))
            tgt = max(tgt, len(chinese_date(o.year_max, 12, 31)))
        return src, tgt

    def example(self, rng: Any) -> tuple[str, str]:
        o = self.options
        if rng.random() < o.date_fraction:
            y = rng.randint(o.year_min, o.year_max)
            m = rng.randint(1, 12)
            d = rng.randint(1, calendar.monthrange(y, m)[1])
            return english_date(y, m, d), chinese_date(y, m, d)
        k = rng.randint(1, len(str(o.max_value)))
        lo = 0 if k == 1 else 10 ** (k - 1)
        v = rng.randint(lo, min(o.max_value, 10**k - 1))
        return english_number(v), chinese_number(v)


def _factory(options: NumbersZhOptions, family: str, tokenizer: Tokenizer | None = None) -> Task:
    return NumbersZhTask(options, family, tokenizer or CharTokenizer(_all_chars()))


register_task("numbers_zh", NumbersZhOptions, _factory, ("seq2seq", "decoder"),
              "English number words / dates -> Chinese (BLEU + exact match)", default_family="encdec",
              requires=("sacrebleu",))
