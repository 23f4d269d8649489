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
PY
kill -TERM "$serve_pid"
wait "$serve_pid"
# an extra that is not installed is one clear line, exit 2
set +e
venv/bin/qkv train numbers_zh --max-steps 1 --out "$tmp/zh" 2> "$tmp/err.txt"
code=$?
set -e
test "$code" -eq 2 && grep -q "pip install 'qkv\[text\]'" "$tmp/err.txt"
echo "wheel check: ok"
