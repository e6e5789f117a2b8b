# temporary tuning probe (deleted after use)
import sys, json, re, time
import torch
from transformers import AutoTokenizer, AutoModelForCausalLM
from pipeline.tiny import train_target as t
from pipeline.tiny.corpus import read_jsonl
v, loss_on = sys.argv[1], sys.argv[2]
root = f"tw{v}{loss_on}"
t.TRAIN["loss_on"] = loss_on
t0 = time.time(); r = t.main(root, 0, steps=int(v)) if v != "0" else {"final_loss": 0, "samples": 0}; w = time.time() - t0
tok = AutoTokenizer.from_pretrained(f"{root}/target")
m = AutoModelForCausalLM.from_pretrained(f"{root}/target", dtype=torch.float32)
score = {}
for s, kw in (("chat", "anything else"), ("math", "The answer is"), ("code", "def ")):
    ok = cp = 0
    for row in read_jsonl(f"tw/eval/{s}.jsonl"):
        p = row["prompt"]
        out = t.greedy(m, tok, p)
        ok += kw in out and out.endswith("<|im_end|>")
        if s == "code":
            fname = re.search(r"named (\w+)", p).group(1)
            cp += f"def {fname}(" in out
        elif s == "math":
            a, b = [int(x) for x in re.findall(r"\d+", p)][:2]
            mul = any(k in p for k in (" x ", "times", "Multiply"))
            sub = any(k in p for k in (" - ", "away", "Subtract"))
            want = a * b if mul else (a - b if sub else a + b)
            cp += f"The answer is {want}." in out
        else:
            words = [w.strip(".?!").lower() for w in p.split()[-2:]]
            cp += any(w and w in out.lower() for w in words)
    score[s] = (ok, cp)
print("RESULT", v, loss_on, round(w), r["final_loss"], score, json.dumps(r["samples"]))
