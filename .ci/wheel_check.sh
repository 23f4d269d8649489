#!/bin/sh
# Build the wheel, install it (core dependencies only) into a fresh venv in a temporary folder outside the
# checkout, and run shipped commands there: the configs must come from the package, not from the repository.
# usage: .ci/wheel_check.sh [TORCH_SPEC]    (make wheel-check)
set -eu
torch_spec=${1:-torch==2.13.0}
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$repo/.venv/bin/pip" wheel -q --no-deps -w "$tmp/dist" "$repo"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$torch_spec"
"$tmp/venv/bin/pip" install -q "$tmp"/dist/qkv-*.whl
cd "$tmp"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
venv/bin/python -c "import qkv; assert '$repo' not in qkv.__file__, qkv.__file__; print('qkv from', qkv.__file__)"
venv/bin/qkv train reverse --max-steps 2 --out "$tmp/reverse" --no-progress eval.n=8
venv/bin/qkv eval "$tmp/reverse" -n 8
venv/bin/qkv generate "$tmp/reverse" --prompt 0123 --greedy
venv/bin/qkv attention "$tmp/reverse" --input 0123 --out "$tmp/attn.png"
venv/bin/qkv explore "$tmp/reverse" --input 0123 --export "$tmp/page.html"
test -s "$tmp/page.html"
venv/bin/qkv info gpt-tiny > /dev/null
venv/bin/qkv presets > /dev/null
venv/bin/qkv ablate 01_sqrt_dk --quick --out "$tmp/ablate"
test -s "$tmp/ablate/summary.md"
venv/bin/qkv demo --quick --out "$tmp/demo"
# a BERT-family folder made without transformers (qkv's exporter + a tokenizers word-level tokenizer.json):
# qkv finetune (classify) and qkv embed on it
venv/bin/python - "$tmp/enc" <<'PY'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from qkv.interop.bert import export_bert
from qkv.models.bert import BERT, BERTConfig
words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "good", "bad", "a", "b", "c"]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
export_bert(BERT(BERTConfig(vocab_size=len(words), n_layers=1, d_model=32, n_heads=2, context_length=16)), sys.argv[1])
tok.save(sys.argv[1] + "/tokenizer.json")
open(sys.argv[1] + "/train.csv", "w").write("text,label\n" + "".join(f"a {w} b,{w}\nc {w},{w}\n" for w in ("good", "bad")))
PY
venv/bin/qkv finetune "$tmp/enc" --task classify --data "$tmp/enc/train.csv" --dev "$tmp/enc/train.csv" --out "$tmp/clf" --no-progress train.max_steps=2
test -s "$tmp/clf/confusion.png"
cut -d, -f1 "$tmp/enc/train.csv" | tail -n +2 > "$tmp/texts.txt"
venv/bin/qkv embed "$tmp/clf" --input "$tmp/texts.txt" --out "$tmp/emb.npy" --no-progress
venv/bin/qkv embed "$tmp/clf" --input "$tmp/texts.txt" --query "a good b" --top-k 2 --no-progress
# qkv serve from the wheel: a 2-step char LM, one completion over HTTP, SIGTERM -> exit 0
venv/bin/qkv train charlm --max-steps 2 --out "$tmp/lm" --no-progress eval.n=8
venv/bin/qkv serve "$tmp/lm" --port 0 --name lm > "$tmp/serve.txt" 2>&1 &
serve_pid=$!
venv/bin/python - "$tmp/serve.txt" <<'PY'
import json, sys, time, urllib.request
for _ in range(1200):
    text = open(sys.argv[1]).read()
    if "http://" in text:
        break
    time.sleep(0.1)
base = text.split(" at ")[1].split()[0]
body = json.dumps({"model": "lm", "prompt": "The ", "max_tokens": 4}).encode()
req = urllib.request.Request(base + "/completions", data=body, headers={"content-type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
assert out["usage"]["completion_tokens"] >= 1, out
page = urllib.request.urlopen(base.removesuffix("/v1") + "/", timeout=60).read().decode()  # the chat page
assert "/v1/chat/completions" in page, page[:200]
PY
kill -TERM "$serve_pid"
wait "$serve_pid"
# qkv export: the run as a Hugging Face folder with its char tokenizer as tokenizer.json
venv/bin/qkv export "$tmp/lm" "$tmp/lm-hf"
test -s "$tmp/lm-hf/config.json" && test -s "$tmp/lm-hf/model.safetensors" && test -s "$tmp/lm-hf/tokenizer.json"
# an extra that is not installed is one clear line, exit 2
set +e
venv/bin/qkv train numbers_zh --max-steps 1 --out "$tmp/zh" 2> "$tmp/err.txt"
code=$?
set -e
test "$code" -eq 2 && grep -q "pip install 'qkv\[text\]'" "$tmp/err.txt"
# qkv speedrun's profiles are package data: a misspelt one is one line naming the shipped ones
set +e
venv/bin/qkv speedrun --profile quikc --out "$tmp/sr" 2> "$tmp/err.txt"
code=$?
set -e
test "$code" -eq 2 && grep -q "quick" "$tmp/err.txt" && test ! -e "$tmp/sr"
echo "wheel check: ok"
