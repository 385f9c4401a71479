import sys, pickle
sys.path.insert(0, "/work/wt/tp/tests")
from labkit.dist import launch
from labkit.model import get_preset
from tp_workers import tp_checks
if __name__ == "__main__":
    runs = launch(tp_checks, 4, get_preset("tiny"), backend="gloo", timeout_s=120, join_timeout_s=600)
    def q(p): return f"{p[0]/p[1]:.2f}"
    worst = {}
    for i, r in enumerate(runs):
        for (k, v) in r["tp"].items():
            if isinstance(k, tuple):
                for key in ("logits","loss","grads","dtensor_logits","dtensor_loss"):
                    worst[key] = max(worst.get(key,0), v[key][0]/v[key][1])
        for sp, d in r["train"].items():
            for t, v in d.items():
                for key in ("losses","params"):
                    worst[f"train_{key}"] = max(worst.get(f"train_{key}",0), v[key][0]/v[key][1])
        for sp, v in r["zero1"].items():
            worst["zero1_params"] = max(worst.get("zero1_params",0), v["params"][0]/v["params"][1])
        for pr in r["stage"]:
            worst["stage"] = max(worst.get("stage",0), pr[0]/pr[1])
    print({k: round(v,2) for k,v in worst.items()})
    print(runs[0]["generation"]["margin"], runs[0]["generation"]["scale"])
    print(runs[0]["train"][True][2], runs[0]["zero1"][True])
    