"""The results run: methods × KV budgets × context lengths on the generated RULER-style tasks, each configuration
one run of kvpress's evaluate.py (through :mod:`kvpress_cpp.evaluation.launch`, in this process so the model loads
once), then a CSV, one accuracy-versus-budget plot per task family and the README's markdown table.

    python -m kvpress_cpp.evaluation.results run       # resumable: finished configurations are skipped
    python -m kvpress_cpp.evaluation.results report    # CSV, plots, table.md from the per-configuration JSONs
    python -m kvpress_cpp.evaluation.results run --model meta-llama/Llama-3.1-8B-Instruct --device cuda:0 \\
        --lengths 4096 16384 --examples 20 --out results/llama      # the same on a GPU

A configuration is (method, compression ratio, context length). Its outcome goes to
``<out>/configs/<length>__<method>__<ratio>.json`` (scores per task as kvpress's RULER scorer computed them, the
examples per task, the ratio the press reports, CPU and wall seconds) and evaluate.py's own files to
``<out>/runs/``. A configuration is skipped when its JSON exists and was computed on the same data and model
(``fingerprint``); change the plan and only what is missing or stale is computed.

KV budget = fraction of the context kept = 1 - kvpress's compression_ratio. Methods:

* ours (:data:`kvpress_cpp.evaluation.registry.METHODS`): budget = 1 - ratio; methods that choose their ratio
  (GVote) run once and report the ratio they measured;
* kvpress's, by their names in kvpress's ``PRESS_REGISTRY``: prefill presses get ``compression_ratio``; CAM, a
  decoding press, gets ``target_size = budget × context tokens`` and ``compression_interval = 1`` (it cuts the cache
  to the budget at the question and at every generated token).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvpress_cpp.evaluation import launch
from kvpress_cpp.evaluation.models import DEFAULT_MODEL_NAME
from kvpress_cpp.evaluation.registry import METHODS

__all__ = ["KVPRESS_METHODS", "Config", "plan", "run", "collect", "report", "markdown_table", "family"]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "evaluation"
#: kvpress's presses compared against, by PRESS_REGISTRY name → label.
KVPRESS_METHODS = {
    "streaming_llm": "StreamingLLM",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "observed_attention": "ObservedAttention (H2O)",
    "cam_tova": "CAM (TOVA scores)",
    "expected_attention": "ExpectedAttention (AdaKV)",
}
#: kvpress's decoding presses: their budget is a token count (target_size), not compression_ratio.
DECODING_KVPRESS = {"cam_tova"}
RATIOS = (0.9, 0.75, 0.5)  # KV budgets 10 %, 25 %, 50 %
#: Examples per task, per length, of the results run (see the README for why so few).
DEFAULT_EXAMPLES = {
    2048: {"niah_single_1": 1, "niah_multikey_1": 1, "vt": 1, **{f"niah_depth_{d}": 1 for d in (0, 50, 100)}},
    4096: {"niah_depth_50": 1},
}
FAMILIES = ("niah", "niah_depth", "vt", "cwe")


def family(task: str) -> str:
    """niah_depth_* → niah_depth (the depth sweep), other niah_* → niah, else the task itself."""
    if task.startswith("niah_depth_"):
        return "niah_depth"
    return "niah" if task.startswith("niah") else task


def label(method: str) -> str:
    if method == "no_press":
        return "no press"
    return KVPRESS_METHODS.get(method, method)


@dataclass(frozen=True)
class Config:
    method: str
    ratio: float  # requested; 0 for no_press; measured methods run once at 0
    length: int

    @property
    def key(self) -> str:
        return f"{self.length}__{self.method}__{self.ratio:.2f}"


def plan(methods: list[str], ratios: list[float], lengths: list[int]) -> list[Config]:
    configs = []
    for length in lengths:
        for method in sorted(methods, key=lambda m: (m != "no_press", m not in METHODS)):  # no press, ours, kvpress
            if method == "no_press" or (method in METHODS and METHODS[method].measured):
                configs.append(Config(method, 0.0, length))
            else:
                configs.extend(Config(method, ratio, length) for ratio in ratios)
    return configs


def _fingerprint(data_file: Path, model: str) -> str:
    digest = hashlib.sha256(data_file.read_bytes())
    digest.update(model.encode())
    return digest.hexdigest()[:16]


def _parquet_bytes(df: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    df.reset_index(drop=True).to_parquet(buffer)  # as write_dataset writes it
    return buffer.getvalue()


def prepare_data(local_data: Path, model: str, examples: dict[int, dict[str, int]], seed: int) -> dict[int, Path]:
    """Generate each length's examples → length → test.parquet. Always generated (a few seconds), written only when
    they differ from the file there, so the data fingerprint follows the generator's code as well as the plan."""
    from kvpress_cpp.evaluation.models import load_tokenizer
    from kvpress_cpp.evaluation.ruler_data import generate, write_dataset

    root, tokenizer, files = launch.generated_root(local_data, model), load_tokenizer(model), {}
    for length, counts in examples.items():
        path = root / str(length) / "test.parquet"
        df = generate(tokenizer, length, counts, seed)
        if not (path.is_file() and _parquet_bytes(df) == path.read_bytes()):
            write_dataset(df, root)
        files[length] = path
    return files


def _evaluate(evaluate, config: Config, model: str, device: str | None, run_dir: Path, data: pd.DataFrame,
              seed: int) -> Path:
    """One evaluate.py run (its CliEntryPoint, as its __main__ calls it); returns its results folder."""
    args = dict(dataset=launch.GENERATED_DATASET, data_dir=str(config.length), model=model, device=device,
                press_name=config.method, compression_ratio=config.ratio, output_dir=str(run_dir), seed=seed,
                log_level="WARNING")
    if config.method in DECODING_KVPRESS:
        context = int(data["context_tokens"].mean())
        args.update(target_size=max(1, round((1 - config.ratio) * context)), compression_interval=1)
    before = set(run_dir.glob("*")) if run_dir.exists() else set()
    evaluate.CliEntryPoint()(config_file=str(launch.CONFIG_FILE), **args)
    made = [p for p in run_dir.glob("*") if p not in before and (p / "metrics.json").is_file()]
    if len(made) != 1:
        raise RuntimeError(f"evaluate.py left {made} in {run_dir} for {config}")
    return made[0]


def run(configs: list[Config], out: Path, model: str = DEFAULT_MODEL_NAME, device: str | None = None,
        examples: dict[int, dict[str, int]] | None = None, seed: int = 42, data_seed: int = 0,
        local_data: Path | None = None) -> list[Path]:
    """Run every configuration not already in ``<out>/configs`` for the same data and model; returns the JSONs."""
    import torch
    from tqdm import tqdm

    examples = examples or DEFAULT_EXAMPLES
    local_data = Path(local_data) if local_data else launch.cache_dir("evaluation-data")
    files = prepare_data(local_data, model, {n: examples[n] for n in sorted({c.length for c in configs})}, data_seed)
    evaluate, _ = launch.load_evaluation(local_data, model)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    written = []
    todo = []
    for config in configs:
        path = out / "configs" / f"{config.key}.json"
        fingerprint = _fingerprint(files[config.length], model)
        if path.is_file() and json.loads(path.read_text()).get("fingerprint") == fingerprint:
            written.append(path)
        else:
            todo.append((config, path, fingerprint))
    print(f"{len(configs) - len(todo)} of {len(configs)} configurations already done; running {len(todo)}")
    failed = []
    for config, path, fingerprint in tqdm(todo, desc="configurations", unit="config"):
        data = pd.read_parquet(files[config.length])
        run_dir = out / "runs" / config.key
        shutil.rmtree(run_dir, ignore_errors=True)  # a stale or interrupted run would make evaluate.py skip or nest
        torch.manual_seed(seed)
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            folder = _evaluate(evaluate, config, model, device, run_dir, data, seed)
        except Exception:  # record and go on: the next run retries it (no JSON is written)
            traceback.print_exc()
            failed.append(config)
            continue
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        predictions = pd.read_csv(folder / "predictions.csv")
        metrics = json.loads((folder / "metrics.json").read_text())
        measured = (float(predictions["compression_ratio"].mean()) if "compression_ratio" in predictions
                    else config.ratio)
        result = {
            "method": config.method, "label": label(config.method), "requested_ratio": config.ratio,
            "compression_ratio": round(measured, 4), "budget": round(1 - measured, 4), "length": config.length,
            "model": model, "device": device or "auto", "scores": {t: m["string_match"] for t, m in metrics.items()},
            "examples": predictions["task"].value_counts().sort_index().to_dict(),
            "cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "threads": torch.get_num_threads(),
            "fingerprint": fingerprint, "run_dir": str(folder.relative_to(out)),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, path)
        written.append(path)
    if failed:
        print(f"{len(failed)} configurations failed (rerun to retry): {[c.key for c in failed]}")
    return written


def collect(out: Path) -> pd.DataFrame:
    """One row per (configuration, task family): n-weighted mean of kvpress's per-task string_match."""
    rows = []
    for path in sorted((out / "configs").glob("*.json")):
        r = json.loads(path.read_text())
        by_family: dict[str, list[tuple[float, int]]] = {}
        for task, score in r["scores"].items():
            by_family.setdefault(family(task), []).append((score, r["examples"][task]))
        for fam, pairs in by_family.items():
            n = sum(k for _, k in pairs)
            rows.append({"method": r["method"], "label": r["label"], "length": r["length"],
                         "requested_ratio": r["requested_ratio"], "compression_ratio": r["compression_ratio"],
                         "budget": r["budget"], "family": fam, "score": round(sum(s * k for s, k in pairs) / n, 2),
                         "n": n, "cpu_s": r["cpu_s"], "model": r["model"]})
    return pd.DataFrame(rows)


def _ordered_methods(df: pd.DataFrame) -> list[str]:
    ours = [m for m in METHODS if m in set(df["method"])]
    theirs = [m for m in ["no_press", *KVPRESS_METHODS] if m in set(df["method"])]
    return theirs + ours


def informative(part: pd.DataFrame) -> pd.DataFrame:
    """The rows of the task families the model solves at least partly without compression (no_press > 0): a family
    it fails uncompressed says nothing about compression. All rows when there is no no_press row, or when it fails
    every family (a smoke run on a random model)."""
    base = part[part["method"] == "no_press"]
    kept = part[part["family"].isin(set(base[base["score"] > 0]["family"]))]
    return part if base.empty or kept.empty else kept


def markdown_table(df: pd.DataFrame) -> str:
    """Per length: a row per method, a column per KV budget; cells = score averaged over the informative task
    families (each the n-weighted mean of its tasks); measured-ratio methods show their ratio."""
    lines = []
    for length, whole in df.groupby("length"):
        part = informative(whole)
        avg = part.groupby(["method", "requested_ratio", "budget"])["score"].mean().reset_index()
        n = part.groupby(["method", "requested_ratio"])["n"].sum().max()
        families = ", ".join(f for f in FAMILIES if f in set(part["family"]))
        dropped = sorted(set(whole["family"]) - set(part["family"]))
        note = f"; left out, 0 without compression: {', '.join(dropped)}" if dropped else ""
        lines += [f"**{length} tokens** (score 0-100 = mean over task families {families}; {n} example{'s' if n != 1 else ''} per "
                  f"configuration{note})", "",
                  "| method | 10% KV | 25% KV | 50% KV |", "|---|---|---|---|"]
        for method in _ordered_methods(part):
            rows = avg[avg["method"] == method]
            if method == "no_press":
                cells = [f"{rows['score'].iloc[0]:.1f} (100% KV)"] * 3
            elif method in METHODS and METHODS[method].measured:
                r = rows.iloc[0]
                cells = [f"{r['score']:.1f} at {100 * r['budget']:.0f}% KV (its choice)"] + ["–", "–"]
            else:
                cells = []
                for ratio in RATIOS:
                    hit = rows[(rows["requested_ratio"] - ratio).abs() < 1e-6]
                    cells.append(f"{hit['score'].iloc[0]:.1f}" if len(hit) else "–")
            lines.append(f"| {label(method)}{' (ours)' if method in METHODS else ''} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def standings(df: pd.DataFrame) -> str:
    """Per length and budget: each of our methods against the best kvpress press (score averaged over families)."""
    df = pd.concat([informative(part) for _, part in df.groupby("length")])
    avg = df.groupby(["length", "method", "requested_ratio", "budget"])["score"].mean().reset_index()
    theirs = avg[avg["method"].isin(list(KVPRESS_METHODS))]
    lines = []
    for length in sorted(avg["length"].unique()):
        for ratio in RATIOS:
            pool = theirs[(theirs["length"] == length) & ((theirs["requested_ratio"] - ratio).abs() < 1e-6)]
            ours = avg[(avg["length"] == length) & avg["method"].isin(list(METHODS))
                       & ((avg["requested_ratio"] - ratio).abs() < 1e-6)]
            if pool.empty or ours.empty:
                continue
            top = pool["score"].max()
            best = " / ".join(label(m) for m in pool[pool["score"] == top]["method"])
            cells = ", ".join(f"{m} {s:.1f} ({s - top:+.1f})" for m, s in zip(ours["method"], ours["score"]))
            lines.append(f"- {length} tokens, {100 * (1 - ratio):.0f}% KV: best kvpress press {best} {top:.1f}; "
                         f"ours {cells}")
        for _, r in avg[(avg["length"] == length) & (avg["requested_ratio"] == 0)].iterrows():
            if r["method"] in METHODS and METHODS[r["method"]].measured:
                near = min(RATIOS, key=lambda q: abs((1 - q) - r["budget"]))
                pool = theirs[(theirs["length"] == length) & ((theirs["requested_ratio"] - near).abs() < 1e-6)]
                if not pool.empty:
                    lines.append(f"- {length} tokens, {r['method']} chose {100 * r['budget']:.0f}% KV: {r['score']:.1f} "
                                 f"(best kvpress press at {100 * (1 - near):.0f}% KV: {pool['score'].max():.1f})")
    return "\n".join(lines) + "\n"


def plots(df: pd.DataFrame, out: Path) -> list[Path]:
    """One PNG per task family: score versus KV budget, a panel per length, a line per method."""
    plt = _pyplot()
    paths = []
    lengths = sorted(df["length"].unique())
    for fam in [f for f in FAMILIES if f in set(df["family"])]:
        fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
        for ax, length in zip(axes[0], lengths):
            part = df[(df["family"] == fam) & (df["length"] == length)]
            for method in _ordered_methods(part):
                rows = part[part["method"] == method].sort_values("budget")
                ours = method in METHODS
                if method == "no_press":
                    ax.axhline(rows["score"].iloc[0], color="k", linewidth=2, label="no press")
                    continue
                style = "o-" if ours else "s--"
                ax.plot(100 * rows["budget"], rows["score"], style, label=label(method) + (" (ours)" if ours else ""),
                        linewidth=2 if ours else 1, markersize=7 if ours else 4)
            n = part.groupby("method")["n"].max().max() if len(part) else 0
            ax.set_title(f"{fam}, {length} tokens (n = {n} per point)")
            ax.set_xlabel("KV budget kept (% of the context)")
            ax.set_ylabel("string match (0-100)")
            ax.set_xlim(0, 105)
            ax.set_ylim(-5, 105)
            if len(part):
                ax.legend(fontsize=7)
            else:
                ax.text(50, 50, "not in the plan", ha="center")
        model = df["model"].iloc[0]
        fig.suptitle(f"{model}: accuracy versus KV budget, RULER-style {fam}", fontsize=9)
        fig.tight_layout()
        path = out / f"accuracy_{fam}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def report(out: Path) -> str:
    df = collect(out)
    df.to_csv(out / "results.csv", index=False)
    table = markdown_table(df) + "\n" + standings(df)
    (out / "table.md").write_text(table)
    plots(df, out)
    return table


README_BEGIN, README_END = "<!-- evaluation-table: written by kvpress_cpp.evaluation.results report -->", \
    "<!-- /evaluation-table -->"


def update_readme(readme: Path, table: str) -> bool:
    """Put ``table`` between the README's evaluation-table markers; False when the markers are missing."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{table.strip()}\n{README_END}{tail}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["run", "report", "all"], nargs="?", default="all")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--device", default=None, help="cpu, cuda:0, ... (default: auto, as evaluate.py)")
    parser.add_argument("--methods", nargs="+", default=["no_press", *KVPRESS_METHODS, *METHODS])
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--lengths", type=int, nargs="+", default=sorted(DEFAULT_EXAMPLES))
    parser.add_argument("--examples", type=int, default=None,
                        help="examples per task at every length (default: the plan in DEFAULT_EXAMPLES)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--local_data", type=Path, default=None)
    parser.add_argument("--readme", type=Path, default=None,
                        help="also write the table into this README (between its evaluation-table markers)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.action in ("run", "all"):
        from kvpress_cpp.evaluation.ruler_data import default_tasks

        examples = ({n: {t: args.examples for t in default_tasks()} for n in args.lengths} if args.examples
                    else {n: DEFAULT_EXAMPLES.get(n, DEFAULT_EXAMPLES[max(DEFAULT_EXAMPLES)]) for n in args.lengths})
        run(plan(args.methods, args.ratios, args.lengths), args.out, args.model, args.device, examples,
            local_data=args.local_data)
    if args.action in ("report", "all"):
        table = report(args.out)
        print(table)
        if args.readme is not None and not update_readme(args.readme, table):
            raise SystemExit(f"{args.readme} has no {README_BEGIN} ... {README_END} markers")


if __name__ == "__main__":
    main()
