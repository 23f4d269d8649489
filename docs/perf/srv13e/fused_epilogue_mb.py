import torch, time
torch.manual_seed(0)
from qkv.nn.linear import Linear
import torch.nn.functional as F
lin = Linear(384, 1536); dn = Linear(1536, 384)
lin.eval(); dn.eval()
with torch.no_grad():
    _, wp, b = lin._onednn_packed(None)
    _, wpd, bd = dn._onednn_packed(None)
    for rows in (64, 1024):
        x = torch.randn(rows, 384); h = torch.randn(rows, 1536); r = torch.randn(rows, 384)
        def a(): return torch.ops.aten.gelu_(torch.ops.mkldnn._linear_pointwise(x, wp, b, "none", [], ""), approximate="tanh")
        def f(): return torch.ops.mkldnn._linear_pointwise(x, wp, b, "gelu", [], "tanh")
        def a2(): return r + torch.ops.mkldnn._linear_pointwise(h, wpd, bd, "none", [], "")
        def f2(): return torch.ops.mkldnn._linear_pointwise.binary(h, r, wpd, bd, "add")
        print(rows, "gelu maxdiff", (a() - f()).abs().max().item(), "add maxdiff", (a2() - f2()).abs().max().item())
        for name, fn in (("sep", a), ("fused", f), ("sep_add", a2), ("fused_add", f2)) * 2:
            n = 200 if rows == 64 else 30
            fn(); t = time.process_time()
            for _ in range(n): fn()
            print(rows, name, f"{(time.process_time() - t) / n * 1e6:.0f} us cpu")
