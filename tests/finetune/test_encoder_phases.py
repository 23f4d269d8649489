"""The encoder recipes' named phases (qkv.finetune.phases): run one by one they give what `qkv finetune`
gives, setting up writes nothing, and report() is exactly what the command prints."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from _encoders import make_folder, sentiment_rows, write_csv  # noqa: E402

from qkv.cli.main import main  # noqa: E402
from qkv.finetune.classify import ClassifyRecipe, ClassifySettings  # noqa: E402


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("bert"), "bert")


def _args(model, data, dev, out) -> ClassifySettings:
    return ClassifySettings(model=str(model), data=str(data), dev=str(dev), out=str(out), progress=False,
                            train={"max_steps": 3, "tensorboard": False, "plot": False})


def test_classify_phases_one_by_one_and_the_printed_report(bert, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(24, 1))
    dev = write_csv(tmp_path / "dev.csv", sentiment_rows(8, 2))
    recipe = ClassifyRecipe(_args(bert, train, dev, tmp_path / "a"))
    assert recipe.setup_model().model_type == "bert"
    data = recipe.setup_data()
    assert len(data) == 24 and recipe.n_labels == 2 and len(recipe.dev) == 8
    assert not (tmp_path / "a").exists()  # setting up writes nothing
    assert recipe.train()["steps"] == 3
    result = recipe.save()
    saved = json.loads((tmp_path / "a" / "finetune.json").read_text(encoding="utf-8"))
    assert saved == json.loads(json.dumps(result)) and "report" not in saved
    lines = recipe.report()

    rc = main(["finetune", str(bert), "--task", "classify", "--data", str(train), "--dev", str(dev), "--out",
               str(tmp_path / "b"), "--no-progress", "train.max_steps=3", "train.tensorboard=false",
               "train.plot=false"])
    assert rc == 0
    printed = capsys.readouterr().out
    # one seed, one run: the command's report is the phases' lines, but for the output folder it names
    want = "\n".join(lines).replace(str(tmp_path / "a"), str(tmp_path / "b"))
    assert printed.endswith(want + "\n")
    again = json.loads((tmp_path / "b" / "finetune.json").read_text(encoding="utf-8"))
    assert again["dev"] == saved["dev"] and again["confusion"] == saved["confusion"]
