import json, torch
from model.checkpoint import init_weights
from model.config import preset
from model.reference import ReferenceModel
from model.transformer import Transformer
import sys
if len(sys.argv)>1: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction=False
print(torch.__version__, torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32)
def build(dev):
    m = Transformer(preset("tiny-68m")); init_weights(m.named_parameters(), seed=0); return m.to(dev)
tokens = json.load(open("tests/data/tiny-68m-seed0.prompts.json"))["A"][:int(sys.argv[2]) if len(sys.argv)>2 else 8]
caps = []
for dev in ("cpu", "cuda"):
    m = build(dev); order = []; cap = {}
    def mk(name):
        def hook(mod, inp, out):
            o = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(o):
                key = name if name not in cap else name + "#" + str(sum(k.startswith(name) for k in cap))
                cap[key] = o.detach().float().cpu(); order.append(key)
        return hook
    for n, mod in m.named_modules():
        if n: mod.register_forward_hook(mk(n))
    c2 = {}
    lg = ReferenceModel(m).forward(tokens, capture=lambda l, n, t: c2.__setitem__(f"{l}.{n}", t.float().cpu())).cpu()
    caps.append((cap, order, c2, lg))
(a, order, ca2, la), (b, _, cb2, lb) = caps
print("logit diff per pos", (la - lb).abs().amax(-1).tolist())
n = 0
if len(sys.argv)>3: order=[]
for k in order:
    if k in b and a[k].shape == b[k].shape:
        d = (a[k] - b[k]).abs().max().item()
        rel = d / max(a[k].abs().max().item(), 1e-30)
        if d > 0:
            print(f"{k:45s} maxabs {d:.3e} rel {rel:.3e} shape {tuple(a[k].shape)}"); n += 1
            if n > 60: break
for k in (ca2 if len(sys.argv)<=3 else []):
    d = (ca2[k] - cb2[k]).abs().max().item() if ca2[k].shape == cb2[k].shape else "shape"
    print("cap", k, d)
