"""Interleaved A/B of Engine.run() on benchmarks/serve.py's issue load: each round runs each tree in its own fresh
process (PYTHONPATH=tree), in turn; CPU seconds and wall of run() alone; medians; same tokens."""
import json, os, statistics, subprocess, sys
trees = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
rounds = int(os.environ.get("ROUNDS", "3"))
res = {k: [] for k in trees}
for r in range(rounds):
    for name, src in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
        out = subprocess.run([sys.executable, str(__import__("pathlib").Path(__file__).with_name("prof.py")), src, "time", "1"], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}).stdout
        assert f"qkv {src}/qkv/__init__.py" in out, out[:300]
        line = [l for l in out.splitlines() if l.startswith("wall")][0].split()
        dig = [l for l in out.splitlines() if l.startswith("digest")][0].split()[1]
        load = os.getloadavg()[0]
        res[name].append(dict(wall=float(line[1]), cpu=float(line[3]), tok_s=float(line[5]), digest=dig, load=load))
        print(r, name, res[name][-1], flush=True)
base = list(trees)[0]
for name, rs in res.items():
    w = statistics.median(x["wall"] for x in rs); c = statistics.median(x["cpu"] for x in rs)
    bw = statistics.median(x["wall"] for x in res[base]); bc = statistics.median(x["cpu"] for x in res[base])
    print(f"{name}: median wall {w:.2f} s, cpu {c:.2f} s, tok/s {8496 / w:.1f}; vs {base}: wall {bw / w:.3f}x cpu {bc / c:.3f}x")
print("same tokens:", len({x["digest"] for rs in res.values() for x in rs}) == 1)
json.dump(res, open(os.environ.get("OUT", "ab_trees.json"), "w"), indent=1)
