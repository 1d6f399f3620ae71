"""The results run: methods × KV budgets × context lengths on the generated RULER-style tasks, each configuration
one run of kvpress's evaluate.py (through :mod:`kvpress_cpp.evaluation.launch`, in this process, or in ``--workers``
processes, so that the model loads once per process), then a CSV, one accuracy-versus-budget plot per task family
and the markdown report (docs/evaluation.md holds the committed one).

    python -m kvpress_cpp.evaluation.results run       # resumable: finished configurations are skipped
    python -m kvpress_cpp.evaluation.results run --threads 1 --workers 8   # 8 processes, one thread and model each
    python -m kvpress_cpp.evaluation.results report    # CSV, plots, table.md from the per-configuration JSONs
    python -m kvpress_cpp.evaluation.results run --model meta-llama/Llama-3.1-8B-Instruct --device cuda:0 \\
        --lengths 4096 16384 --examples 20 --out results/llama      # the same on a GPU
    python -m kvpress_cpp.evaluation.results run --query-aware --lengths 2048 --ratios 0.75 --families niah \\
        --examples 4 --batches 5   # question-aware, 20 niah examples per cell in 5 batches of 4

Two settings, each in its own folder with its own fingerprints (they never share a configuration; a run into a
folder holding the other setting is refused, :func:`other_setting`): query-agnostic (kvpress's default: the context
is compressed alone, the question comes after) in ``DEFAULT_OUT``, and question-aware (``--query-aware``: kvpress's
``query_aware``, the question is part of the compressed prompt and the answer is generated under the press) in
``QUESTION_AWARE_OUT``. ``--families`` runs each task family on its own data, in ``--batches`` batches of
``--examples`` examples: every method gets a batch at every ratio before the next batch starts, so a run stopped
early leaves every method with the same number of examples; the report pools the batches every method has finished,
the full cache included, so every cell of a table counts the same examples (a batch a stopped run left half done
counts once the rest of the methods have run it; until then table.md and results.csv say the results are partial).
The report gives each cell's Wilson 95% interval and the agreement of its answers with the full cache's (ROUGE-L
F1), and ``report.md`` puts both settings side by side with the streaming perplexity of
``benchmarks/results/streaming_ppl*.json``.
A family run and an earlier whole-plan run in the same folder draw the same examples: for that family the report
counts the family run's batches only.

A configuration is (method, compression ratio, context length). Its outcome goes to
``<out>/configs/<length>__<method>__<ratio>.json`` (scores per task as kvpress's RULER scorer computed them, the
examples per task, the ratio the press reports, the evaluation's CPU and wall seconds, and apart from them those of
the model's load, which the first configuration of each process pays) and evaluate.py's own files to
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
import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvpress_cpp.evaluation import launch
from kvpress_cpp.evaluation.models import DEFAULT_MODEL_NAME
from kvpress_cpp.evaluation.registry import METHODS
from kvpress_cpp.evaluation.ruler_data import LengthTooShort
from kvpress_cpp.models import local_model_problem

__all__ = ["KVPRESS_METHODS", "Config", "plan", "run", "other_setting", "collect", "report", "markdown_table", "family"]


def results_root(package_parent: Path) -> Path:
    """The checkout this package runs from (an editable install), whose benchmarks/results hold the committed
    results; installed from a wheel, the working directory (the package's parent is then site-packages)."""
    return package_parent if (package_parent / "setup.py").is_file() else Path.cwd()


REPO = results_root(Path(__file__).resolve().parents[2])
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
#: Examples per task, per length, of the results run (docs/evaluation.md says why so few).
DEFAULT_EXAMPLES = {
    2048: {"niah_single_1": 1, "niah_multikey_1": 1, "vt": 1, **{f"niah_depth_{d}": 1 for d in (0, 50, 100)}},
    4096: {"niah_depth_50": 1},
}
FAMILIES = ("niah", "niah_depth", "vt", "cwe", "facts", "characters")
#: Families on unchanged real text, reported each on its own (``family_table``) beside the pooled RULER-style ones.
REAL_TEXT_FAMILIES = ("facts", "characters")
#: The tasks a per-family configuration (``--families``) runs; its examples are split evenly over them.
FAMILY_TASKS = {"niah": ("niah_single_1", "niah_multikey_1"), "niah_depth": tuple(f"niah_depth_{d}" for d in (0, 50, 100)),
                "vt": ("vt",), "cwe": ("cwe",), "facts": ("facts",), "characters": ("characters",)}
#: Where the question-aware run writes (its own folder: the two settings never share a configuration JSON).
QUESTION_AWARE_OUT = DEFAULT_OUT / "question_aware"


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
    family: str | None = None  # one task family's own data (FAMILY_TASKS), or None: every task of the length's plan
    batch: int = 0  # with a family: which batch of its examples (batches are pooled in the report)

    @property
    def key(self) -> str:
        return f"{self.length}__{self.method}__{self.ratio:.2f}" + (f"__{self.family}{self.batch}" if self.family else "")

    @property
    def data_dir(self) -> str:
        """evaluate.py's data_dir: ``<length>`` (the length's plan) or ``<length>-<family><batch>``."""
        return f"{self.length}-{self.family}{self.batch}" if self.family else str(self.length)


def plan(methods: list[str], ratios: list[float], lengths: list[int],
         families: list[str | None] | None = None, batches: int = 1) -> list[Config]:
    """Configurations in run order: per length, per family (None: the length's whole plan), per batch of examples,
    per ratio, per method (no press, ours, kvpress's); so every method has a batch at every ratio before the next
    batch starts, and a run stopped early leaves a complete table with fewer examples (with the ratios outside the
    batches, a run stopped during the second ratio had every batch of the first and none of the third)."""
    configs = []
    order = sorted(methods, key=lambda m: (m != "no_press", m not in METHODS))
    for length in lengths:
        for fam in families or [None]:
            for batch in range(batches if fam else 1):
                for i, ratio in enumerate(ratios):
                    for method in order:
                        once = method == "no_press" or (method in METHODS and METHODS[method].measured)
                        if not once:
                            configs.append(Config(method, ratio, length, fam, batch))
                        elif i == 0:
                            configs.append(Config(method, 0.0, length, fam, batch))
    return configs


def _fingerprint(data_file: Path, model: str, query_aware: bool = False) -> str:
    digest = hashlib.sha256(data_file.read_bytes())
    digest.update(model.encode())
    if query_aware:  # the query-agnostic fingerprints stay what they were
        digest.update(b"query_aware")
    return digest.hexdigest()[:16]


def _parquet_bytes(df: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    df.reset_index(drop=True).to_parquet(buffer)  # as write_dataset writes it
    return buffer.getvalue()


def prepare_data(local_data: Path, model: str, examples: dict[str, dict[str, int | range]],
                 seed: int) -> dict[str, Path]:
    """Generate each data_dir's examples (data_dir → task → count or indices) → data_dir → test.parquet. Always generated (a few
    seconds), written only when they differ from the file there, so the data fingerprint follows the generator's
    code as well as the plan."""
    from kvpress_cpp.evaluation.models import load_tokenizer
    from kvpress_cpp.evaluation.ruler_data import generate

    root, tokenizer, files = launch.generated_root(local_data, model), load_tokenizer(model), {}
    for data_dir, counts in examples.items():
        path = root / data_dir / "test.parquet"
        df = generate(tokenizer, int(data_dir.split("-")[0]), counts, seed)
        data = _parquet_bytes(df)
        if not (path.is_file() and data == path.read_bytes()):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        files[data_dir] = path
    return files


def family_examples(configs: list[Config], per_batch: int) -> dict[str, dict[str, range]]:
    """data_dir → task → example indices for per-family configurations: ``per_batch`` examples per batch split evenly
    over the family's tasks (the first tasks get the remainder); batch b takes each task's b-th block of indices."""
    plan_ = {}
    for config in configs:
        tasks = FAMILY_TASKS[config.family]
        counts = [per_batch // len(tasks) + (i < per_batch % len(tasks)) for i in range(len(tasks))]
        plan_[config.data_dir] = {t: range(config.batch * k, (config.batch + 1) * k) for t, k in zip(tasks, counts)}
    return plan_


def _evaluate(evaluate, config: Config, model: str, device: str | None, run_dir: Path, data: pd.DataFrame,
              seed: int, query_aware: bool = False) -> Path:
    """One evaluate.py run (its CliEntryPoint, as its __main__ calls it); returns its results folder. With
    ``query_aware`` evaluate.py appends the question to the context, so the press compresses it with the prompt."""
    args = dict(dataset=launch.GENERATED_DATASET, data_dir=config.data_dir, model=model, device=device,
                press_name=config.method, compression_ratio=config.ratio, output_dir=str(run_dir), seed=seed,
                log_level="WARNING", query_aware=query_aware)
    if config.method in DECODING_KVPRESS:
        context = int(data["context_tokens"].mean())
        args.update(target_size=max(1, round((1 - config.ratio) * context)), compression_interval=1)
    before = set(run_dir.glob("*")) if run_dir.exists() else set()
    evaluate.CliEntryPoint()(config_file=str(launch.CONFIG_FILE), **args)
    made = [p for p in run_dir.glob("*") if p not in before and (p / "metrics.json").is_file()]
    if len(made) != 1:
        raise RuntimeError(f"evaluate.py left {made} in {run_dir} for {config}")
    return made[0]


@contextlib.contextmanager
def _model_loads_timed(evaluate):
    """Times evaluate.py's ``pipeline(...)`` calls while the block runs, as [CPU, wall] seconds: that is where a
    process loads its model (the first configuration it runs, and a configuration needing other model arguments;
    later calls return the cached pipeline), which is no part of one configuration's cost."""
    spent = [0.0, 0.0]
    build = evaluate.pipeline

    def timed(*args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - cpu
            spent[1] += time.perf_counter() - wall

    evaluate.pipeline = timed
    try:
        yield spent
    finally:
        evaluate.pipeline = build


def _run_one(evaluate, config: Config, path: Path, fingerprint: str, out: Path, data_file: Path, model: str,
             device: str | None, seed: int, query_aware: bool) -> bool:
    """One configuration: evaluate.py's run, then its JSON at ``path``. False (the traceback printed, no JSON
    written, so the next run retries it) when evaluate.py failed."""
    import torch

    data = pd.read_parquet(data_file)
    run_dir = out / "runs" / config.key
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale or interrupted run would make evaluate.py skip or nest
    torch.manual_seed(seed)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        with _model_loads_timed(evaluate) as load:
            folder = _evaluate(evaluate, config, model, device, run_dir, data, seed, query_aware)
    except Exception:
        traceback.print_exc()
        return False
    # the evaluation's own seconds: with the load in, the first configuration of each process (one per --workers)
    # cost a model load more than the same configuration run later
    cpu, wall = time.process_time() - cpu - load[0], time.perf_counter() - wall - load[1]
    predictions = pd.read_csv(folder / "predictions.csv")
    metrics = json.loads((folder / "metrics.json").read_text())
    measured = (float(predictions["compression_ratio"].mean()) if "compression_ratio" in predictions
                else config.ratio)
    result = {
        "method": config.method, "label": label(config.method), "requested_ratio": config.ratio,
        "compression_ratio": round(measured, 4), "budget": round(1 - measured, 4), "length": config.length,
        "model": model, "device": device or "auto", "query_aware": query_aware, "family": config.family,
        "scores": {t: m["string_match"] for t, m in metrics.items()},
        "examples": predictions["task"].value_counts().sort_index().to_dict(),
        "cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "load_cpu_s": round(load[0], 1),
        "load_wall_s": round(load[1], 1), "threads": torch.get_num_threads(),
        "fingerprint": fingerprint, "run_dir": str(folder.relative_to(out)),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return True


_worker_evaluate = None  # a worker process's kvpress evaluate module (its models load once per process)


def _start_worker(local_data: Path, model: str, threads: int) -> None:
    import torch

    global _worker_evaluate
    torch.set_num_threads(threads)
    _worker_evaluate, _ = launch.load_evaluation(local_data, model)


def _run_in_worker(*args) -> bool:
    return _run_one(_worker_evaluate, *args)


def _setting_name(query_aware: bool) -> str:
    return "question-aware" if query_aware else "query-agnostic"


def other_setting(out: Path, query_aware: bool, configurations: dict[str, dict] | None = None) -> str | None:
    """Why ``out`` cannot take a run of this setting (query-aware or not), or None. A folder holds one setting (its
    table, plots and results.csv are that setting's): a configuration JSON of the other setting has the same file
    name (Config.key), would be taken as stale and computed over, and until then the report would pool both
    settings in one table."""
    if configurations is None:
        configurations = _configurations(out) if (out / "configs").is_dir() else {}
    others = sorted(key for key, r in configurations.items() if bool(r.get("query_aware", False)) != query_aware)
    if not others:
        return None
    return (f"{out} holds {_setting_name(not query_aware)} results ({len(others)} configurations, e.g. "
            f"configs/{others[0]}.json) and this run is {_setting_name(query_aware)}: each setting has its own folder "
            f"(default --out {DEFAULT_OUT if not query_aware else QUESTION_AWARE_OUT}); give another --out"
            + ("" if query_aware else ", or --query-aware to add to that folder's setting"))


def run(configs: list[Config], out: Path, model: str = DEFAULT_MODEL_NAME, device: str | None = None,
        examples: dict[str, dict[str, int | range]] | None = None, seed: int = 42, data_seed: int = 0,
        local_data: Path | None = None, query_aware: bool = False, workers: int = 1) -> list[Path]:
    """Run every configuration not already in ``<out>/configs`` for the same data, model and setting (query-aware or
    not); returns the JSONs. ``examples``: data_dir (Config.data_dir) → task → count. ``workers`` > 1: that many
    processes, each with its own model, take the configurations in plan order (each with the torch thread count
    this process has), for a CPU whose cores one small model's run cannot use."""
    import torch
    from tqdm import tqdm

    if workers < 1:
        raise ValueError(f"results.run: workers must be at least 1, got {workers}")
    if clash := other_setting(out, query_aware):
        raise ValueError(clash)
    examples = {str(d): counts for d, counts in (examples or DEFAULT_EXAMPLES).items()}
    local_data = Path(local_data) if local_data else launch.cache_dir("evaluation-data")
    files = prepare_data(local_data, model, {d: examples[d] for d in sorted({c.data_dir for c in configs})}, data_seed)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    written = []
    todo = []
    for config in configs:
        path = out / "configs" / f"{config.key}.json"
        fingerprint = _fingerprint(files[config.data_dir], model, query_aware)
        if path.is_file() and json.loads(path.read_text()).get("fingerprint") == fingerprint:
            written.append(path)
        else:
            todo.append((config, path, fingerprint, out, files[config.data_dir], model, device, seed, query_aware))
    print(f"{len(configs) - len(todo)} of {len(configs)} configurations already done; running {len(todo)}"
          + (f" in {workers} processes" if workers > 1 and todo else ""))
    progress = tqdm(total=len(todo), desc="configurations", unit="config")
    if workers > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_start_worker,
                                 initargs=(local_data, model, torch.get_num_threads())) as pool:
            futures = [pool.submit(_run_in_worker, *job) for job in todo]  # taken in this order
            try:
                for _ in as_completed(futures):
                    progress.update()
            except KeyboardInterrupt:  # leave the queued configurations for the next run instead of waiting on them
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            done = [future.result() for future in futures]
    else:
        evaluate = launch.load_evaluation(local_data, model)[0] if todo else None
        done = []
        for job in todo:
            done.append(_run_one(evaluate, *job))
            progress.update()
    progress.close()
    written += [job[1] for job, ok in zip(todo, done) if ok]
    if failed := [job[0].key for job, ok in zip(todo, done) if not ok]:
        print(f"{len(failed)} configurations failed (rerun to retry): {failed}")
    return written


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(score: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (95% by default) of a proportion, in the 0-100 scale of ``score`` (the mean of n
    examples' scores): (p + z²/2n ± z √(p(1-p)/n + z²/4n²)) / (1 + z²/n). Exact for 0/1 scores; for the partial
    credit of multi-answer tasks (vt, cwe) it treats the mean as a proportion of n, an approximation."""
    if n <= 0:
        return 0.0, 100.0
    p = min(max(score / 100, 0.0), 1.0)
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return 100 * max(0.0, (centre - half) / (1 + z * z / n)), 100 * min(1.0, (centre + half) / (1 + z * z / n))


def _predictions(out: Path, result: dict) -> pd.DataFrame:
    # as strings: an all-digit column would be parsed as floats ("5629481." → 5629481.0)
    return pd.read_csv(out / result["run_dir"] / "predictions.csv", keep_default_na=False,
                       dtype={"predicted_answer": str})


def agreement(out: Path, result: dict, full: dict | None) -> dict[str, float]:
    """Task → mean ROUGE-L F1 (0-100) of this configuration's answers against the full cache's (no_press on the same
    data, ``full``) on the same examples: how much of the uncompressed answer survives compression, whatever the
    reference answer (the ZSMerge paper's measure). Empty without a full-cache run."""
    return {task: total / count for task, (total, count) in _agreement_sums(out, result, full).items()}


def _agreement_sums(out: Path, result: dict, full: dict | None) -> dict[str, tuple[float, int]]:
    """Task → (sum of the ROUGE-L F1 scores, number of examples compared) of :func:`agreement`: the examples that
    have a full-cache answer, which is what a mean over several configurations must divide by."""
    if full is None:
        return {}
    from rouge_score import rouge_scorer, tokenizers

    scorer, words = rouge_scorer.RougeScorer(["rougeL"]), tokenizers.DefaultTokenizer()

    def rouge_l(reference: str, prediction: str) -> float:
        score = 100 * scorer.score(reference, prediction)["rougeL"].fmeasure
        # ROUGE-L is 0 between two answers without a word ("\n", "."), which would count the full cache as disagreeing
        # with itself; two such answers are the same answer. rouge-score's words are [a-z0-9] runs only, so answers
        # in another script ("東京", "北京") have none either: they agree when their Unicode words are the same.
        # Tokenised again only for the pairs that score 0.
        if score == 0 and not words.tokenize(reference) and not words.tokenize(prediction):
            return 100.0 if re.findall(r"\w+", reference) == re.findall(r"\w+", prediction) else 0.0
        return score

    mine, theirs = _predictions(out, result), _predictions(out, full)
    both = mine.merge(theirs, on=["task", "index"], suffixes=("", "_full"))
    both["rouge_l"] = [rouge_l(str(ref), str(pred))
                       for ref, pred in zip(both["predicted_answer_full"], both["predicted_answer"])]
    return {task: (float(part.sum()), len(part)) for task, part in both.groupby("task")["rouge_l"]}


def _configurations(out: Path) -> dict[str, dict]:
    """Config.key → the configuration's JSON, for every configuration in ``out``."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((out / "configs").glob("*.json"))}


def incomplete_batches(configurations: dict[str, dict]) -> list[str]:
    """The keys of the family configurations a table leaves out so that every cell of a (length, family) table, the
    full cache and the methods choosing their own ratio included, covers the same batches of examples. A run stopped
    mid-batch, or still running, leaves some methods a batch ahead, and pooling that batch would score them on
    examples the others have not seen (the full cache's row, compared with every other, most of all). So:

    * a KV budget (ratio) not every method run at a budget of that length and family has at all (a ratio added for
      some methods only, or reached by none but the first methods yet) is left out as a whole, as before;
    * of the rest, a batch counts only when every cell (method at each budget kept, and each method run once at ratio
      0) has it; the batches a cell has beyond those wait until the others catch up."""
    cells = {}  # (length, family) → (method, requested ratio) → batch → key; Config.key ends in <family><batch>
    for key, r in configurations.items():
        if r.get("family"):
            batch = key.rsplit("__", 1)[1].removeprefix(r["family"])
            cells.setdefault((r["length"], r["family"]), {}).setdefault((r["method"], r["requested_ratio"]), {})[
                batch] = key
    left_out = []
    for table in cells.values():
        every_method = {method for method, ratio in table if ratio > 0}
        short_ratios = {ratio for ratio in {ratio for _, ratio in table if ratio > 0}
                        if {method for method, q in table if q == ratio} != every_method}
        kept = {cell: batches for cell, batches in table.items() if cell[1] not in short_ratios}
        shared = set.intersection(*(set(batches) for batches in kept.values())) if kept else set()
        left_out += [key for cell, batches in table.items() for batch, key in batches.items()
                     if cell not in kept or batch not in shared]
    return left_out


def _overlapping_batches(out: Path, configurations: dict[str, dict]) -> list[str]:
    """The family batches that share an example (task, index) with another batch of the same method, ratio, length
    and family: batch b of ``--examples k`` holds indices [b k/t, (b+1) k/t) of each of the family's t tasks, so
    batches written with two values of ``--examples`` overlap."""
    seen: dict[tuple, str] = {}
    clashes = []
    for key, r in sorted(configurations.items()):
        if not r.get("family") or "run_dir" not in r:
            continue
        path = out / r["run_dir"] / "predictions.csv"
        if not path.is_file():
            continue
        cell = (r["method"], r["requested_ratio"], r["length"], r["family"])
        # by name: evaluate.py writes its columns in list(set(...)) order, which changes with each process's hash seed,
        # and usecols keeps the file's order, so two batches' (task, index) read by position may not compare
        examples = pd.read_csv(path, usecols=["task", "index"])
        for task, index in zip(examples["task"], examples["index"]):
            if (first := seen.setdefault((*cell, task, index), key)) != key:
                clashes.append(f"{key} and {first} ({task} #{index})")
    return sorted(set(clashes))


class FolderConflict(ValueError):
    """A results folder whose configurations one table cannot count (both settings, or one example twice): the user
    moves or deletes files, named in the message."""


def collect(out: Path, configurations: dict[str, dict] | None = None) -> pd.DataFrame:
    """One row per (method, ratio, length, task family): the n-weighted mean of kvpress's per-task string_match over
    every configuration JSON (the batches of a family are pooled, those every method has finished:
    :func:`incomplete_batches`), its Wilson 95% interval (``lo``, ``hi``), the agreement with the full cache's answers
    (``agreement``, ROUGE-L F1 0-100), the setting (``query_aware``) and ``partial``: whether configurations of its
    length and family were left out (a stopped or running run: the row covers fewer examples than were run).
    ``configurations``: ``out``'s, already read."""
    configurations = _configurations(out) if configurations is None else configurations
    by_setting = {}
    for key, r in configurations.items():
        by_setting.setdefault(bool(r.get("query_aware", False)), []).append(key)
    if len(by_setting) > 1:  # a folder written before run() refused the other setting: one table would pool both
        raise FolderConflict(f"{out} holds configurations of both settings, which one table would pool: "
                             + "; ".join(f"{_setting_name(aware)}: {len(keys)} (e.g. {sorted(keys)[0]})"
                                         for aware, keys in sorted(by_setting.items()))
                             + "; move one setting's configs/*.json (and their runs/ folders) to a folder of its own")
    left_out = set(incomplete_batches(configurations))
    partial = {(configurations[key]["length"], configurations[key]["family"]) for key in left_out}
    results_ = [r for key, r in configurations.items() if key not in left_out]
    if overlapping := _overlapping_batches(out, {k: r for k, r in configurations.items() if k not in left_out}):
        raise FolderConflict(f"{out}: batches of one cell hold the same examples (a family rerun with another "
                             f"--examples leaves the earlier run's later batches, which would be counted twice): "
                             f"{overlapping}; delete the stale configs/*.json (the older ones) and report again")
    full = {r["fingerprint"]: r for r in results_ if r["method"] == "no_press"}
    # A family run (--families) draws its examples from the same indices as the length's whole-plan run: where both
    # exist for a (method, ratio, length, family), pooling them would count the same examples twice, so the family
    # run's batches alone count.
    by_family = {(r["method"], r["requested_ratio"], r["length"], r["family"]) for r in results_ if r.get("family")}
    raw = []
    for r in results_:
        rouge = _agreement_sums(out, r, full.get(r["fingerprint"]))
        for task, score in r["scores"].items():
            if not r.get("family") and (r["method"], r["requested_ratio"], r["length"], family(task)) in by_family:
                continue
            n = r["examples"][task]
            raw.append({"method": r["method"], "label": r["label"], "length": r["length"],
                        "requested_ratio": r["requested_ratio"], "family": family(task), "model": r["model"],
                        "query_aware": bool(r.get("query_aware", False)), "n": n, "points": score * n,
                        "budget_n": r["budget"] * n, "ratio_n": r["compression_ratio"] * n,
                        # summed over the examples compared with the full cache only: a configuration whose
                        # full-cache run is missing (failed, or on older data) must not count its examples as disagreeing
                        "agreement_sum": rouge.get(task, (0.0, 0))[0], "agreement_count": rouge.get(task, (0.0, 0))[1],
                        "cpu_s": r["cpu_s"] * n / sum(r["examples"].values())})
    if not raw:
        return pd.DataFrame()
    keys = ["method", "label", "length", "requested_ratio", "family", "model", "query_aware"]
    df = pd.DataFrame(raw).groupby(keys).sum(min_count=1).reset_index()
    df["score"] = (df.pop("points") / df["n"]).round(2)
    df["budget"] = (df.pop("budget_n") / df["n"]).round(4)
    df["compression_ratio"] = (df.pop("ratio_n") / df["n"]).round(4)
    compared = df.pop("agreement_count")
    df["agreement"] = (df.pop("agreement_sum") / compared.where(compared > 0)).round(1)
    df["cpu_s"] = df["cpu_s"].round(1)
    bounds = [wilson(score, n) for score, n in zip(df["score"], df["n"])]
    df["lo"], df["hi"] = [round(b[0], 1) for b in bounds], [round(b[1], 1) for b in bounds]
    df["partial"] = [(length, fam) in partial for length, fam in zip(df["length"], df["family"])]
    columns = ["method", "label", "length", "requested_ratio", "compression_ratio", "budget", "family", "score", "lo",
               "hi", "n", "agreement", "cpu_s", "model", "query_aware", "partial"]
    return df[columns]


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


def ruler_style(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the RULER-style families, which the pooled tables and standings cover."""
    return df[~df["family"].isin(REAL_TEXT_FAMILIES)]


def pooled(part: pd.DataFrame) -> pd.DataFrame:
    """Per (method, ratio): the score over every example of ``part``'s families (n-weighted), its n, Wilson 95%
    interval (lo, hi) and budget (n-weighted: a method that chooses its own ratio measures one per run)."""
    keys = ["method", "requested_ratio"]
    weighted = part.assign(points=part["score"] * part["n"], budget_n=part["budget"] * part["n"]).groupby(keys)[
        ["points", "budget_n", "n"]].sum().reset_index()
    weighted["score"] = weighted["points"] / weighted["n"]
    weighted["budget"] = weighted.pop("budget_n") / weighted["n"]
    bounds = [wilson(s, n) for s, n in zip(weighted["score"], weighted["n"])]
    weighted["lo"], weighted["hi"] = [b[0] for b in bounds], [b[1] for b in bounds]
    return weighted.drop(columns="points")


def cell(row) -> str:
    """``58 [37-77]``: score and its Wilson 95% interval, rounded to whole points."""
    return f"{row['score']:.0f} [{row['lo']:.0f}-{row['hi']:.0f}]"


def table_ratios(*frames: pd.DataFrame) -> tuple[float, ...]:
    """The compression ratios the tables have a column for: :data:`RATIOS`, and any other ratio run (``--ratios``),
    smallest budget first; a ratio missing from the columns would leave its results out of every table."""
    run = {round(float(q), 6) for df in frames if not df.empty for q in df["requested_ratio"] if q > 0}
    return tuple(sorted(run | set(RATIOS), reverse=True))


def _budget_header(ratios: tuple[float, ...]) -> str:
    return " | ".join(f"{100 * (1 - q):.0f}% KV" for q in ratios)


def _method_cells(avg: pd.DataFrame, method: str, ratios: tuple[float, ...] = RATIOS) -> list[str]:
    """The cells of ``method`` in a pooled table, one per KV budget of ``ratios`` (measured-ratio methods: one cell at
    their ratio)."""
    rows = avg[avg["method"] == method]
    if rows.empty:
        return ["–"] * len(ratios)
    if method == "no_press":
        return [f"{cell(rows.iloc[0])} (100% KV)"] * len(ratios)
    if method in METHODS and METHODS[method].measured:
        r = rows.iloc[0]
        return [f"{cell(r)} at {100 * r['budget']:.0f}% KV (its choice)"] + ["–"] * (len(ratios) - 1)
    cells = []
    for ratio in ratios:
        hit = rows[(rows["requested_ratio"] - ratio).abs() < 1e-6]
        cells.append(cell(hit.iloc[0]) if len(hit) else "–")
    return cells


#: What a table's header says when its run has not finished (``collect``'s ``partial``).
PARTIAL_NOTE = ("PARTIAL: the run has not finished; what not every method has run yet is left out "
                "(every cell counts the same examples)")


def _partial(df: pd.DataFrame) -> bool:
    """Whether rows of ``df`` come from a run that left configurations out (frames built by hand have no column)."""
    return "partial" in df and bool(df["partial"].any())


def _describe(whole: pd.DataFrame, part: pd.DataFrame, avg: pd.DataFrame) -> str:
    """'task families niah, vt; 20 examples per configuration; left out, ...' for a table's header."""
    counts = sorted(set(avg["n"]))
    n = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    families = ", ".join(f for f in FAMILIES if f in set(part["family"]))
    dropped = sorted(set(whole["family"]) - set(part["family"]))
    note = f"; left out, 0 without compression: {', '.join(dropped)}" if dropped else ""
    note += f"; {PARTIAL_NOTE}" if _partial(part) else ""
    return f"task families {families}; {n} example{'s' if n != 1 else ''} per configuration{note}"


def markdown_table(df: pd.DataFrame) -> str:
    """Per length: a row per method, a column per KV budget; cells = score over every example of the informative
    task families (n-weighted) with its Wilson 95% interval; measured-ratio methods show their ratio."""
    lines = []
    for length, whole in df.groupby("length"):
        part = informative(whole)
        avg = pooled(part)
        ratios = table_ratios(df)
        lines += [f"**{length} tokens** (score 0-100 [Wilson 95% interval] over the examples of "
                  f"{_describe(whole, part, avg)})", "",
                  f"| method | {_budget_header(ratios)} |", "|---" * (len(ratios) + 1) + "|"]
        for method in _ordered_methods(part):
            lines.append(f"| {label(method)}{' (ours)' if method in METHODS else ''} | "
                         + " | ".join(_method_cells(avg, method, ratios)) + " |")
        lines.append("")
    return "\n".join(lines)


#: The two settings of the report: name → (results folder, what it means).
SETTINGS = {
    "query-agnostic": (DEFAULT_OUT, "the context is compressed alone, the question comes after (kvpress's default)"),
    "question-aware": (QUESTION_AWARE_OUT, "the question is part of the compressed prompt, the answer is generated "
                                           "under the press (kvpress's query_aware; LongBench-style, as the papers)"),
}


def side_by_side(frames: dict[str, pd.DataFrame]) -> str:
    """Per length: a row per method, the 10/25/50% KV cells of every setting next to each other."""
    frames = {name: df for name, df in frames.items() if not df.empty}
    ratios = table_ratios(*frames.values())
    lines = []
    for length in sorted(set().union(*(set(df["length"]) for df in frames.values()))):
        pooled_ = {}
        for name, df in frames.items():
            whole = df[df["length"] == length]
            if not whole.empty:
                part = informative(whole)
                pooled_[name] = pooled(part)
                lines.append(f"- {length} tokens, {name}: {_describe(whole, part, pooled_[name])}")
        methods = _ordered_methods(pd.concat(pooled_.values()))
        head = [f"{name} {100 * (1 - r):.0f}%" for name in pooled_ for r in ratios]
        kept = " / ".join(f"{100 * (1 - q):.0f}" for q in ratios)
        lines += ["", f"**{length} tokens**: score 0-100 [Wilson 95% interval] at {kept}% KV kept", "",
                  "| method | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
        for method in methods:
            cells = [c for avg in pooled_.values() for c in _method_cells(avg, method, ratios)]
            lines.append(f"| {label(method)}{' (ours)' if method in METHODS else ''} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def agreement_table(df: pd.DataFrame) -> str:
    """Per length: mean ROUGE-L F1 (0-100) of each method's answers against the full cache's, per KV budget."""
    lines, ratios = [], table_ratios(df)
    for length, part in df.groupby("length"):
        part = part.assign(weighted=part["agreement"] * part["n"],
                           budget_n=part["budget"] * part["n"]).dropna(subset=["agreement"])
        if part.empty:
            continue
        # per (method, ratio) over every family: a method choosing its ratio measures a different budget per family
        avg = part.groupby(["method", "requested_ratio"])[["weighted", "budget_n", "n"]].sum().reset_index()
        avg["agreement"] = avg["weighted"] / avg["n"]
        avg["budget"] = avg.pop("budget_n") / avg["n"]
        lines += [f"**{length} tokens**: agreement with the full cache's answer (ROUGE-L F1, 0-100, mean over "
                  f"{', '.join(f for f in FAMILIES if f in set(part['family']))})", "",
                  f"| method | {_budget_header(ratios)} |", "|---" * (len(ratios) + 1) + "|"]
        for method in [m for m in _ordered_methods(avg) if m != "no_press"]:
            rows = avg[avg["method"] == method]
            if method in METHODS and METHODS[method].measured:
                r = rows.iloc[0]
                cells = [f"{r['agreement']:.0f} at {100 * r['budget']:.0f}% KV"] + ["–"] * (len(ratios) - 1)
            else:
                cells = [f"{hit['agreement'].iloc[0]:.0f}" if len(hit := rows[(rows["requested_ratio"] - q).abs()
                                                                              < 1e-6]) else "–" for q in ratios]
            lines.append(f"| {label(method)}{' (ours)' if method in METHODS else ''} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def family_table(df: pd.DataFrame) -> str:
    """Per length: the real-text families each on its own, a row per method and KV budget measured: score [Wilson
    95%] and the agreement with the full cache's answer (ROUGE-L F1). Empty without rows of those families."""
    df = df[df["family"].isin(REAL_TEXT_FAMILIES)]
    lines = []
    for length, part in df.groupby("length"):
        families = [f for f in REAL_TEXT_FAMILIES if f in set(part["family"])]
        counts = sorted(set(part["n"]))
        n = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        head = [c for f in families for c in (f"{f}: score [95%]", f"{f}: ROUGE-L vs full")]
        note = f"; {PARTIAL_NOTE}" if _partial(part) else ""
        lines += [f"**{length} tokens**, families on unchanged Austen text ({n} examples per cell{note})", "",
                  "| method | KV kept | " + " | ".join(head) + " |", "|---" * (len(head) + 2) + "|"]
        for method in _ordered_methods(part):
            rows = part[part["method"] == method]
            for ratio in sorted(set(rows["requested_ratio"])):
                at = rows[(rows["requested_ratio"] - ratio).abs() < 1e-6]
                cells = []
                for fam in families:
                    hit = at[at["family"] == fam]
                    if hit.empty:
                        cells += ["–", "–"]
                        continue
                    r = hit.iloc[0]
                    lo, hi = wilson(r["score"], r["n"])
                    cells += [cell({"score": r["score"], "lo": lo, "hi": hi}),
                              "–" if pd.isna(r["agreement"]) else f"{r['agreement']:.0f}"]
                budget = "100%" if method == "no_press" else f"{100 * at['budget'].mean():.0f}%"
                lines.append(f"| {label(method)}{' (ours)' if method in METHODS else ''} | {budget} | "
                             + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def format_difference(d: dict | None) -> str:
    """A paired difference of bench_streaming_ppl ({"nats_per_token", "ci95"}) as "+0.012 [-0.003, +0.027]"."""
    return "–" if d is None else f"{d['nats_per_token']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"


def streaming_table(results_dir: Path = REPO / "benchmarks" / "results") -> str:
    """The streaming-perplexity runs of ``benchmarks/bench_streaming_ppl.py`` (``streaming_ppl*.json``) as one table:
    the runs over several excerpts first, longest first, with their paired differences beyond m (the earlier files are
    one excerpt each, the text's opening, and have none)."""

    def order(run: tuple[Path, list[dict]]) -> tuple:
        """The runs over several excerpts first, the longest (the headline) first; then the single excerpts by name."""
        path, rows = run
        windows = rows[0].get("windows", 1)
        return (windows == 1, 0 if windows == 1 else -windows * rows[0]["tokens"], path.name)

    ordered = "StreamingLLM (kvpress, order kept)"
    lines = ["| file | method | m | windows × tokens (prefill) | ppl (all) | ppl beyond m | Δ beyond m vs full [95%] "
             f"| Δ beyond m vs {ordered} [95%] |", "|---|---|---|---|---|---|---|---|"]
    runs = [(path, json.loads(path.read_text())["rows"]) for path in results_dir.glob("streaming_ppl*.json")]
    for path, rows in sorted(runs, key=order):
        for row in rows:
            beyond = "–" if row["ppl_beyond_m"] is None else f"{row['ppl_beyond_m']:.2f}"
            lines.append(f"| {path.name} | {row['method']} | {row['cache_size'] or '–'} | {row.get('windows', 1)} × "
                         f"{row['tokens']} ({row['prefill']}) | {row['ppl']:.2f} | {beyond} | "
                         f"{format_difference(row.get('diff_vs_full'))} | "
                         f"{format_difference(row.get('diffs', {}).get(ordered))} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def standings(df: pd.DataFrame) -> str:
    """Per length and budget: each of our methods against the best kvpress press (score over the informative
    families' examples, as in the table)."""
    avg = pd.concat([pooled(informative(part)).assign(length=length) for length, part in df.groupby("length")])
    theirs = avg[avg["method"].isin(list(KVPRESS_METHODS))]
    lines, ratios = [], table_ratios(df)  # the budgets compared
    for length in sorted(avg["length"].unique()):
        for ratio in ratios:
            pool = theirs[(theirs["length"] == length) & ((theirs["requested_ratio"] - ratio).abs() < 1e-6)]
            ours = avg[(avg["length"] == length) & avg["method"].isin(list(METHODS))
                       & ((avg["requested_ratio"] - ratio).abs() < 1e-6)]
            if pool.empty or ours.empty:
                continue
            top = pool["score"].max()
            best = " / ".join(label(m) for m in pool[pool["score"] == top]["method"])
            cells = ", ".join(f"{m} {s:.1f} ({s - top:+.1f})" for m, s in zip(ours["method"], ours["score"]))
            streaming = pool[pool["method"] == "streaming_llm"]["score"]  # the baseline the merging papers beat
            versus = f" (StreamingLLM {streaming.iloc[0]:.1f})" if len(streaming) else ""
            lines.append(f"- {length} tokens, {100 * (1 - ratio):.0f}% KV: best kvpress press {best} {top:.1f}{versus}; "
                         f"ours {cells}")
        for _, r in avg[(avg["length"] == length) & (avg["requested_ratio"] == 0)].iterrows():
            if r["method"] in METHODS and METHODS[r["method"]].measured:
                near = min(ratios, key=lambda q: abs((1 - q) - r["budget"]))
                pool = theirs[(theirs["length"] == length) & ((theirs["requested_ratio"] - near).abs() < 1e-6)]
                if not pool.empty:
                    lines.append(f"- {length} tokens, {r['method']} chose {100 * r['budget']:.0f}% KV: {r['score']:.1f} "
                                 f"(best kvpress press at {100 * (1 - near):.0f}% KV: {pool['score'].max():.1f})")
    return "\n".join(lines) + "\n"


def plots(df: pd.DataFrame, out: Path) -> list[Path]:
    """One PNG per task family: score versus KV budget with Wilson 95% intervals, a panel per length, a line per
    method (each method's points shifted a little sideways so the bars stay apart)."""
    plt = _pyplot()
    paths = []
    for fam in [f for f in FAMILIES if f in set(df["family"])]:
        # A real-text family runs at fewer lengths than the needles: a panel per length it has.
        lengths = sorted((df if fam not in REAL_TEXT_FAMILIES else df[df["family"] == fam])["length"].unique())
        fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
        for ax, length in zip(axes[0], lengths):
            part = df[(df["family"] == fam) & (df["length"] == length)]
            for method in _ordered_methods(part):
                rows = part[part["method"] == method].sort_values("budget")
                ours = method in METHODS
                if method == "no_press":
                    ax.axhline(rows["score"].iloc[0], color="k", linewidth=2, label="no press")
                    ax.axhspan(rows["lo"].iloc[0], rows["hi"].iloc[0], color="k", alpha=0.08)
                    continue
                style = "o-" if ours else "s--"
                shift = 0.6 * (_ordered_methods(part).index(method) - len(_ordered_methods(part)) / 2)  # bars apart
                ax.errorbar(100 * rows["budget"] + shift, rows["score"],
                            yerr=[(rows["score"] - rows["lo"]).to_numpy(), (rows["hi"] - rows["score"]).to_numpy()],
                            fmt=style, capsize=2,
                            label=label(method) + (" (ours)" if ours else ""), linewidth=2 if ours else 1,
                            markersize=7 if ours else 4, elinewidth=0.8)
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
        setting = "question-aware" if df["query_aware"].any() else "query-agnostic"
        kind = "Austen text" if fam in REAL_TEXT_FAMILIES else "RULER-style"
        fig.suptitle(f"{model}: accuracy versus KV budget\n{kind}, {fam}, {setting} (bars: Wilson 95%)",
                     fontsize=9)
        fig.tight_layout()
        path = out / f"accuracy_{fam}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def report(out: Path) -> str:
    """One setting's results.csv, plots and table.md (its table and standings)."""
    return _report(out)[0]


def _report(out: Path) -> tuple[str, pd.DataFrame]:
    """:func:`report`'s table, and the collected frame it was made from."""
    configurations = _configurations(out)
    if not configurations:
        raise SystemExit(f"{out}: no results to report (no {out / 'configs'}/*.json; `run` writes them)")
    left_out = incomplete_batches(configurations)
    if left_out:
        print(f"{out}: left out until every method has finished its batch: {', '.join(sorted(left_out))}")
    df = collect(out, configurations)
    df.to_csv(out / "results.csv", index=False)
    needles = ruler_style(df)
    table = (markdown_table(needles) + "\n" + standings(needles) + "\n" if not needles.empty else "") + family_table(df)
    if left_out:  # said where the numbers are read, not only on the terminal of the run that made them
        table = (f"**Partial results**: {len(left_out)} configurations left out until every method has finished "
                 f"their batch (results.csv: `partial`): {', '.join(sorted(left_out))}\n\n" + table)
    (out / "table.md").write_text(table)
    plots(df, out)
    return table, df


def combined_report(settings: dict[str, Path] | None = None, path: Path = DEFAULT_OUT / "report.md",
                    collected: dict[str, pd.DataFrame] | None = None) -> str:
    """``report.md``: the settings' tables side by side, the standings and full-cache agreement of each setting, and
    the streaming perplexity of ``benchmarks/results/streaming_ppl*.json``. ``collected``: the frames of some
    settings already collected (by :func:`report`), which are not read again."""
    settings = settings or {name: folder for name, (folder, _) in SETTINGS.items()}
    collected = collected or {}
    everything = {name: collected[name] if name in collected else collect(folder) for name, folder in settings.items()
                  if (folder / "configs").is_dir()}
    frames = {name: ruler_style(df) for name, df in everything.items()}
    parts = ["Settings: " + "; ".join(f"**{name}**: {SETTINGS[name][1]}" for name in frames if name in SETTINGS),
             "", side_by_side(frames)]
    for name, df in frames.items():
        if not df.empty:
            parts += [f"Standings, {name} (our methods against the best kvpress press):", "", standings(df)]
            parts += [f"Agreement with the full cache, {name}:", "", agreement_table(df)]
    for name, df in everything.items():
        if (table := family_table(df)):
            parts += [f"Beyond needles, {name}:", "", table]
    parts += ["Streaming perplexity on Austen (`benchmarks/bench_streaming_ppl.py`, each file one run of one or "
              "more excerpts (windows) of the text, each from a fresh cache; every press compresses at every step to "
              "m slots; ppl beyond m: over the tokens at positions >= m, pooled over the windows; Δ: difference of "
              "mean NLL per token beyond m, nats, with a 95% paired block-bootstrap interval, blocks of 32 tokens; "
              "a file of one window is the text's opening and has no interval):", "", streaming_table()]
    text = "\n".join(parts)
    path.write_text(text)
    return text


TABLE_BEGIN, TABLE_END = "<!-- evaluation-table: written by kvpress_cpp.evaluation.results report -->", \
    "<!-- /evaluation-table -->"


def update_document(document: Path, table: str) -> bool:
    """Put ``table`` between the markdown document's evaluation-table markers; False when the markers are missing."""
    text = document.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return False
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    document.write_text(f"{head}{TABLE_BEGIN}\n{table.strip()}\n{TABLE_END}{tail}")
    return True


def _known_methods() -> set[str]:
    """The method names evaluate.py accepts: ours and every name of kvpress's PRESS_REGISTRY."""
    _, registry = launch._import_evaluation(launch.evaluation_dir())
    return set(registry.PRESS_REGISTRY) | set(METHODS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["run", "report", "all"], nargs="?", default="all")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default: {DEFAULT_OUT.relative_to(REPO)}, or its question_aware/ with "
                             "--query-aware)")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--device", default=None, help="cpu, cuda:0, ... (default: auto, as evaluate.py)")
    parser.add_argument("--methods", nargs="+", default=["no_press", *KVPRESS_METHODS, *METHODS],
                        help="ours (" + ", ".join(METHODS) + ") or any name of kvpress's PRESS_REGISTRY (default: ours, "
                             "no_press and " + ", ".join(KVPRESS_METHODS) + ")")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS),
                        help="kvpress compression ratios: the fraction of the context removed, in (0, 1); the KV "
                             "budget kept is 1 - ratio (default: 0.9 0.75 0.5, i.e. 10/25/50%% kept)")
    parser.add_argument("--lengths", type=int, nargs="+", default=sorted(DEFAULT_EXAMPLES),
                        help="context lengths in tokens of the model's tokenizer (default: 2048 4096)")
    parser.add_argument("--examples", type=int, default=None,
                        help="examples per task at every length (default: the plan in DEFAULT_EXAMPLES); with "
                             "--families: examples per family and batch, split over its tasks")
    parser.add_argument("--batches", type=int, default=None,
                        help="with --families (only): batches of --examples each, run one after the other for every "
                             "method (pooled in the report), so that a run stopped early still covers every method "
                             "(default: 1)")
    parser.add_argument("--families", nargs="+", default=None, choices=list(FAMILY_TASKS),
                        help="one configuration per family, each on its own data (default: every task of the plan "
                             "in one configuration)")
    parser.add_argument("--query-aware", action="store_true",
                        help="question-aware: the question is part of the compressed prompt (kvpress's query_aware); "
                             f"default --out {QUESTION_AWARE_OUT.relative_to(REPO)}")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads of each process (default: torch's, shared among the --workers)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes running configurations side by side, each loading the model once")
    parser.add_argument("--local_data", type=Path, default=None)
    parser.add_argument("--document", "--readme", type=Path, default=None,
                        help="also write the report into this markdown file, between its evaluation-table markers "
                             "(make eval: docs/evaluation.md)")
    args = parser.parse_args()
    args.out = args.out or (QUESTION_AWARE_OUT if args.query_aware else DEFAULT_OUT)
    # A count of 0 read as "not given" ran the default plan (--examples 0) or the torch default (--threads 0), and a
    # negative one reached the data generator: refused here, before any data or model is loaded.
    for name in ("examples", "batches", "threads"):
        if (value := getattr(args, name)) is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if bad := [n for n in args.lengths if n < 1]:
        parser.error(f"--lengths are context lengths in tokens, at least 1: got {bad}")
    if args.batches is not None and not args.families:  # the whole plan is one configuration per length: no batches
        parser.error("--batches needs --families (batches split each family's examples; without --families every "
                     "task of a length runs in one configuration)")
    if args.families and not args.examples:
        parser.error("--families needs --examples (examples per family)")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if bad := [r for r in args.ratios if not 0 < r < 1]:
        parser.error(f"--ratios are kvpress's compression ratios, the fraction of the context removed, in (0, 1) "
                     f"(0.75 keeps 25%): got {bad}")
    if len({f"{r:.2f}" for r in args.ratios}) < len(args.ratios):  # Config.key and evaluate.py's folders use :.2f
        parser.error(f"--ratios must differ at two decimals (results are filed under the ratio to two decimals, as "
                     f"evaluate.py files them): got {args.ratios}")
    if args.model != DEFAULT_MODEL_NAME and (problem := local_model_problem(args.model)):
        parser.error(f"--model {args.model}: {problem}")
    if args.action in ("report", "all") and args.document is not None and not args.document.is_file():
        parser.error(f"--document {args.document}: no such file")  # else found missing after the report's files
    if args.action in ("run", "all") and (clash := other_setting(args.out, args.query_aware)):
        parser.error(clash)
    if args.action in ("run", "all") and (unknown := [m for m in args.methods if m not in _known_methods()]):
        parser.error(f"--methods: unknown {unknown}; ours: {', '.join(METHODS)}; kvpress's: any name of its "
                     f"PRESS_REGISTRY, e.g. {', '.join(['no_press', *KVPRESS_METHODS])}")
    if args.threads or args.workers > 1:
        import torch

        # Without --threads, the workers share the cores torch would give one process.
        torch.set_num_threads(args.threads or max(1, torch.get_num_threads() // args.workers))
    if args.action in ("run", "all"):
        from kvpress_cpp.evaluation.ruler_data import default_tasks

        configs = plan(args.methods, args.ratios, args.lengths, args.families, args.batches or 1)
        if args.families:
            examples = family_examples(configs, args.examples)
        elif args.examples is not None:
            examples = {str(n): {t: args.examples for t in default_tasks()} for n in args.lengths}
        else:
            examples = {str(n): DEFAULT_EXAMPLES.get(n, DEFAULT_EXAMPLES[max(DEFAULT_EXAMPLES)]) for n in args.lengths}
        try:
            written = run(configs, args.out, args.model, args.device, examples, local_data=args.local_data,
                          query_aware=args.query_aware, workers=args.workers)
        except LengthTooShort as error:  # from the data, generated before any configuration runs
            parser.error(f"--lengths {error.length}: {error}")
        failed = len(configs) - len(written)
    if args.action in ("report", "all"):
        try:
            if args.out.resolve() in (DEFAULT_OUT, QUESTION_AWARE_OUT):  # the committed settings: both, side by side
                collected = {name: _report(folder)[1] for name, (folder, _) in SETTINGS.items()
                             if (folder / "configs").is_dir()}
                table = combined_report(collected=collected) if collected else report(args.out)
            else:
                table = report(args.out)
        except FolderConflict as error:
            raise SystemExit(f"results {args.action}: {error}") from None
        print(table)
        if args.document is not None and not update_document(args.document, table):
            raise SystemExit(f"{args.document} has no {TABLE_BEGIN} ... {TABLE_END} markers")
    if args.action in ("run", "all") and failed:
        raise SystemExit(f"{failed} of {len(configs)} configurations failed (tracebacks above); rerun to retry them")


if __name__ == "__main__":
    main()
