"""Run kvpress's own evaluation (``evaluation/evaluate.py`` of kvpress's source distribution, unchanged) with our
presses registered.

    python -m kvpress_cpp.evaluation.launch --press_name zsmerge --compression_ratio 0.75 \\
        --dataset kvcomp_ruler --data_dir 2048 --fraction 0.1 --output_dir results

Every argument is evaluate.py's own (``EvaluationConfig``: press_name, compression_ratio, dataset, data_dir, model,
device, fraction, max_new_tokens, target_size, compression_interval, output_dir, ...), except ``--local_data``
(below). Without ``--config_file`` the defaults are this package's ``evaluate_config.yaml`` (the embedded
SmolLM2-135M-Instruct on the CPU, our generated RULER-style data at 2048 tokens) instead of kvpress's; what the file
leaves out is evaluate.py's own default (``EvaluationConfig``), and a ``--config_file`` that does not exist is refused.

What the launcher does, in order:

1. Fetches kvpress's sdist (``pip download --no-deps --no-binary :all: kvpress==<installed version>``) once,
   checks its sha256 (for 0.5.5) and keeps its ``evaluation/`` and ``tests/`` folders in
   ``$KVPRESS_CPP_CACHE/kvpress-sdist/<version>`` (:func:`kvpress_source_dir`).
2. Imports ``evaluate_registry`` and ``evaluate`` from there (their ``benchmarks`` package is kvpress's, not this
   repository's: the import is done with kvpress's folder first on ``sys.path`` and this repository's
   ``benchmarks`` modules, if loaded, set aside meanwhile).
3. Adds our presses to ``PRESS_REGISTRY`` (names in :data:`kvpress_cpp.evaluation.registry.METHODS`), adds the
   dataset ``kvcomp_ruler`` (generated on demand, :mod:`kvpress_cpp.evaluation.ruler_data`) with kvpress's RULER
   scorer, and points the hub datasets of ``DATASET_REGISTRY`` at local copies where they exist:
   ``<local_data>/<hub id>`` (e.g. ``<local_data>/simonjegou/ruler/4096/test-*.parquet``,
   ``<local_data>/Xnhyacinth/LongBench/narrativeqa/test-*.parquet``).
4. Replaces the module-level ``pipeline`` evaluate.py calls by :func:`kvpress_cpp.evaluation.models.kvpress_pipeline`
   (which also knows the embedded default model by name and loads each model once per process), then calls
   evaluate.py's ``CliEntryPoint`` as its ``__main__`` does.
5. Runs our presses that compress while decoding one question per pipeline call, as evaluate.py runs kvpress's
   ``DecodingPress`` (:func:`_one_question_per_call_for_decoding_presses`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

from kvpress_cpp._cache import AssetError, cache_dir, run_fetch, sha256_of

__all__ = ["kvpress_source_dir", "evaluation_dir", "load_evaluation", "main", "CONFIG_FILE", "GENERATED_DATASET"]

#: sha256 of the sdists this code was checked against; other versions are fetched unchecked.
_SDIST_SHA256 = {"0.5.5": "0a5aa714c59c63a0f26588378e3bc9890a55f761a30efd1ad1b6623adb8b5296"}
CONFIG_FILE = Path(__file__).with_name("evaluate_config.yaml")
GENERATED_DATASET = "kvcomp_ruler"
#: Examples per task when the launcher generates a missing ``kvcomp_ruler`` length itself.
GENERATED_EXAMPLES = 4


def _kvpress_version() -> str:
    from importlib.metadata import version

    return version("kvpress")


#: The folders of kvpress's sdist that its wheel leaves out and this package uses: ``evaluation/`` (the launcher)
#: and ``tests/`` (kvpress's own test suite, run on our presses by ``tests/kvpress_suite``).
SDIST_FOLDERS = ("evaluation", "tests")


def kvpress_source_dir(version: str | None = None) -> Path:
    """A folder holding the ``evaluation/`` and ``tests/`` folders of kvpress's sdist for ``version`` (default: the
    installed kvpress), fetched once (``pip download``, sha256-checked) into ``$KVPRESS_CPP_CACHE/kvpress-sdist``."""
    version = version or _kvpress_version()
    root = cache_dir("kvpress-sdist")
    target = root / version
    if all((target / folder).is_dir() for folder in SDIST_FOLDERS):
        return target
    hint = "Check the connection to PyPI, or set KVPRESS_CPP_CACHE to a cache that holds kvpress-sdist/."
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
        tmp_dir = Path(tmp)
        run_fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "--no-input", f"kvpress=={version}", "-d", str(tmp_dir)],
                  f"kvpress {version}'s source distribution (for its evaluation and tests folders)", hint)
        sdists = sorted(tmp_dir.glob("kvpress-*.tar.gz"))
        if len(sdists) != 1:
            raise AssetError(f"`pip download kvpress=={version}` left {[p.name for p in tmp_dir.iterdir()]}. {hint}")
        expected = _SDIST_SHA256.get(version)
        if expected is not None and sha256_of(sdists[0]) != expected:
            raise AssetError(f"{sdists[0].name} has sha256 {sha256_of(sdists[0])}, expected {expected}. Retry.")
        prefix = f"kvpress-{version}/"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())
                       and m.name[len(prefix):].split("/")[0] in SDIST_FOLDERS]
            for member in members:
                member.name = member.name[len(prefix):]
            tar.extractall(tmp_dir / "source", members=members, filter="data")
        missing = [f"{prefix}{folder}/" for folder in SDIST_FOLDERS if not (tmp_dir / "source" / folder).is_dir()]
        if missing:
            raise AssetError(f"{sdists[0].name} has no {', '.join(missing)}")
        try:
            os.replace(tmp_dir / "source", target)
        except OSError:
            if not all((target / folder).is_dir() for folder in SDIST_FOLDERS):  # not a concurrent fetch that won
                raise
    return target


def evaluation_dir(version: str | None = None) -> Path:
    """kvpress's ``evaluation/`` folder for ``version`` (default: the installed kvpress), fetched once."""
    return kvpress_source_dir(version) / "evaluation"


def _is_ours(name: str) -> bool:
    return name == "benchmarks" or name.startswith("benchmarks.")


def _import_evaluation(folder: Path) -> tuple[ModuleType, ModuleType]:
    """(evaluate, evaluate_registry) imported from kvpress's folder, with its `benchmarks` package."""
    if "evaluate_registry" in sys.modules and "kvpress_evaluate" in sys.modules:
        return sys.modules["kvpress_evaluate"], sys.modules["evaluate_registry"]
    set_aside = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_ours(name)}
    sys.path.insert(0, str(folder))
    try:
        registry = importlib.import_module("evaluate_registry")
        spec = importlib.util.spec_from_file_location("kvpress_evaluate", folder / "evaluate.py")
        evaluate = importlib.util.module_from_spec(spec)
        sys.modules["kvpress_evaluate"] = evaluate
        spec.loader.exec_module(evaluate)
    except ModuleNotFoundError as error:  # kvpress's scorers' own imports (jieba, rouge, ...)
        sys.modules.pop("kvpress_evaluate", None)
        raise SystemExit(f"kvpress's evaluation needs {error.name!r}, which is not installed: pip install "
                         f"'kvpress_cpp[evaluation]' (the packages of setup.py's evaluation extra)") from error
    finally:
        sys.path.remove(str(folder))
        for name in [n for n in sys.modules if _is_ours(n)]:
            del sys.modules[name]  # kvpress's, still referenced by the modules that imported them
        sys.modules.update(set_aside)
    return evaluate, registry


def _model_slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", model)


def generated_root(local_data: Path, model: str) -> Path:
    """Where ``kvcomp_ruler`` lives for a model's tokenizer: ``<local_data>/kvcomp_ruler/<model>``."""
    return Path(local_data) / GENERATED_DATASET / _model_slug(model)


def ensure_generated(local_data: Path, model: str, length: int, examples: int = GENERATED_EXAMPLES,
                     seed: int = 0) -> Path:
    """Generate ``kvcomp_ruler`` at ``length`` tokens for ``model``'s tokenizer unless it is there."""
    root = generated_root(local_data, model)
    if not (root / str(length) / "test.parquet").is_file():
        from kvpress_cpp.evaluation.models import load_tokenizer
        from kvpress_cpp.evaluation.ruler_data import generate, write_dataset

        write_dataset(generate(load_tokenizer(model), length, examples, seed), root)
    return root


def load_evaluation(local_data: Path | None = None, model: str | None = None) -> tuple[ModuleType, ModuleType]:
    """kvpress's evaluate module, ready to run with our presses, datasets and model names (see module doc)."""
    from kvpress_cpp.evaluation.models import DEFAULT_MODEL_NAME, kvpress_pipeline
    from kvpress_cpp.evaluation.registry import press_registry

    evaluate, registry = _import_evaluation(evaluation_dir())
    registry.PRESS_REGISTRY.update(press_registry())
    local_data = Path(local_data) if local_data else cache_dir("datasets")
    for name, hub_id in list(registry.DATASET_REGISTRY.items()):
        if (local_data / hub_id).is_dir():
            registry.DATASET_REGISTRY[name] = str(local_data / hub_id)
    registry.DATASET_REGISTRY[GENERATED_DATASET] = str(generated_root(local_data, model or DEFAULT_MODEL_NAME))
    registry.SCORER_REGISTRY[GENERATED_DATASET] = registry.SCORER_REGISTRY["ruler"]
    evaluate.pipeline = kvpress_pipeline
    _one_question_per_call_for_decoding_presses(evaluate)
    return evaluate, registry


def _one_question_per_call_for_decoding_presses(evaluate: ModuleType) -> None:
    """Make evaluate.py's inference run our presses that compress while decoding on one question per pipeline call.

    evaluate.py asks one question per call only with kvpress's ``DecodingPress`` and sends every other press all the
    questions on a context at once, which the pipeline refuses for ours (the cache an answer was decoded into no
    longer holds the context as compressed: ``kvpress_adapters.patch_pipeline_questions``), so a dataset with
    several questions per context (LooGLE) stopped the run. Those presses go through evaluate.py's own loop for
    ``DecodingPress``, and each row gets the ratio its call measured, as the grouped loop records it. Idempotent."""
    from kvpress_cpp.kvpress_adapters import _adapt
    from kvpress_cpp.presses.base import KVCompDecodingPress

    def one_question_per_call(run_inference):
        def adapted_run_inference(self):
            if not isinstance(self.press, KVCompDecodingPress):
                return run_inference(self)
            pipeline, decoding_press, ratios = self.pipeline, evaluate.DecodingPress, []

            def one_question(*args, **kwargs):
                output = pipeline(*args, **kwargs)
                ratios.append(self.press.compression_ratio)
                return output

            # evaluate.py reads its module's DecodingPress when it chooses the loop: ours join it for this run only.
            self.pipeline, evaluate.DecodingPress = one_question, (decoding_press, type(self.press))
            try:
                run_inference(self)
            finally:
                self.pipeline, evaluate.DecodingPress = pipeline, decoding_press
            self.df["compression_ratio"] = ratios  # the loop visits the rows in order, one call each

        return adapted_run_inference

    _adapt(evaluate.EvaluationRunner, "_run_inference", one_question_per_call)


def main(argv: list[str] | None = None) -> None:
    import yaml

    from kvpress_cpp.evaluation.ruler_data import LengthTooShort
    from kvpress_cpp.models import DEFAULT_MODEL_NAME, local_model_problem

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # evaluate.py's Fire passes help=True on to EvaluationConfig, which refuses it
        print(__doc__)
        print("evaluate.py's arguments (--name value), with this package's defaults from", CONFIG_FILE, ":\n")
        print(CONFIG_FILE.read_text())
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--local_data", default=None, help="root of local dataset copies (default: "
                        "$KVPRESS_CPP_CACHE/datasets)")
    parser.add_argument("--config_file", default=str(CONFIG_FILE))
    parser.add_argument("--model", default=None)
    parser.add_argument("--dataset", default=None)
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--press_name", default=None)
    parser.add_argument("--compression_ratio", type=float, default=None)
    ours, rest = parser.parse_known_args(argv)
    if not Path(ours.config_file).is_file():  # it replaces the package's defaults: a typo had left none at all
        raise SystemExit(f"--config_file {ours.config_file}: no such file")
    defaults = yaml.safe_load(Path(ours.config_file).read_text()) or {}
    model = ours.model or defaults.get("model")
    dataset, data_dir = ours.dataset or defaults.get("dataset"), ours.data_dir or defaults.get("data_dir")
    if model is None or dataset is None:  # evaluate.py then runs its EvaluationConfig's own: so do the checks below
        config = _import_evaluation(evaluation_dir())[0].EvaluationConfig
        model, dataset = model or config.model, dataset or config.dataset
    if model != DEFAULT_MODEL_NAME and (problem := local_model_problem(model)):
        raise SystemExit(f"--model {model}: {problem}")
    local_data = Path(ours.local_data) if ours.local_data else cache_dir("datasets")
    evaluate, registry = load_evaluation(local_data, model)
    press_name = ours.press_name or defaults.get("press_name")
    if press_name is not None and press_name not in registry.PRESS_REGISTRY:  # evaluate.py: a bare assert
        raise SystemExit(f"--press_name {press_name!r} is not one evaluate.py knows: "
                         f"{', '.join(sorted(registry.PRESS_REGISTRY))}")
    if ours.compression_ratio is not None and not 0 <= ours.compression_ratio < 1:  # else a traceback of the press's
        raise SystemExit(f"--compression_ratio is the fraction of the context removed, in [0, 1) (0.75 keeps 25%): "
                         f"got {ours.compression_ratio}")
    if dataset not in registry.DATASET_REGISTRY:  # evaluate.py would stop on a bare assert
        raise SystemExit(f"--dataset {dataset!r} is not one evaluate.py knows: "
                         f"{', '.join(sorted(registry.DATASET_REGISTRY))}")
    if dataset == GENERATED_DATASET and data_dir is not None and not (
            generated_root(local_data, model) / str(data_dir)).is_dir():
        if not str(data_dir).isdigit():  # e.g. the results runner's "2048-niah0", which only the runner generates
            raise SystemExit(f"{GENERATED_DATASET}: no {generated_root(local_data, model) / str(data_dir)}; a "
                             f"--data_dir that is not a length is written by kvpress_cpp.evaluation.results")
        try:
            ensure_generated(local_data, model, int(data_dir))
        except LengthTooShort as error:
            raise SystemExit(f"--data_dir {data_dir}: {error}") from None
    elif dataset in registry.DATASET_REGISTRY and os.environ.get("HF_HUB_OFFLINE") == "1" and not Path(
            registry.DATASET_REGISTRY[dataset]).is_dir():
        raise SystemExit(f"{dataset}: no local copy at {local_data / registry.DATASET_REGISTRY[dataset]} and "
                         f"HF_HUB_OFFLINE=1 (docs/evaluation.md gives the expected layout)")
    forwarded = [f"--config_file={ours.config_file}"] + rest
    for key in ("model", "dataset", "data_dir", "press_name", "compression_ratio"):
        if getattr(ours, key) is not None:
            forwarded.append(f"--{key}={getattr(ours, key)}")
    sys.argv = [str(evaluation_dir() / "evaluate.py")] + forwarded
    evaluate.Fire(evaluate.CliEntryPoint)


if __name__ == "__main__":
    main()
