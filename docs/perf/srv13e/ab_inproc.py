"""In one process: Engine.run() on the issue load with Stack.step's last_only honoured (new) or forced off (the
previous behaviour: every prefill token through the top block), alternating, ROUNDS rounds; CPU s of run() and of
its prefill forwards."""
import os, sys, time, statistics
sys.argv = [sys.argv[0], "src", "none"]  # run from the repository root
exec(open(str(__import__("pathlib").Path(__file__).with_name("prof.py"))).read().split("mode = ")[0])
dec = m.decoder
orig = type(dec).step
mode = {"last": True}
pre = [0.0]
def step(self, x, **kw):
    kw["last_only"] = kw.get("last_only", False) and mode["last"]
    t = time.process_time()
    out = orig(self, x, **kw)
    if x.shape[1] > 1:
        pre[0] += time.process_time() - t
    return out
type(dec).step = step
res = {"full": [], "last": []}
outs = {}
for r in range(int(os.environ.get("ROUNDS", "4"))):
    for name in (("full", "last") if r % 2 == 0 else ("last", "full")):
        mode["last"] = name == "last"
        e = Engine(m, max_batch_size=64)
        rids = [e.add_request(p, n) for p, n in zip(prompts, news)]
        pre[0] = 0.0
        c, t = time.process_time(), time.perf_counter()
        o = e.run()
        res[name].append((time.process_time() - c, time.perf_counter() - t, pre[0], os.getloadavg()[0]))
        outs.setdefault(name, [o[i] for i in rids])
        print(r, name, [round(v, 2) for v in res[name][-1]], flush=True)
for name, rs in res.items():
    print(name, "median cpu %.2f wall %.2f prefill cpu %.2f" % tuple(statistics.median(x[i] for x in rs) for i in range(3)))
f, l = (statistics.median(x[0] for x in res[k]) for k in ("full", "last"))
fp, lp = (statistics.median(x[2] for x in res[k]) for k in ("full", "last"))
print(f"last vs full: run() cpu {f / l:.3f}x, prefill forwards cpu {fp / lp:.3f}x; same tokens {outs['full'] == outs['last']}")
