"""The vqa task: its questions and answers against a table written here from Fashion-MNIST's class list, the
batches' rows and loss mask, the scoring of evaluate() with stand-in models whose answers are known, the
option checks, and (when Debian's dataset-fashion-mnist is installed) the real data's split."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.config import ConfigError
from qkv.tasks import build_task
from qkv.tasks import vqa as V
from qkv.tasks.images import FASHION_APT, FASHION_CLASSES, FASHION_DIR

sys.path.insert(0, str(Path(__file__).parent))
from _fashion_idx import fashion_folder, label_of  # noqa: E402

from qkv.tasks.tokenizers import BOS, EOS, PAD, SEP

# Fashion-MNIST's ten classes (images.FASHION_CLASSES, the dataset's documented order), written out by hand:
# (answer to "what is it ?", category)
TABLE = {"T-shirt/top": ("t-shirt", "clothing"), "Trouser": ("trouser", "clothing"),
         "Pullover": ("pullover", "clothing"), "Dress": ("dress", "clothing"), "Coat": ("coat", "clothing"),
         "Sandal": ("sandal", "footwear"), "Shirt": ("shirt", "clothing"), "Sneaker": ("sneaker", "footwear"),
         "Bag": ("bag", "bag"), "Ankle boot": ("ankle boot", "footwear")}
DESCRIBE = {0: "it is a t-shirt worn on the body", 5: "it is a sandal worn on the feet",
            8: "it is a bag carried by hand", 9: "it is an ankle boot worn on the feet"}





def expected_answer(label: int, question: str) -> str:
    name, category = TABLE[FASHION_CLASSES[label]]
    if question == "what is it ?":
        return name
    if question == "which category is it ?":
        return category
    if question == "describe it .":
        where = "feet" if category == "footwear" else "body"
        return DESCRIBE.get(label) or f"it is a {name} worn on the {where}"
    asked = {"is it clothing ?": "clothing", "is it footwear ?": "footwear", "is it a bag ?": "bag"}[question]
    return "yes" if asked == category else "no"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_task("vqa", path=str(fashion_folder(tmp_path_factory.mktemp("fashion"))))


def test_questions_and_answers_follow_the_labels():
    for label in range(10):
        for qtype in V.QUESTION_TYPES:
            for asked in V.CATEGORIES:
                q, a = V.question_answer(label, qtype, asked)
                assert a == expected_answer(label, q), (label, qtype, asked)
    # "an" before a vowel
    assert V.question_answer(9, "describe")[1] == "it is an ankle boot worn on the feet"


def test_yes_and_no_are_equally_likely_for_every_class():
    rng = V.rng_for(0, "train", 0, "test")
    for label in (0, 5, 8):
        said = Counter(V.question_answer(label, "yesno", V.asked_category(label, rng))[1]
                       for _ in range(4000))
        assert abs(said["yes"] / 4000 - 0.5) < 0.03, (label, said)


def test_batch_rows_ask_about_their_own_image_and_mask_all_but_the_answer(task):
    b = task.batch(3, 40)
    ids, labels = b["input_ids"], b["labels"]
    assert b["pixel_values"].shape == (40, 1, 28, 28) and ids.shape == labels.shape
    types = Counter()
    for row, lab, px in zip(ids.tolist(), labels.tolist(), b["pixel_values"]):
        n = task.image_tokens
        assert row[0] == BOS and row[1:1 + n] == [task.image_token_id] * n
        sep = row.index(SEP)
        eos = row.index(EOS)
        question = task.tokenizer.decode(row[1 + n:sep])
        answer = task.tokenizer.decode(row[sep + 1:eos])
        assert answer == expected_answer(label_of(task, px), question)
        types[question.split()[0]] += 1
        # the loss mask: exactly the answer's tokens and the <eos> after them, each its own id
        scored = [t for t, y in enumerate(lab) if y != -100]
        assert scored == list(range(sep + 1, eos + 1))
        assert all(lab[t] == row[t] for t in scored) and set(row[eos + 1:]) <= {PAD}
    assert len(types) >= 3  # the question types are mixed in a batch


def test_the_loss_is_the_mean_cross_entropy_over_the_answer_tokens(task):
    model = task.build_model({"family": "llava"})
    b = task.batch(0, 6)
    out = model(**b)
    logits = out.logits[:, :-1]
    target = b["input_ids"][:, 1:]
    answer = b["labels"][:, 1:] != -100
    manual = F.cross_entropy(logits[answer].double(), target[answer])
    assert torch.allclose(out.loss.double(), manual, atol=1e-5) and int(out.n_targets) == int(answer.sum())


class StandIn(torch.nn.Module):
    """A 'model' whose answers are known: the oracle reads the class from the image's brightness
    (independently of the task), "no" answers no to everything."""

    def __init__(self, task, oracle: bool) -> None:
        super().__init__()
        self.task, self.oracle, self.w = task, oracle, torch.nn.Parameter(torch.zeros(1))

    def generate(self, ids, pixel_values, max_new_tokens, eos_token_id, **kw):
        assert ids.shape[0] == pixel_values.shape[0] and (ids == self.task.image_token_id).sum(1).eq(16).all()
        rows = []
        for row, px in zip(ids.tolist(), pixel_values):
            question = self.task.tokenizer.decode(row[17:row.index(SEP)])
            said = expected_answer(label_of(self.task, px), question) if self.oracle else "no"
            rows.append(row + (self.task.tokenizer.encode(said) + [eos_token_id] + [0] * 9)[:max_new_tokens])
        return torch.tensor(rows)


def test_evaluate_scores_exact_answers_per_question_type(task):
    perfect = task.evaluate(StandIn(task, oracle=True), n=30)
    assert perfect["n"] == 120 and all(perfect[f"accuracy_{q}"] == 1.0 for q in V.QUESTION_TYPES)
    assert perfect["accuracy"] == 1.0
    no = task.evaluate(StandIn(task, oracle=False), n=30)
    answers = [a for _, q, _, a in task.eval_examples(30) if q == "yesno"]
    assert no["accuracy_yesno"] == pytest.approx(answers.count("no") / 30) and 0 < no["accuracy_yesno"] < 1
    assert no["accuracy_what"] == no["accuracy_category"] == no["accuracy_describe"] == 0.0
    assert no["accuracy"] == pytest.approx(answers.count("no") / 120)
    lines = task.samples(StandIn(task, oracle=True), 4)
    assert len(lines) == 4 and all(line.endswith("(ok)") for line in lines)


def test_a_subset_of_question_types(tmp_path):
    t = build_task("vqa", path=str(fashion_folder(tmp_path)), questions=["yesno"])
    rows = t.batch(0, 20)["input_ids"].tolist()
    assert {t.tokenizer.decode(r[17:r.index(SEP)]).split()[0] for r in rows} == {"is"}
    assert set(t.evaluate(StandIn(t, oracle=True), n=5)) == {"accuracy", "accuracy_yesno", "n"}


@pytest.mark.parametrize("options, message", [
    ({"questions": ["colour"]}, "task.questions: \\['colour'\\]"),
    ({"questions": []}, "give one or more"),
    ({"patch_size": 5}, "patch_size \\(5\\) must divide the image size \\(28\\)"),
    ({"patch_size": 0}, "task.patch_size must be at least 1, got 0"),
    ({"pad": -1}, "task.pad must be at least 0, got -1"),
    ({"path": "/nonexistent/fashion"}, "no Fashion-MNIST data at /nonexistent/fashion"),
])
def test_bad_options_are_one_clear_error(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        build_task("vqa", **{"path": str(fashion_folder(tmp_path)), **options})


def test_a_text_only_family_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs a vision-language model family \\(llava\\), not 'gpt'"):
        build_task("vqa", family="gpt", path=str(fashion_folder(tmp_path)))


def test_the_saved_tokenizer_rebuilds_the_same_task(task, tmp_path):
    from qkv.tasks import load_task

    task.save(tmp_path)
    again = load_task(tmp_path)
    assert again.tokenizer.itos == task.tokenizer.itos and again.image_token_id == task.image_token_id
    assert torch.equal(again.batch(2, 8)["input_ids"], task.batch(2, 8)["input_ids"])


@pytest.mark.skipif(not Path(FASHION_DIR).is_dir(), reason=f"Fashion-MNIST is not installed ({FASHION_APT})")
def test_on_debians_fashion_mnist_the_held_out_images_are_the_test_split():
    t = build_task("vqa")
    assert len(t.data.train_idx) == 60_000 and len(t.data.val_idx) == 10_000
    assert t.data.val_idx.min() == 60_000  # the official test images, after the 60,000 training ones
    val = t.batch(0, 64, "val")
    assert val["input_ids"].shape[0] == 64 and t.context_length >= val["input_ids"].shape[1]
    counts = Counter(int(t.data.labels[i]) for i in t.data.val_idx.tolist())
    assert set(counts.values()) == {1000}  # the test split's 1,000 images per class
