"""English number words / dates -> Chinese: the converters against hand-written examples, the generated
pairs against independent parsers, length bounds, BLEU/exact-match evaluation."""

from __future__ import annotations

import datetime as dt

import pytest
import torch

from qkv.tasks import build_task
from qkv.tasks.numbers_zh import chinese_date, chinese_number, english_date, english_number

# hand-written (standard Mandarin numerals, formal 二; British English with "and")
ZH = {
    0: "零", 2: "二", 10: "十", 11: "十一", 15: "十五", 20: "二十", 99: "九十九", 100: "一百",
    101: "一百零一",
    110: "一百一十", 115: "一百一十五", 200: "二百", 342: "三百四十二", 1000: "一千", 1005: "一千零五",
    1010: "一千零一十", 1050: "一千零五十", 1500: "一千五百", 2019: "二千零一十九", 10000: "一万",
    10001: "一万零一", 10010: "一万零一十", 10100: "一万零一百", 11000: "一万一千", 20300: "二万零三百",
    100000: "十万", 110000: "十一万", 1000000: "一百万", 1234567: "一百二十三万四千五百六十七",
    10100000: "一千零一十万", 100000000: "一亿", 100000001: "一亿零一", 100010000: "一亿零一万",
    120003000: "一亿二千万三千", 100200300: "一亿零二十万零三百",
}
EN = {
    0: "zero", 7: "seven", 13: "thirteen", 40: "forty", 42: "forty-two", 90: "ninety", 100: "one hundred",
    110: "one hundred and ten", 342: "three hundred and forty-two", 1000: "one thousand",
    1005: "one thousand and five", 1500: "one thousand five hundred", 2019: "two thousand and nineteen",
    21000: "twenty-one thousand", 100001: "one hundred thousand and one",
    1234567: "one million two hundred and thirty-four thousand five hundred and sixty-seven",
    3000000000: "three billion",
}


@pytest.mark.parametrize("n,zh", sorted(ZH.items()))
def test_chinese_numbers(n, zh):
    assert chinese_number(n) == zh


@pytest.mark.parametrize("n,en", sorted(EN.items()))
def test_english_numbers(n, en):
    assert english_number(n) == en


def test_dates_and_range_errors():
    assert english_date(2021, 3, 3) == "March 3, 2021" and chinese_date(2021, 3, 3) == "2021年3月3日"
    assert english_date(1999, 12, 31) == "December 31, 1999"
    with pytest.raises(ValueError):
        chinese_number(-1)
    with pytest.raises(ValueError):
        english_number(10**12)


# -- independent parsers: the generated pairs must denote the same number / date ------------------------
_EN_UNITS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven "
                                        "twelve thirteen fourteen fifteen sixteen seventeen eighteen "
                                        "nineteen".split())}
_EN_TENS = {w: 10 * i
            for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split())}


def parse_en(text: str) -> int:
    total = cur = 0
    for w in text.replace("-", " ").split():
        if w == "and":
            continue
        if w in _EN_UNITS:
            cur += _EN_UNITS[w]
        elif w in _EN_TENS:
            cur += _EN_TENS[w]
        elif w == "hundred":
            cur *= 100
        else:
            total += cur * {"thousand": 1000, "million": 10**6, "billion": 10**9}[w]
            cur = 0
    return total + cur


def parse_zh(text: str) -> int:
    digits = {c: i for i, c in enumerate("零一二三四五六七八九")}
    small = {"十": 10, "百": 100, "千": 1000}
    total = section = num = 0
    for c in text:
        if c in digits:
            num = digits[c]
        elif c in small:
            section += (num or 1) * small[c]
            num = 0
        elif c == "万":
            total += (section + num) * 10**4
            section = num = 0
        elif c == "亿":
            total = (total + section + num) * 10**8
            section = num = 0
    return total + section + num


def test_generated_pairs_agree_with_independent_parsers():
    task = build_task("numbers_zh", max_value=10**9, date_fraction=0.3)
    n_dates = 0
    for src, tgt in task.pairs(0, 400, "train") + task.eval_pairs(100):
        if "," in src:
            n_dates += 1
            d = dt.datetime.strptime(src, "%B %d, %Y").date()  # raises on an invalid calendar date
            assert tgt == f"{d.year}年{d.month}月{d.day}日"
        else:
            assert parse_en(src) == parse_zh(tgt) <= 10**9
    assert 100 < n_dates < 200
    lengths = {len(s.split()) for s, _ in task.pairs(1, 400, "train") if "," not in s}
    assert min(lengths) == 1 and max(lengths) > 10  # short and long numbers both common


def test_round_trip_of_the_parsers_over_a_range():
    for n in list(range(0, 2000)) + list(range(99_990, 100_020)) + [10**8 + 7, 987_654_321]:
        assert parse_zh(chinese_number(n)) == n
        assert parse_en(english_number(n)) == n


def test_length_bounds_are_exact_and_batches_fit():
    task = build_task("numbers_zh", max_value=99_999, date_fraction=0.25)
    src_max = max(len(english_number(v)) for v in range(100_000))
    assert task.max_src_tokens == max(src_max, len("September 28, 2099"))
    assert (task.max_tgt_tokens
            == max(max(len(chinese_number(v)) for v in range(100_000)), len("2099年12月31日")))
    for family in ("encdec", "gpt"):
        t = build_task("numbers_zh", family=family)
        b = t.batch(0, 64)
        assert b["input_ids"].shape[1] <= t.context_length
        row = b["input_ids"][0][b["attention_mask"][0].bool()]
        assert t.tokenizer.unk_id not in row.tolist()


def test_length_bounds_are_exact_for_any_max_value():
    """The bound used to come from repeated digits (777...) and max_value only: below 300 the longest words
    are "one hundred and seventy-three" (29), not 222's or 300's, and training cut such sources short."""
    import itertools

    english = list(itertools.accumulate((len(english_number(v)) for v in range(60_001)), max))
    chinese = list(itertools.accumulate((len(chinese_number(v)) for v in range(60_001)), max))
    for limit in (0, 9, 15, 173, 299, 300, 1005, 12_345, 20_000, 54_321, 60_000):
        task = build_task("numbers_zh", max_value=limit, date_fraction=0.0)
        assert (task.max_src_tokens, task.max_tgt_tokens) == (english[limit], chinese[limit]), limit
    assert english[300] == 29 and english[20_000] == 50


class ZhOracle(torch.nn.Module):
    """Answers each held-out source with its reference (or the reference minus its last character)."""

    def __init__(self, task, drop_last: bool = False) -> None:
        super().__init__()
        self.task, self.drop_last = task, drop_last
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.answers = dict(task.eval_pairs(40))

    def generate(self, x, max_new_tokens, *, attention_mask=None, eos_token_id=None, do_sample=False):
        assert not do_sample
        tok = self.task.tokenizer
        rows = []
        for b in range(x.shape[0]):
            ans = self.answers[tok.decode(x[b].tolist())]
            rows.append(tok.encode(ans[:-1] if self.drop_last else ans) + [eos_token_id])
        out = torch.full((len(rows), max(map(len, rows))), eos_token_id)
        for b, r in enumerate(rows):
            out[b, : len(r)] = torch.tensor(r)
        return out


def test_evaluate_reports_bleu_and_exact_match():
    task = build_task("numbers_zh", family="encdec")
    res = task.evaluate(ZhOracle(task), n=40)
    assert res["exact_match"] == 1.0 and res["bleu"] == pytest.approx(100.0)
    worse = task.evaluate(ZhOracle(task, drop_last=True), n=40)
    assert worse["exact_match"] == 0.0 and 0.0 < worse["bleu"] < 100.0
