"""Compare two lm-eval output directories: each metric side by side with its relative difference, and
the largest per-request loglikelihood difference."""

from __future__ import annotations

import glob
import json
import sys


def load(root: str) -> tuple[dict, dict]:
    results = json.load(open(sorted(glob.glob(f"{root}/*/results_*.json"))[-1]))["results"]
    samples = {}
    for path in glob.glob(f"{root}/*/samples_*.jsonl"):
        task = path.split("samples_")[1].rsplit("_", 1)[0]
        for line in open(path):
            doc = json.loads(line)
            samples[(task, doc["doc_id"])] = [r[0] if isinstance(r, list) else r for r in doc["resps"]]
    return results, samples


def first(value) -> float:
    return float(value[0] if isinstance(value, list) else value)


def main(a_dir: str, b_dir: str) -> None:
    (a, sa), (b, sb) = load(a_dir), load(b_dir)
    print(f"{'task':12} {'metric':22} {'strata':>14} {'transformers':>14} {'rel diff':>10}")
    for task in sorted(a):
        for metric, value in a[task].items():
            if isinstance(value, float) and "stderr" not in metric:
                other = b[task][metric]
                rel = abs(value - other) / abs(other) if other else abs(value)
                print(f"{task:12} {metric:22} {value:14.6f} {other:14.6f} {rel:10.2e}")
    diffs = [abs(first(x) - first(y)) for key in sa for x, y in zip(sa[key], sb[key])]
    print(f"{len(sa)} documents, {len(diffs)} loglikelihoods: largest difference {max(diffs):.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
