"""Write gpt_adamw.tg: gpt.tg's model with AdamW instead of SGD (the gpt-adamw benchmark row).

    python benchmarks/workloads/make_gpt_adamw.py      # rewrites gpt_adamw.tg next to it

The model part is gpt.tg's, unchanged; each param gets two `state` moments (m_NAME,
v_NAME, its edges) and three `update`s in torch.optim.AdamW's order: decoupled weight
decay, the moments, the step with the bias corrections bc1 = 1 / (1 - beta1^t) and
bc2 = 1 / (1 - beta2^t) as inputs (the caller counts the steps).
"""
from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
BETA1, BETA2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 0.01   # benchmarks/ref_numpy.py ADAMW


def params(model: str) -> list[tuple[str, str]]:
    """(name, edge list) of every param, in declaration order."""
    out = []
    for line in model.splitlines():
        if not line.startswith("param "):
            continue
        decls = line.split("#")[0][len("param"):]
        for name, edges in re.findall(r"(\w+)\[([^\]]*)\]", decls):
            out.append((name, ", ".join(e.split(":")[0].strip() for e in edges.split(","))))
    return out


def generate() -> str:
    src = (HERE / "gpt.tg").read_text()
    model = src[:src.index("# One SGD step")]
    model = model.replace("one SGD training step.", "one AdamW training step.", 1)
    model = model.replace("SGD on every parameter.", "AdamW on every parameter (moments in `state`).", 1)
    model = model.replace("# gpt.tg — ", "# gpt_adamw.tg — written by make_gpt_adamw.py from gpt.tg: ", 1)
    model = re.sub(r"(?m)^(input  lr .*)$", r"\1\ninput  bc1, bc2                        # AdamW's bias corrections: "
                   r"1 / (1 - beta1^t), 1 / (1 - beta2^t)", model, count=1)
    ps = params(model)
    states = "\n".join(f"state  m_{n}[{e}], v_{n}[{e}]" for n, e in ps)
    model = model.replace("\n# Causal multi-head", f"\n# AdamW's moments of every param\n{states}\n\n# Causal multi-head", 1)
    lines = [f"# One AdamW step on every parameter (beta1 {BETA1}, beta2 {BETA2}, eps {EPS:g}, "
             f"weight decay {WEIGHT_DECAY}); all gradients at the old values."]
    for n, _ in ps:
        lines += [f"g_{n} = grad(loss, {n})",
                  f"update m_{n} = {BETA1} * m_{n} + {1 - BETA1:.12g} * g_{n}",
                  f"update v_{n} = {BETA2} * v_{n} + {1 - BETA2:.12g} * g_{n} * g_{n}",
                  f"update {n} = {n} * (1 - lr * {WEIGHT_DECAY}) - lr * ({BETA1} * m_{n} + {1 - BETA1:.12g} * g_{n}) * bc1"
                  f" / (sqrt(({BETA2} * v_{n} + {1 - BETA2:.12g} * g_{n} * g_{n}) * bc2) + {EPS:g})"]
    return model + "\n".join(lines) + "\n"


if __name__ == "__main__":
    (HERE / "gpt_adamw.tg").write_text(generate())
