"""Which layers lose recall (issue 34): the source with a conversion's attention in one group of layers only.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.recall_layers [--model out/passkey/transmla-50-shared]

Dev recall items (retrieval_ladder.DEV_RECALL: 60 items, seed 1, 1K tokens of prose); each row swaps the
converted model's attention modules into the source for one group of GROUP layers (the rest stay the
source's; a mixed model keeps each layer's own cache in a DynamicCache), then scores the items
(choice_tasks.score_items: accuracy and nll, the -log share of the true city). "all" is the conversion
itself. Writes benchmarks/results/recall_layers_smollm2.{json,md} with the CPU and load.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from .common import RESULTS, log, machine
from .retrieval_ladder import DEV_RECALL

GROUP = 5
STEM = "recall_layers_smollm2"


def measure(model_dir: str) -> dict:
    import torch

    from transmla.checkpoint.resolve import load_model
    from transmla.eval.choice_tasks import ChoiceSettings, recall_items, score_items

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    src, tok = load_model("smollm2-135m")
    conv, _ = load_model(model_dir)
    items = recall_items(tok, ChoiceSettings(**DEV_RECALL))
    n = len(src.model.layers)
    own = [layer.self_attn for layer in src.model.layers]
    groups = ([("source", [])] + [(f"{a}-{min(a + GROUP, n) - 1}", list(range(a, min(a + GROUP, n)))) for a in range(0, n, GROUP)]
              + [("all", list(range(n)))])
    rows = {}
    for name, layers in groups:
        for i in range(n):
            src.model.layers[i].self_attn = conv.model.layers[i].self_attn if i in layers else own[i]
        start = time.perf_counter()
        r = score_items(src, items)
        rows[name] = {"acc": r["acc"], "nll": r["nll"], "seconds": round(time.perf_counter() - start, 1)}
        log(f"{name}: {rows[name]}")
    return {"model": model_dir, "items": DEV_RECALL, "group": GROUP, "rows": rows, "machine": machine(),
            "load_after": os.getloadavg()[0]}


def report(result: dict) -> str:
    rows = result["rows"]
    src = rows["source"]["nll"]
    L = ["# Which layers lose recall: one group converted at a time", "", (__doc__ or "").split("\n\n")[2].strip(), "",
         f"Conversion: `{result['model']}`.", "", "| converted layers | accuracy | nll | nll added | seconds |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        L.append(f"| {name} | {r['acc']:.0%} | {r['nll']:.3f} | {r['nll'] - src:+.3f} | {r['seconds']:.0f} |")
    m = result["machine"]
    L += ["", f"CPU: {m['machine']}, {m['threads']} thread(s), load {m['load_average']}-{result['load_after']:.2f}; {m['date']}."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="out/passkey/transmla-50-shared", help="a converted SmolLM2 folder")
    ap.add_argument("--report", action="store_true", help="only rewrite the table")
    args = ap.parse_args(argv)
    path = RESULTS / f"{STEM}.json"
    if not args.report:
        path.write_text(json.dumps(measure(args.model), indent=1) + "\n")
    (RESULTS / f"{STEM}.md").write_text(report(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
