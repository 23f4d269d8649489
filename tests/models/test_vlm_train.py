"""A LLaVA model trained from scratch: the config the vqa task builds (and the YAML keys over it), a falling
loss on a fixed batch, generation with an image against a hand-written greedy loop, `qkv train` + `qkv eval`
end to end on configs/vlm_fashion.yaml shrunk, and bad config values as one clear error."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from _clirun import run_cli
from qkv.config import ConfigError
from qkv.models.vlm import LLaVA
from qkv.run import build_parts, load_run_config
from qkv.tasks import build_task
from qkv.tasks.tokenizers import EOS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm_fashion.yaml"
TINY = ["model.vision.d_model=32", "model.vision.d_ff=64", "model.vision.n_layers=2", "model.text.d_model=32",
        "model.text.d_ff=64", "train.batch_size=8", "train.warmup=0", "train.log_every=1"]


def fashion_folder(root: Path, n: int = 40) -> Path:
    """Four IDX files of random 28x28 images, labels 0..9 in turn."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "t10k"):
        for kind, array in (("images-idx3", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8)),
                            ("labels-idx1", (np.arange(n) % 10).astype(np.uint8))):
            head = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            (root / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(head + array.tobytes()))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return fashion_folder(tmp_path_factory.mktemp("fashion"))


def tiny_run(data: Path, *extra: str) -> tuple:
    cfg = load_run_config(str(CONFIG), [*TINY, f"task.path={data}", *extra])
    return build_parts(cfg)[:2]


def test_the_task_sizes_a_small_llama_style_vlm(data):
    task, model = tiny_run(data)
    c = model.config
    assert isinstance(model, LLaVA)
    assert (c.vision.image_size, c.vision.n_channels, c.vision.patch_size) == (28, 1, 7)
    assert c.image_tokens == task.image_tokens == 16 and c.image_token_id == task.image_token_id
    assert c.text.vocab_size == task.tokenizer.vocab_size and c.text.context_length == task.context_length
    assert (c.text.norm, c.text.ffn, c.text.position, c.text.bias) == ("rmsnorm", "swiglu", "rope", False)
    # the command line's nested keys change one field each and keep the task's sizes
    assert (c.vision.d_model, c.text.d_model, c.vision.n_layers) == (32, 32, 2)
    assert len(model.vision.encoder.blocks) == 2 and model.projector.linear_2 is not None


def test_yaml_keys_set_the_projector_feature_layer_and_frozen_tower(data):
    _, model = tiny_run(data, "model.projector=linear", "model.feature_layer=-2", "model.freeze_vision=true")
    assert model.projector.linear_2 is None
    assert model.config.vision_blocks == 1 and len(model.vision.encoder.blocks) == 1
    assert not any(p.requires_grad for p in model.vision.parameters())
    assert all(p.requires_grad for p in [*model.projector.parameters(), *model.language_model.parameters()])


def test_a_frozen_tower_stays_put_while_the_rest_trains(data, tmp_path):
    from qkv.train import TrainConfig, Trainer

    task, model = tiny_run(data, "model.freeze_vision=true")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Trainer(model, TrainConfig(max_steps=2, batch_size=4, lr=1e-2, warmup=0, progress=False, log_every=1,
                               out_dir=str(tmp_path)), task).fit()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("vision."))
    assert not torch.equal(before["projector.linear_1.weight"], after["projector.linear_1.weight"])


def test_loss_falls_on_a_fixed_batch(data):
    task, model = tiny_run(data)
    batch = task.batch(0, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses[::8]


def test_generate_with_an_image_is_the_greedy_loop_over_forward(data):
    task, model = tiny_run(data)
    model.eval()
    ids = torch.tensor([task.prompt_ids("what is it ?"), task.prompt_ids("is it footwear ?")])
    pixels = torch.randn(2, 1, 28, 28)
    got = model.generate(ids, pixel_values=pixels, max_new_tokens=6, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(6):  # the whole sequence through forward each step, the image in it, no cache
            logits = model(seq, pixel_values=pixels).logits[:, -1].clone()
            logits[:, task.image_token_id] = -float("inf")  # the placeholder is never generated
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq)


def test_qkv_train_then_qkv_eval_end_to_end(data, tmp_path):
    out = tmp_path / "run"
    args = [*TINY, f"task.path={data}", "train.max_steps=3", "eval.n=5", "eval.samples=2", "--out", str(out)]
    r = run_cli("train", str(CONFIG), *args)
    assert r.returncode == 0, r.stderr
    assert "accuracy_what=" in r.stdout and "test image" in r.stdout
    assert (out / "run.yaml").is_file() and (out / "checkpoints").is_dir()
    r = run_cli("eval", str(out), "-n", "5")
    assert r.returncode == 0, r.stderr
    for q in ("what", "category", "yesno", "describe"):
        assert f"accuracy_{q}" in r.stdout, r.stdout
    ask = ["generate", str(out), "--prompt", "what is it ?"]
    r = run_cli(*ask)
    assert r.returncode == 2 and "qkv: error: a vqa run answers questions about an image" in r.stderr


@pytest.mark.parametrize("override, message", [
    ("model.feature_layer=5", "feature_layer 5 is not a hidden state of a 2-layer vision tower"),
    ("model.projector=conv", "projector: 'conv' is not one of"),
    ("model.vision.patch_size=4", "the model gives 49 image tokens per image, the task's prompts hold 16"),
    ("model.feature_select=full", "the model gives 17 image tokens per image"),
    ("model.freeze_vision=maybe", "freeze_vision"),
    ("task.questions=[what, colour]", "colour"),
])
def test_bad_config_values_are_one_clear_error(data, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_run(data, override)


@pytest.mark.parametrize("override", ["model.vision.patch_size=4", "model.feature_layer=-9"])
def test_on_the_command_line_a_bad_value_is_one_line_and_writes_nothing(data, tmp_path, override):
    command = ["train", str(CONFIG), *TINY, f"task.path={data}", override, "--out", str(tmp_path / "run")]
    r = run_cli(*command)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("qkv: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_text_task_cannot_build_a_llava_model():
    task = build_task("reverse", family="llava", min_len=2, max_len=3)
    with pytest.raises(ConfigError, match="trains from scratch only on an image\\+text task"):
        task.build_model({"family": "llava"})


def test_answers_end_with_eos_and_fit_the_generation_budget(data):
    task, _ = tiny_run(data)
    assert task.answer_ids("yes")[-1] == EOS
    assert task.max_answer == len("it is an ankle boot worn on the feet".split()) + 1  # the longest + <eos>


def test_a_mapping_for_a_nested_config_changes_only_the_keys_it_names():
    from qkv.models.registry import config_for

    _, preset = config_for("clip-digits")
    _, c = config_for("clip-digits", vision={"n_layers": 5})
    assert c.vision.n_layers == 5 and c.vision.image_size == preset.vision.image_size == 8
    assert c.vision.head == preset.vision.head and c.vision.d_model == preset.vision.d_model
    _, c = config_for({"family": "llava"}, **{"vision.image_size": 28, "vision": {"patch_size": 7}})
    assert (c.vision.image_size, c.vision.patch_size, c.vision.n_channels) == (28, 7, 3)
    with pytest.raises(ConfigError, match="unknown key 'd_modle'"):
        config_for("clip-digits", vision={"d_modle": 5})
