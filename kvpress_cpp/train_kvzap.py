"""Train KVzap surrogates: compute KVzip+ targets on local text and fit per-layer linear and MLP models.

``python -m kvpress_cpp.train_kvzap --out DIR`` (see ``--help``) runs three steps.

1. **KVzip+ targets** (KVzap paper, eq. 3). Each chunk ``p`` of local text becomes the prompt
   ``user: <p>\\n\\nRepeat the previous context exactly.`` / ``assistant: <p>`` (rendered with the tokenizer's chat
   template; ``p`` is tokenised once, so both copies hold the same ids). One forward pass of the model's decoder with
   its own attention (sdpa); forward hooks on every attention module recompute the repeated copy's queries and the keys
   from the attention input and form only the repeated rows' log-probabilities (never the whole (Hq, T, T) matrix),
   in row blocks. For context token i and kv head g::

       s_i = max_{j in repeated copy of p} max_{h in group(g)} a^h_ji * ||W_O^h v_i|| / ||h_j||

   ``a^h`` is query head h's softmax attention (over all keys of the prompt, causal), ``W_O^h`` the columns of
   ``o_proj`` that read head h's output (no bias), ``v_i`` the value of token i for h's kv head. ``h_j`` is by default
   the normalised attention input at row j (the layer's ``input_layernorm`` output), as kvpress's
   ``KVzipPress(kvzip_plus_normalization=True)`` (the authors' code) does; this puts log s on the paper's τ
   scale. ``--h-norm residual`` uses instead the residual stream entering the layer (the decoder layer's input), the
   ``h_j`` of the paper's eq. 2 ``h_j^out = h_j + sum_i a_ji W_O v_i``, whose log-scores sit ~3 nats lower. The
   regression target is ``log s_i``, shape (T_ctx, H) per layer; the regression input is the attention input at token
   i (the ``hidden_states`` that KVzap's surrogate reads at inference), shape (T_ctx, D). Chunks are collected in a
   shuffled order (texts and held-out chunks evenly spread), each saved to ``--data-cache`` as it is done, so a run
   resumes where it stopped and ``--fit-collected`` fits on what a stopped run collected.
2. **Fits**, per layer: ridge regression (closed form, float64, unpenalised intercept, λ chosen on an inner split of
   the training chunks) and an MLP ``D -> D/8 -> GELU -> H`` (AdamW on MSE, inputs and targets standardised during
   training and folded back into the weights). Held-out chunks (not random tokens) give the validation R²:
   squared Pearson correlation per (layer, head), the paper's metric; the coefficient of determination is reported too.
3. **Output** in kvpress's ``KVzapModel`` layout, float32: ``<out>/linear/`` and ``<out>/mlp/`` (config.json +
   model.safetensors), ``<out>/training_report.json`` (settings, data sizes, λ, R² per layer and head, quantiles of
   the targets and of the predicted log-scores on held-out text, timings) and ``<out>/r2_per_layer.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from kvpress_cpp.models import DEFAULT_MODEL_NAME, NO_HUB_KERNELS, local_model_problem
from kvpress_cpp.presses.kvzap import load_surrogate, save_surrogate

__all__ = [
    "REPEAT_INSTRUCTION",
    "RepeatPrompt",
    "build_repeat_prompt",
    "kvzip_plus_targets",
    "sample_chunks",
    "ChunkPlan",
    "plan_chunks",
    "collect_dataset",
    "cached_chunks",
    "load_data_cache",
    "fit_ridge",
    "select_ridge",
    "train_mlp",
    "train_mlps",
    "r2_scores",
    "build_kvzap_model",
    "train_surrogates",
    "main",
]

#: The instruction closing the user turn, as in the paper and kvpress's KVzipPress.
REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
#: Floor applied to s before the log: a softmax probability that underflowed to 0 gives log s = log(tiny) ~ -87.3.
SCORE_FLOOR = torch.finfo(torch.float32).tiny
#: Quantiles reported for targets and predictions (for choosing KVzap's threshold τ).
QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
H_NORMS = ("residual", "attention-input")


# ---------------------------------------------------------------------------------------------------------------------
# Step 1: KVzip+ targets
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of one repeat prompt and where the two copies of the context sit in it.

    ``input_ids``: (1, T). ``context``: positions of the user's copy of p; ``repeat``: positions of the assistant's
    copy (same length, same ids). The prompt ends with the repeated copy (later tokens cannot change causal attention).
    """

    input_ids: torch.Tensor
    context: range
    repeat: range


def _template_pieces(tokenizer) -> tuple[str, str]:
    """(text before the context, text between the context and its repetition), from the chat template if any."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "user: ", REPEAT_INSTRUCTION + "\nassistant: "
    mark_user, mark_assistant = "\x00KVZAP_CONTEXT\x00", "\x00KVZAP_REPEAT\x00"
    messages = [
        {"role": "user", "content": mark_user + REPEAT_INSTRUCTION},
        {"role": "assistant", "content": mark_assistant},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    if rendered.count(mark_user) != 1 or rendered.count(mark_assistant) != 1:
        raise ValueError("train_kvzap: the chat template does not copy message contents verbatim")
    before, rest = rendered.split(mark_user)
    middle, _ = rest.split(mark_assistant)
    return before, middle


def build_repeat_prompt(tokenizer, context_ids: Sequence[int]) -> RepeatPrompt:
    """The KVzip repeat prompt around ``context_ids`` (a list of token ids, tokenised without special tokens)."""
    if len(context_ids) == 0:
        raise ValueError("train_kvzap.build_repeat_prompt: empty context")
    before, middle = _template_pieces(tokenizer)
    before_ids = tokenizer.encode(before, add_special_tokens=False)
    middle_ids = tokenizer.encode(middle, add_special_tokens=False)
    ids = list(before_ids) + list(context_ids) + list(middle_ids) + list(context_ids)
    n, c0 = len(context_ids), len(before_ids)
    r0 = c0 + n + len(middle_ids)
    return RepeatPrompt(torch.tensor([ids], dtype=torch.long), range(c0, c0 + n), range(r0, r0 + n))


def _decoder(model) -> nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def _decoder_layers(model) -> nn.ModuleList:
    layers = getattr(_decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"train_kvzap: cannot find the decoder layers of {type(model).__name__}")
    return layers


def _value_output_norms(attn: nn.Module, hidden: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """||W_O^h v_i|| for every query head h: (n, Hq) float32. ``hidden`` (n, D) is the attention input."""
    head_dim = attn.head_dim
    v = attn.v_proj(hidden).float().view(-1, n_kv, head_dim)  # (n, H, d)
    v = v.repeat_interleave(n_heads // n_kv, dim=1)  # (n, Hq, d): query head h reads kv head h // G
    wo = attn.o_proj.weight.float().view(-1, n_heads, head_dim)  # (D, Hq, d)
    gram = torch.einsum("khd,khe->hde", wo, wo)  # W_O^h^T W_O^h: (Hq, d, d)
    sq = torch.einsum("nhd,hde,nhe->nh", v, gram, v)
    return sq.clamp_min(0).sqrt()


def _rotated_heads(attn: nn.Module, hidden: torch.Tensor, rows: slice, which: str, position_embeddings) -> torch.Tensor:
    """Queries (``which="q"``) or keys (``"k"``) of ``rows`` as the attention module computes them: projection,
    per-head norm if the model has one (Qwen3's q_norm/k_norm), rotary embedding. Returns (heads, rows, d) float32."""
    if getattr(attn, "sliding_window", None) is not None:
        raise ValueError("train_kvzap: KVzip+ targets assume full causal attention, not a sliding window")
    x = getattr(attn, f"{which}_proj")(hidden[rows])
    x = x.view(1, x.shape[0], -1, attn.head_dim)
    norm = getattr(attn, f"{which}_norm", None)
    if norm is not None:
        x = norm(x)
    x = x.transpose(1, 2)
    cos, sin = position_embeddings
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    x, _ = rotate(x, x, cos[:, rows], sin[:, rows])
    return x[0].float()


def _layer_log_scores(
    attn: nn.Module,
    hidden: torch.Tensor,
    position_embeddings,
    log_h_norm: torch.Tensor,
    prompt: RepeatPrompt,
    n_heads: int,
    n_kv: int,
    row_block: int,
) -> torch.Tensor:
    """log KVzip+ scores (n, H) of one layer from its attention input ``hidden`` (T, D) and log ||h_j|| (n,) of the
    repeated rows.

    Only the repeated rows' attention is formed (the rest of the (Hq, T, T) matrix never is), in blocks of
    ``row_block`` rows: log a_ji = q_j k_i scale - logsumexp over the causal keys of row j, then the max over rows of
    log a_ji - log ||h_j|| in log space, plus log ||W_O^h v_i||, then the max over the kv group's query heads.
    """
    c, r = prompt.context, prompt.repeat
    group = n_heads // n_kv
    keys = _rotated_heads(attn, hidden, slice(0, r.stop), "k", position_embeddings).repeat_interleave(group, dim=0)
    best = torch.full((n_heads, len(c)), -math.inf, dtype=torch.float32, device=hidden.device)
    for start in range(0, len(r), row_block):
        stop = min(start + row_block, len(r))
        rows = slice(r.start + start, r.start + stop)
        queries = _rotated_heads(attn, hidden, rows, "q", position_embeddings)  # (Hq, b, d)
        logits = torch.matmul(queries, keys[:, : rows.stop].transpose(1, 2)) * attn.scaling  # (Hq, b, rows.stop)
        row_pos = torch.arange(rows.start, rows.stop, device=hidden.device)
        future = torch.arange(rows.stop, device=hidden.device)[None, :] > row_pos[:, None]
        logits.masked_fill_(future, -math.inf)
        log_probs = logits[:, :, c.start : c.stop] - logits.logsumexp(-1, keepdim=True)
        best = torch.maximum(best, (log_probs - log_h_norm[start:stop].view(1, -1, 1)).amax(dim=1))
    log_wov = _value_output_norms(attn, hidden[c.start : c.stop], n_heads, n_kv).log()  # (n, Hq)
    per_query_head = best + log_wov.T  # (Hq, n)
    return per_query_head.view(n_kv, group, -1).amax(dim=1).T.contiguous()


@torch.inference_mode()
def kvzip_plus_targets(
    model, prompt: RepeatPrompt, h_norm: str = "attention-input", row_block: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Surrogate inputs and KVzip+ log-scores of the context tokens of ``prompt``, for every layer.

    Returns ``(features, log_scores)``: features (L, n, D) are the attention inputs (``input_layernorm`` outputs) at
    the n context tokens; log_scores (L, n, H) are ``max(log s_i, log SCORE_FLOOR)`` with s the KVzip+ score of the
    module docstring; both float32 on the model's device. ``h_norm`` picks ``h_j``: "attention-input" (the normalised
    attention input, as kvpress's KVzipPress) or "residual" (the layer input of the paper's eq. 2). The model's
    decoder runs once with its own attention implementation (sdpa is fastest); forward hooks on the attention modules
    recompute the repeated rows' queries and the keys from the attention input and form only those rows'
    probabilities.
    """
    if h_norm not in H_NORMS:
        raise ValueError(f"train_kvzap.kvzip_plus_targets: h_norm must be one of {H_NORMS}, got {h_norm!r}")
    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    layers = _decoder_layers(model)
    c, r = prompt.context, prompt.repeat
    features: list[torch.Tensor | None] = [None] * len(layers)
    scores: list[torch.Tensor | None] = [None] * len(layers)
    residual_norms: list[torch.Tensor | None] = [None] * len(layers)
    log_floor = math.log(SCORE_FLOOR)

    def layer_pre_hook(idx):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            residual_norms[idx] = hidden[0, r.start : r.stop].float().norm(dim=-1)

        return hook

    def attention_hook(idx):
        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"][0]  # (T, D), the normalised attention input
            if h_norm == "residual":
                norms = residual_norms[idx]
            else:
                norms = hidden[r.start : r.stop].float().norm(dim=-1)
            s = _layer_log_scores(
                module, hidden, kwargs["position_embeddings"], norms.log(), prompt, n_heads, n_kv, row_block
            )
            scores[idx] = s.clamp_min(log_floor)
            features[idx] = hidden[c.start : c.stop].float().clone()
            residual_norms[idx] = None

        return hook

    handles = []
    try:
        for idx, layer in enumerate(layers):
            if h_norm == "residual":
                handles.append(layer.register_forward_pre_hook(layer_pre_hook(idx), with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(attention_hook(idx), with_kwargs=True))
        device = next(model.parameters()).device
        _decoder(model)(input_ids=prompt.input_ids.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(features), torch.stack(scores)


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------


#: The texts known by name: their loaders in kvpress_cpp.texts (the six Austen novels, the Python 3.11 docs sources).
NAMED_TEXTS = {"austen": "austen_text", "python-docs": "python_docs_text"}


def unknown_text(name: str) -> bool:
    """Whether :func:`load_text` refuses ``name``: neither a named text nor a file."""
    return name not in NAMED_TEXTS and not Path(name).is_file()


def load_text(name: str) -> str:
    """A text of :data:`NAMED_TEXTS` or the path of a UTF-8 text file."""
    if unknown_text(name):
        raise ValueError(f"train_kvzap: unknown text {name!r} (use {', '.join(NAMED_TEXTS)} or a file path)")
    if name in NAMED_TEXTS:
        from kvpress_cpp import texts

        return getattr(texts, NAMED_TEXTS[name])()
    text, problem = _read_text_file(name)
    if problem:
        raise ValueError(f"train_kvzap: --texts {name}: {problem}")
    return text


def text_file_problem(path: str) -> str | None:
    """Why the file at `path` gives no text to train on (not UTF-8, nothing but white space), or None."""
    return _read_text_file(path)[1]


def text_file_digests(names: Sequence[str]) -> dict[str, str]:
    """The sha256 of each file among the --texts `names` that exists (a named text is fixed by its Debian package):
    a --data-cache holding targets of a file's earlier contents is then refused, not reused."""
    return {name: hashlib.sha256(Path(name).read_bytes()).hexdigest()
            for name in names if name not in NAMED_TEXTS and Path(name).is_file()}


def _read_text_file(path: str) -> tuple[str, str | None]:
    """The text of the file at `path` (read once), and :func:`text_file_problem`'s answer."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        return "", f"not UTF-8 text ({error.reason} at byte {error.start})"
    return text, None if text.strip() else "the file holds no text"


def sample_chunks(tokenizer, text: str, n_chunks: int, context_tokens: int, rng: random.Random,
                  source: str = "the text") -> list[list[int]]:
    """``n_chunks`` non-overlapping chunks of exactly ``context_tokens`` tokens spread over ``text`` (named `source` in
    the error when it is too short).

    The text is cut into n_chunks equal character segments; each chunk starts at a random point of the first
    ``seg - 8 * context_tokens`` characters of its segment, moved to the next line start if there is one before that
    limit. Chunks therefore never overlap when segments hold 8 characters per token of room (and tokens average at
    most 8 characters); shorter texts still give chunks, possibly overlapping.
    """
    seg = len(text) // max(n_chunks, 1)
    chunks = []
    for k in range(n_chunks):
        lo = k * seg
        need = 8 * context_tokens
        limit = lo + max(1, seg - need)
        start = lo + rng.randrange(limit - lo)
        newline = text.find("\n", start, limit)
        if newline != -1:
            start = newline + 1
        while start < len(text) and text[start] == "\n":
            start += 1
        ids: list[int] = []
        window = need
        while True:
            ids = tokenizer.encode(text[start : start + window], add_special_tokens=False)
            if len(ids) > context_tokens or start + window >= len(text):
                break
            window *= 2
        if len(ids) < context_tokens:
            raise ValueError(
                f"train_kvzap: {source} is too short for {n_chunks} chunks of {context_tokens} tokens "
                f"(chunk {k} has {len(ids)})"
            )
        chunks.append(ids[:context_tokens])
    return chunks


@dataclass
class Dataset:
    """features (L, N, D) float16 (storage), targets (L, N, H) float32, chunk (N,) chunk index of each token,
    plus per-chunk text name and validation flag."""

    features: torch.Tensor
    targets: torch.Tensor
    chunk: torch.Tensor
    chunk_text: list[str]
    chunk_is_val: list[bool]

    def token_mask(self, val: bool) -> torch.Tensor:
        flags = torch.tensor(self.chunk_is_val, dtype=torch.bool)
        return flags[self.chunk] if val else ~flags[self.chunk]


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks to collect, in collection order: token ids, source text name and held-out flag of each."""

    ids: list[list[int]]
    text: list[str]
    is_val: list[bool]


def chunks_per_text(n_tokens: int, context_tokens: int, n_texts: int) -> list[int]:
    """How many chunks of ``context_tokens`` each of ``n_texts`` texts gives to about ``n_tokens`` in all."""
    n_chunks = max(1, n_tokens // context_tokens)
    return [n_chunks // n_texts + (1 if i < n_chunks % n_texts else 0) for i in range(n_texts)]


def plan_chunks(
    tokenizer, texts: dict[str, str], n_tokens: int, context_tokens: int, val_fraction: float, seed: int
) -> ChunkPlan:
    """Sample chunks from ``texts`` (about n_tokens context tokens, split evenly between texts), hold out
    ``val_fraction`` of each text's chunks (at least one), and shuffle their order, so that the chunks collected
    first (a run stopped early) are an even sample of texts and of held-out chunks."""
    rng = random.Random(seed)
    names = list(texts)
    per_text = chunks_per_text(n_tokens, context_tokens, len(names))
    chunks = []
    for name, count in zip(names, per_text):
        if count == 0:
            continue
        ids = sample_chunks(tokenizer, texts[name], count, context_tokens, rng, f"text {name!r}")
        n_val = min(count - 1, max(1, round(val_fraction * count))) if val_fraction > 0 else 0
        val = set(rng.sample(range(count), n_val))
        chunks += [(chunk, name, k in val) for k, chunk in enumerate(ids)]
    rng.shuffle(chunks)
    return ChunkPlan([c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks])


def _chunk_file(cache: Path, k: int) -> Path:
    return cache / f"chunk_{k:05d}.pt"


def _read_cache_index(cache: Path) -> dict:
    return json.loads((cache / "index.json").read_text())


def cached_chunks(cache: str | Path) -> int:
    """How many chunks of a ``--data-cache`` directory are collected (they are collected in plan order)."""
    cache = Path(cache)
    if not (cache / "index.json").is_file():
        return 0
    n = len(_read_cache_index(cache)["text"])
    return sum(_chunk_file(cache, k).is_file() for k in range(n))


def _cache_complete(cache: str | Path | None) -> bool:
    """Whether a ``--data-cache`` directory holds every chunk of its collection (which then replaces it)."""
    return cache is not None and 0 < cached_chunks(cache) == len(_read_cache_index(Path(cache))["text"])


def load_data_cache(cache: str | Path, allow_partial: bool = False) -> tuple[Dataset, dict, float]:
    """(dataset, data settings, seconds the collection took) from a ``--data-cache`` directory written by
    :func:`collect_dataset`. With ``allow_partial`` a collection stopped early gives the chunks collected so far."""
    cache = Path(cache)
    index = _read_cache_index(cache)
    done = [k for k in range(len(index["text"])) if _chunk_file(cache, k).is_file()]
    if len(done) < len(index["text"]) and not allow_partial:
        raise ValueError(f"train_kvzap: {cache} holds {len(done)} of {len(index['text'])} chunks")
    if not any(index["is_val"][k] for k in done) or all(index["is_val"][k] for k in done):
        raise ValueError(f"train_kvzap: the {len(done)} chunks in {cache} lack training or held-out chunks")
    first = torch.load(_chunk_file(cache, done[0]))
    (n_layers, n, dim), n_heads = first["features"].shape, first["targets"].shape[2]
    features = torch.empty(n_layers, n * len(done), dim, dtype=torch.float16)
    targets = torch.empty(n_layers, n * len(done), n_heads, dtype=torch.float32)
    seconds = 0.0
    for pos, k in enumerate(done):
        stored = first if pos == 0 else torch.load(_chunk_file(cache, k))
        features[:, pos * n : (pos + 1) * n] = stored["features"]
        targets[:, pos * n : (pos + 1) * n] = stored["targets"]
        seconds += stored["seconds"]
    data = Dataset(
        features, targets, torch.arange(len(done)).repeat_interleave(n), [index["text"][k] for k in done],
        [index["is_val"][k] for k in done],
    )  # fmt: skip
    return data, index["settings"], seconds


def collect_dataset(
    model,
    tokenizer,
    plan: ChunkPlan,
    h_norm: str = "attention-input",
    progress: bool = True,
    cache: str | Path | None = None,
    settings: dict | None = None,
) -> Dataset:
    """Features and KVzip+ log-scores of every chunk of ``plan``.

    With ``cache`` (a directory), each chunk is saved there as soon as it is computed (with ``settings``, which must
    match those of chunks already there); chunks already saved are not recomputed, so a stopped run resumes."""
    config = model.config
    n_layers, dim, n_kv = config.num_hidden_layers, config.hidden_size, config.num_key_value_heads
    context_tokens = len(plan.ids[0])
    if cache is not None:
        cache = Path(cache)
        cache.mkdir(parents=True, exist_ok=True)
        index = {"settings": settings, "text": plan.text, "is_val": plan.is_val}
        if (cache / "index.json").is_file() and _read_cache_index(cache) != index:
            raise ValueError(f"train_kvzap: {cache} holds chunks for other settings: {_read_cache_index(cache)['settings']}")
        (cache / "index.json").write_text(json.dumps(index))
    total = len(plan.ids) * context_tokens
    features = torch.empty(n_layers, total, dim, dtype=torch.float16)
    targets = torch.empty(n_layers, total, n_kv, dtype=torch.float32)
    for k, ids in enumerate(tqdm(plan.ids, desc="KVzip+ targets", unit="chunk", disable=not progress)):
        sl = slice(k * context_tokens, (k + 1) * context_tokens)
        path = None if cache is None else _chunk_file(cache, k)
        if path is not None and path.is_file():
            stored = torch.load(path)
            features[:, sl], targets[:, sl] = stored["features"], stored["targets"]
            continue
        t0 = time.perf_counter()
        x, y = kvzip_plus_targets(model, build_repeat_prompt(tokenizer, ids), h_norm=h_norm)
        if not torch.isfinite(x.half()).all():
            raise RuntimeError("train_kvzap: attention inputs overflow float16 storage")
        features[:, sl] = x.cpu().half()
        targets[:, sl] = y.cpu()
        if path is not None:
            partial = path.with_suffix(".tmp")
            chunk = {"features": features[:, sl].clone(), "targets": targets[:, sl].clone()}
            torch.save({**chunk, "seconds": time.perf_counter() - t0}, partial)
            partial.rename(path)
    chunk_index = torch.arange(len(plan.ids)).repeat_interleave(context_tokens)
    return Dataset(features, targets, chunk_index, list(plan.text), list(plan.is_val))


# ---------------------------------------------------------------------------------------------------------------------
# Step 2: fits and metrics
# ---------------------------------------------------------------------------------------------------------------------


def r2_scores(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of (N, H) tensors: (squared Pearson correlation, coefficient of determination 1 - SSE/SST)."""
    pred, target = pred.double(), target.double()
    pc, tc = pred - pred.mean(0), target - target.mean(0)
    pearson = (pc * tc).sum(0) / (pc.norm(dim=0) * tc.norm(dim=0)).clamp_min(1e-300)
    sst = (tc**2).sum(0).clamp_min(1e-300)
    cod = 1 - ((pred - target) ** 2).sum(0) / sst
    return (pearson**2).float(), cod.float()


@dataclass
class _Moments:
    """Sums over rows of x - origin and y, float64: count, Σx, Σy, Σ x xᵀ, Σ x yᵀ (enough for a ridge fit)."""

    origin: torch.Tensor
    n: int
    sx: torch.Tensor
    sy: torch.Tensor
    xx: torch.Tensor
    xy: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, y: torch.Tensor, origin: torch.Tensor, block: int = 16384) -> "_Moments":
        d, h = x.shape[1], y.shape[1]
        m = cls(origin, 0, x.new_zeros(d, dtype=torch.float64), x.new_zeros(h, dtype=torch.float64),
                x.new_zeros(d, d, dtype=torch.float64), x.new_zeros(d, h, dtype=torch.float64))  # fmt: skip
        for start in range(0, x.shape[0], block):  # blocks: x may be float16 storage of many rows
            xb, yb = x[start : start + block].double() - origin, y[start : start + block].double()
            m.n += xb.shape[0]
            m.sx += xb.sum(0)
            m.sy += yb.sum(0)
            m.xx += xb.T @ xb
            m.xy += xb.T @ yb
        return m

    def __add__(self, other: "_Moments") -> "_Moments":
        return _Moments(self.origin, self.n + other.n, self.sx + other.sx, self.sy + other.sy, self.xx + other.xx,
                        self.xy + other.xy)  # fmt: skip

    def centred(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean x, mean y, Xcᵀ Xc, Xcᵀ Yc) with the rows centred on their own means."""
        mx, my = self.sx / self.n, self.sy / self.n
        return mx, my, self.xx - self.n * torch.outer(mx, mx), self.xy - self.n * torch.outer(mx, my)

    def ridge(self, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        mx, my, gram, cross = self.centred()
        gram = gram.clone()
        gram.diagonal().add_(lam)
        w = torch.linalg.solve(gram, cross)
        b = my - (mx + self.origin) @ w
        return w.float(), b.float()


def fit_ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression with an unpenalised intercept, in float64.

    Minimises ``||y - x W - b||² + lam ||W||²``; x (N, D), y (N, H). Returns W (D, H) and b (H,) as float32.
    """
    return _Moments.of(x, y, x[:1024].double().mean(0)).ridge(lam)


def select_ridge(
    x: torch.Tensor, y: torch.Tensor, inner_val: torch.Tensor, alphas: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Choose λ = alpha · trace(Xc^T Xc)/D by the MSE on the rows ``inner_val`` (bool, N) of a fit on the others, then
    refit on all rows. Returns (W, b, λ, alpha).

    One pass over x: the moments of the inner and the other rows, whose sum gives the final fit's.
    """
    origin = x[:1024].double().mean(0)
    inner = _Moments.of(x[inner_val], y[inner_val], origin)
    rest = _Moments.of(x[~inner_val], y[~inner_val], origin)
    full = inner + rest
    scale = float(full.centred()[2].diagonal().sum() / x.shape[1])
    best = (math.inf, alphas[0])
    if inner.n > 0 and rest.n > 0 and len(alphas) > 1:
        x_inner, y_inner = x[inner_val].float(), y[inner_val].float()
        for alpha in alphas:
            w, b = rest.ridge(alpha * scale)
            mse = float(((x_inner @ w + b - y_inner) ** 2).mean())
            best = min(best, (mse, alpha))
    alpha = best[1]
    w, b = full.ridge(alpha * scale)
    return w, b, alpha * scale, alpha


def train_mlps(
    x: torch.Tensor,
    y: torch.Tensor,
    hidden_dim: int,
    epochs: int = 10,
    batch_size: int = 256,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
    progress: bool = False,
    x_stop: torch.Tensor | None = None,
    y_stop: torch.Tensor | None = None,
) -> list[nn.Sequential]:
    """Fit one ``Linear(D, hidden) -> GELU -> Linear(hidden, H)`` per layer to (x (L, N, D), y (L, N, H)), AdamW on the
    MSE, all L layers at once (batched matmuls; the loss is the sum of the per-layer mean squared errors, so each
    layer trains as it would alone, on the same minibatch rows).

    With ``x_stop`` (L, M, D) and ``y_stop`` (L, M, H), early stopping: each layer keeps the weights of the epoch with
    the lowest MSE on those rows (which must not be the rows the model is evaluated on).

    x may be float16 (storage); every minibatch is converted to float32. Inputs and targets are standardised per layer
    during training (cosine learning-rate decay, minibatches shuffled by a generator seeded with ``seed``, init seeded
    with ``seed``); the standardisation is folded into the returned float32 modules' weights, so they map raw x to
    raw y.
    """
    n_layers, n, dim = x.shape
    n_out = y.shape[2]
    y = y.float()
    # Per layer: a float32 copy of all of x at once would be twice its float16 storage.
    x_mean = torch.stack([x[layer].float().mean(0, keepdim=True) for layer in range(n_layers)])  # (L, 1, D)
    x_std = torch.stack([x[layer].float().std(0, keepdim=True) for layer in range(n_layers)])
    x_std = torch.where(x_std > 1e-6, x_std, torch.ones_like(x_std))
    y_mean, y_std = y.mean(1, keepdim=True), y.std(1, keepdim=True)
    y_std = torch.where(y_std > 1e-6, y_std, torch.ones_like(y_std))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init = [(nn.Linear(dim, hidden_dim), nn.Linear(hidden_dim, n_out)) for _ in range(n_layers)]
    w1 = nn.Parameter(torch.stack([m[0].weight.detach().T for m in init]))  # (L, D, hidden)
    b1 = nn.Parameter(torch.stack([m[0].bias.detach()[None] for m in init]))  # (L, 1, hidden)
    w2 = nn.Parameter(torch.stack([m[1].weight.detach().T for m in init]))  # (L, hidden, H)
    b2 = nn.Parameter(torch.stack([m[1].bias.detach()[None] for m in init]))  # (L, 1, H)
    opt = torch.optim.AdamW([w1, b1, w2, b2], lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(n / batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * steps_per_epoch))
    gen = torch.Generator().manual_seed(seed)

    def forward(xb: torch.Tensor) -> torch.Tensor:  # standardised x -> standardised y, (L, B, H)
        return torch.baddbmm(b2, nn.functional.gelu(torch.baddbmm(b1, xb, w1)), w2)

    def stop_mse() -> torch.Tensor:  # (L,)
        with torch.no_grad():
            xs = (x_stop.float() - x_mean) / x_std
            return ((forward(xs) - (y_stop.float() - y_mean) / y_std) ** 2).mean(dim=(1, 2))

    best_params = [p.detach().clone() for p in (w1, b1, w2, b2)]
    best_mse = stop_mse() if x_stop is not None else None
    best_epoch = torch.zeros(n_layers, dtype=torch.long)
    bar = tqdm(range(epochs), desc=f"MLP x {n_layers} layers", unit="epoch", disable=not progress, leave=False)
    for epoch in bar:
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            xb = (x[:, idx].float() - x_mean) / x_std
            yb = (y[:, idx] - y_mean) / y_std
            loss = ((forward(xb) - yb) ** 2).mean(dim=(1, 2)).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        postfix = {"loss_per_layer": f"{total / n / n_layers:.4f}"}
        if best_mse is not None:
            mse = stop_mse()
            better = mse < best_mse
            best_mse = torch.where(better, mse, best_mse)
            best_epoch[better] = epoch + 1
            for best, p in zip(best_params, (w1, b1, w2, b2)):
                best[better] = p.detach()[better]
            postfix["stop_mse"] = f"{float(best_mse.mean()):.4f}"
        bar.set_postfix(postfix)
    if best_mse is not None:
        w1, b1, w2, b2 = best_params
    mlps = []
    with torch.no_grad():  # fold the standardisation into the weights
        for layer in range(n_layers):
            mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, n_out))
            mean, std = x_mean[layer, 0], x_std[layer, 0]
            mlp[0].weight.copy_((w1[layer] / std[:, None]).T)
            mlp[0].bias.copy_(b1[layer, 0] - (mean / std) @ w1[layer])
            mlp[2].weight.copy_((w2[layer] * y_std[layer]).T)
            mlp[2].bias.copy_(b2[layer, 0] * y_std[layer, 0] + y_mean[layer, 0])
            mlp.best_epoch = int(best_epoch[layer]) if best_mse is not None else epochs
            mlps.append(mlp.eval())
    return mlps


def train_mlp(x: torch.Tensor, y: torch.Tensor, hidden_dim: int, **kwargs) -> nn.Sequential:
    """:func:`train_mlps` for a single layer: x (N, D), y (N, H)."""
    return train_mlps(x[None], y[None], hidden_dim, **kwargs)[0]


def build_kvzap_model(layers: Sequence[nn.Module], hidden_dim: int | None):
    """A kvpress ``KVzapModel`` (float32) holding ``layers``: nn.Linear (hidden_dim None) or the MLP Sequentials."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    first = layers[0] if hidden_dim is None else layers[0][0]
    last = layers[0] if hidden_dim is None else layers[0][2]
    config = KVzapConfig(
        input_dim=first.in_features, output_dim=last.out_features, n_modules=len(layers), hidden_dim=hidden_dim
    )
    model = KVzapModel(config).float()
    with torch.no_grad():
        for dst, src in zip(model.layers, layers):
            dst.load_state_dict(src.state_dict())
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    values = values.flatten().float()
    if values.numel() > 1_000_000:  # torch.quantile's size limit; an even subsample is plenty
        # integer steps: a float32 linspace rounds its last index up to numel past 2**24 elements
        values = values[torch.arange(1_000_000, dtype=torch.int64) * (values.numel() - 1) // 999_999]
    q = torch.quantile(values, torch.tensor(QUANTILES))
    return {f"{p:g}": round(float(v), 4) for p, v in zip(QUANTILES, q)}


def _summary(r2: torch.Tensor) -> dict:
    """r2 (L, H) -> mean/min/max over layers of the per-layer mean, and the mean over all heads."""
    per_layer = r2.mean(1)
    return {
        "mean": round(float(r2.mean()), 4),
        "layer_mean_min": round(float(per_layer.min()), 4),
        "layer_mean_max": round(float(per_layer.max()), 4),
        "head_min": round(float(r2.min()), 4),
        "head_max": round(float(r2.max()), 4),
    }


def train_surrogates(
    data: Dataset,
    hidden_dim: int,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
    ridge_alphas: Sequence[float] = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0),
    progress: bool = True,
    layers_per_mlp_batch: int = 6,
) -> tuple[list[nn.Linear], list[nn.Sequential], dict]:
    """Fit both surrogates on every layer; returns (linear layers, MLPs, metrics dict).

    ~15% of the training chunks form an inner split: it picks ridge's λ (the final ridge refits on all training
    chunks) and early-stops the MLP (trained on the other training chunks). Metrics use the held-out chunks only.
    """
    train, val = data.token_mask(val=False), data.token_mask(val=True)
    # Inner validation for λ: ~15% of the training chunks (never the held-out ones).
    train_chunks = sorted({int(c) for c in data.chunk[train].unique()})
    rng = random.Random(seed + 1)
    inner = set(rng.sample(train_chunks, max(1, round(0.15 * len(train_chunks))))) if len(train_chunks) > 1 else set()
    inner_val = torch.tensor([int(c) in inner for c in data.chunk[train]], dtype=torch.bool)
    n_layers, n_heads = data.targets.shape[0], data.targets.shape[2]
    linears: list[nn.Linear] = []
    r2 = {k: torch.zeros(n_layers, n_heads) for k in ("linear", "mlp")}
    cod = {k: torch.zeros(n_layers, n_heads) for k in ("linear", "mlp")}
    train_r2 = {k: torch.zeros(n_layers, n_heads) for k in ("linear", "mlp")}
    preds = {k: torch.zeros(n_layers, int(val.sum()), n_heads) for k in ("linear", "mlp")}
    lambdas, alphas = [], []
    for layer in tqdm(range(n_layers), desc="ridge", unit="layer", disable=not progress):
        x_train, y_train = data.features[layer, train], data.targets[layer, train]
        w, b, lam, alpha = select_ridge(x_train, y_train, inner_val, ridge_alphas)
        linear = nn.Linear(w.shape[0], w.shape[1])
        with torch.no_grad():
            linear.weight.copy_(w.T)
            linear.bias.copy_(b)
        linears.append(linear)
        lambdas.append(lam)
        alphas.append(alpha)
    # The MLP trains on the training chunks minus the inner ones and keeps, per layer, its best epoch on the inner
    # ones (early stopping); the held-out chunks stay unseen.
    fit_rows = train.nonzero().squeeze(1)
    fit_rows, stop_rows = fit_rows[~inner_val], fit_rows[inner_val]
    if len(stop_rows) == 0:  # a single training chunk: no early stopping
        fit_rows = train.nonzero().squeeze(1)
    mlps = []
    # A few layers at a time: the selected rows of all layers at once would copy the whole feature store.
    for first in range(0, n_layers, layers_per_mlp_batch):
        group = slice(first, min(first + layers_per_mlp_batch, n_layers))
        x_stop, y_stop = (None, None) if len(stop_rows) == 0 else (
            data.features[group][:, stop_rows], data.targets[group][:, stop_rows]
        )  # fmt: skip
        mlps += train_mlps(
            data.features[group][:, fit_rows], data.targets[group][:, fit_rows], hidden_dim, epochs, batch_size, lr,
            weight_decay, seed, progress, x_stop, y_stop,
        )  # fmt: skip
    for layer in range(n_layers):
        x_train, y_train = data.features[layer, train].float(), data.targets[layer, train]
        x_val, y_val = data.features[layer, val].float(), data.targets[layer, val]
        with torch.no_grad():
            for name, module in (("linear", linears[layer]), ("mlp", mlps[layer])):
                p_val = module(x_val)
                preds[name][layer] = p_val
                r2[name][layer], cod[name][layer] = r2_scores(p_val, y_val)
                train_r2[name][layer] = r2_scores(module(x_train), y_train)[0]
    y_val_all = data.targets[:, val]
    metrics = {
        "r2_metric": "squared Pearson correlation per (layer, kv head) on held-out chunks (the paper's R²)",
        "summary": {k: _summary(r2[k]) for k in r2},
        "summary_coefficient_of_determination": {k: _summary(cod[k]) for k in cod},
        "summary_train": {k: _summary(train_r2[k]) for k in train_r2},
        "r2_head_mean_over_layers": {k: [round(float(v), 4) for v in r2[k].mean(0)] for k in r2},
        "r2": {k: [[round(float(v), 4) for v in row] for row in r2[k]] for k in r2},
        "coefficient_of_determination": {k: [[round(float(v), 4) for v in row] for row in cod[k]] for k in cod},
        "r2_train": {k: [[round(float(v), 4) for v in row] for row in train_r2[k]] for k in train_r2},
        "mlp_best_epoch": [m.best_epoch for m in mlps],
        "ridge_lambda": [round(v, 6) for v in lambdas],
        "ridge_alpha": alphas,
        "target_quantiles": {
            "train": _quantiles(data.targets[:, train]),
            "val": _quantiles(y_val_all),
            "val_per_layer": [_quantiles(y_val_all[layer]) for layer in range(n_layers)],
        },
        "predicted_quantiles_val": {k: _quantiles(preds[k]) for k in preds},
        "predicted_quantiles_val_per_layer": {
            k: [_quantiles(preds[k][layer]) for layer in range(n_layers)] for k in preds
        },
        "n_floored_targets": int((data.targets <= math.log(SCORE_FLOOR) + 1e-3).sum()),
    }
    return linears, mlps, metrics


@torch.no_grad()
def load_surrogates_to_compare(surrogate_root: str | Path, layers: int, hidden_size: int, kv_heads: int) -> dict:
    """{kind: KVzapModel} of the surrogates in ``<surrogate_root>/{linear,mlp}``, refused (ValueError naming the folder
    and the mismatch) unless they map `hidden_size` features to `kv_heads` scores in `layers` layers, as the
    surrogates being trained: checked before the collection and the fit, not after them."""
    shape = SimpleNamespace(config=PretrainedConfig(num_hidden_layers=layers, hidden_size=hidden_size,
                                                    num_key_value_heads=kv_heads))
    try:
        return {kind: load_surrogate(shape, kind, Path(surrogate_root) / kind) for kind in ("linear", "mlp")}
    except ValueError as error:
        raise ValueError(f"train_kvzap: --compare-with {surrogate_root}: {error}") from error


def surrogate_r2(surrogates: dict, data: Dataset) -> dict:
    """R² of existing surrogates ({kind: KVzapModel}, :func:`load_surrogates_to_compare`) on ``data``'s held-out
    chunks: {kind: {"summary": ..., "r2_layer_mean": per-layer means}}, to compare runs on the same held-out text."""
    val = data.token_mask(val=True)
    result = {}
    for kind, surrogate in surrogates.items():
        r2 = torch.stack([
            r2_scores(module(data.features[layer, val].float()), data.targets[layer, val])[0]
            for layer, module in enumerate(surrogate.layers)
        ])  # fmt: skip
        result[kind] = {"summary": _summary(r2), "r2_layer_mean": [round(float(v), 4) for v in r2.mean(1)]}
    return result


def _print_table(metrics: dict) -> None:
    r2 = metrics["r2"]
    n_heads = len(r2["linear"][0])
    head_cols = " ".join(f"{'h' + str(h):>6}" for h in range(n_heads))
    print(f"\nR² (squared Pearson, held-out chunks), per layer: mean | per head")
    print(f"{'layer':>5} | {'linear':>6} {head_cols} | {'mlp':>6} {head_cols}")
    for layer, (lin, mlp) in enumerate(zip(r2["linear"], r2["mlp"])):
        lin_heads = " ".join(f"{v:6.3f}" for v in lin)
        mlp_heads = " ".join(f"{v:6.3f}" for v in mlp)
        print(f"{layer:>5} | {sum(lin) / len(lin):6.3f} {lin_heads} | {sum(mlp) / len(mlp):6.3f} {mlp_heads}")
    for name in ("linear", "mlp"):
        s = metrics["summary"][name]
        print(
            f"{name:>6}: mean {s['mean']:.3f}, per-layer mean in [{s['layer_mean_min']:.3f}, {s['layer_mean_max']:.3f}]"
            f", heads in [{s['head_min']:.3f}, {s['head_max']:.3f}]; per head (mean over layers): "
            f"{metrics['r2_head_mean_over_layers'][name]}"
        )
    print("log-score quantiles, held-out targets:", metrics["target_quantiles"]["val"])
    for name in ("linear", "mlp"):
        print(f"log-score quantiles, held-out {name} predictions:", metrics["predicted_quantiles_val"][name])


def _plot(metrics: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, color in (("linear", "tab:blue"), ("mlp", "tab:orange")):
        r2 = torch.tensor(metrics["r2"][name])
        layers = range(r2.shape[0])
        ax.plot(layers, r2.mean(1), marker="o", ms=3, color=color, label=f"{name} (mean {r2.mean():.3f})")
        ax.fill_between(layers, r2.min(1).values, r2.max(1).values, color=color, alpha=0.2)
        if "compared" in metrics:
            before = metrics["compared"][name]
            ax.plot(layers, before["r2_layer_mean"], ls="--", color=color,
                    label=f"{name}, {metrics['compared']['label']} (mean {before['summary']['mean']:.3f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("R² (squared Pearson), held-out chunks")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title + "\nline: mean over kv heads, band: min-max over heads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load_model(name: str, device: str, dtype: torch.dtype):
    if name == "default":
        from kvpress_cpp.models import load_default_model

        model, tokenizer = load_default_model(dtype=dtype, attn_implementation="sdpa", device=device)
        return model, tokenizer, DEFAULT_MODEL_NAME
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa",
                                                 **NO_HUB_KERNELS).to(device).eval()
    return model, tokenizer, Path(name).name or name


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvpress_cpp.train_kvzap",
        description="Compute KVzip+ targets on local text and fit KVzap linear and MLP surrogates (kvpress layout).",
    )
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a local HF path")
    p.add_argument("--texts", default=",".join(NAMED_TEXTS),
                   help=f"comma list: {', '.join(NAMED_TEXTS)} or text file paths")
    p.add_argument("--out", required=True, help="output directory (linear/, mlp/, training_report.json, png)")
    p.add_argument("--tokens", type=int, default=230400, help="total context tokens (train + held out)")
    p.add_argument("--context-tokens", type=int, default=768, help="tokens per context chunk p")
    p.add_argument("--val-fraction", type=float, default=0.15, help="fraction of each text's chunks held out")
    p.add_argument("--h-norm", choices=H_NORMS, default="attention-input", help="which h_j divides (see module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--hidden-dim", type=int, default=None, help="MLP width (default hidden_size // 8)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument(
        "--data-cache", default=None, help="directory: each chunk's targets are saved there and reused (resumes a run)"
    )
    p.add_argument(
        "--fit-collected", action="store_true", help="fit on the chunks in --data-cache so far (a stopped collection)"
    )
    p.add_argument(
        "--compare-with", default=None, help="surrogate directory (linear/, mlp/) to score on the same held-out chunks"
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before the model loads, what would fail or mislead after the collection (hours at the default size)."""
    for name in ("tokens", "context_tokens", "epochs", "batch_size", "hidden_dim", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
    if not 0 < args.val_fraction < 1:  # the held-out chunks pick the MLP's epoch and give the R² reported
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not 0 < args.lr < math.inf:  # torch's AdamW refuses a negative one, but only once the targets are collected
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.weight_decay < math.inf:
        parser.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if args.model != "default" and (problem := local_model_problem(args.model)):
        parser.error(f"--model {args.model}: {problem}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out}: not a directory")
    names = [t for t in args.texts.split(",") if t]
    if not names:
        parser.error("--texts names no text")
    if not args.fit_collected and not _cache_complete(args.data_cache):  # else the texts are not read
        if missing := [t for t in names if unknown_text(t)]:
            parser.error(f"--texts: {missing} are neither {', '.join(NAMED_TEXTS)} nor text files")
        for name in names:
            if name not in NAMED_TEXTS and (problem := text_file_problem(name)):
                parser.error(f"--texts {name}: {problem}")
    counts = chunks_per_text(args.tokens, args.context_tokens, len(names))
    if min(counts) < 2:
        parser.error(f"--tokens {args.tokens} gives {len(names)} text(s) {counts} chunk(s) of --context-tokens "
                     f"{args.context_tokens}; holding out one of each text's chunks needs two per text: use --tokens "
                     f">= {2 * len(names) * args.context_tokens}")
    if args.fit_collected and args.data_cache is None:
        parser.error("--fit-collected fits the chunks saved in --data-cache, which is not given")
    if args.fit_collected and not (Path(args.data_cache) / "index.json").is_file():
        parser.error(f"--data-cache {args.data_cache}: no collection there (no index.json) for --fit-collected")
    if args.compare_with is not None:
        files = ("config.json", "model.safetensors")
        missing = [kind for kind in ("linear", "mlp")
                   if not all((Path(args.compare_with) / kind / name).is_file() for name in files)]
        if missing:
            parser.error(f"--compare-with {args.compare_with}: expected surrogates in {', '.join(missing)}/ "
                         f"(config.json + model.safetensors, as --out writes them)")


def main(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> dict:
    """Run the CLI; ``model``/``tokenizer`` may be passed in directly (then ``--model`` only names it).

    With ``--data-cache`` every chunk's targets are saved in that directory as they are computed; a complete cache
    made with the same data settings replaces step 1 (the model is then not loaded), an incomplete one is resumed, or,
    with ``--fit-collected``, fitted as it is.
    """
    args = parse_args(argv)
    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text_names = [t for t in args.texts.split(",") if t]
    cache = Path(args.data_cache) if args.data_cache else None
    # What determines the targets; a cache made with other values is refused.
    data_settings = {
        k: getattr(args, k) for k in ("model", "texts", "tokens", "context_tokens", "val_fraction", "h_norm", "seed")
    }
    data_settings["text_sha256"] = text_file_digests(text_names)
    t0 = time.perf_counter()
    t_load = 0.0
    if cache is not None and (_cache_complete(cache) or args.fit_collected):
        data, cached_settings, t_collect = load_data_cache(cache, allow_partial=args.fit_collected)
        # A text file gone since the collection is not read again: its targets stand as collected.
        gone = {name: digest for name, digest in cached_settings.get("text_sha256", {}).items()
                if not Path(name).is_file()}
        data_settings["text_sha256"] = {**data_settings["text_sha256"], **gone}
        if cached_settings != data_settings:
            differing = sorted(k for k in {**cached_settings, **data_settings}
                               if cached_settings.get(k) != data_settings.get(k))
            raise ValueError(f"train_kvzap: {cache} holds targets collected with other {', '.join(differing)}: "
                             f"{cached_settings}, not {data_settings}")
        model_name = DEFAULT_MODEL_NAME if args.model == "default" else Path(args.model).name
        print(f"loaded targets from {cache} (collected in {t_collect:.0f} s)")
        (layers, _, hidden_size), kv_heads = data.features.shape, data.targets.shape[2]
        compared = args.compare_with and load_surrogates_to_compare(args.compare_with, layers, hidden_size, kv_heads)
    else:
        if model is None:
            model, tokenizer, model_name = _load_model(args.model, args.device, getattr(torch, args.dtype))
        else:
            model_name = args.model
        t_load = time.perf_counter() - t0
        config = model.config
        compared = args.compare_with and load_surrogates_to_compare(
            args.compare_with, config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
        t1 = time.perf_counter()
        texts = {name: load_text(name) for name in text_names}
        plan = plan_chunks(tokenizer, texts, args.tokens, args.context_tokens, args.val_fraction, args.seed)
        data = collect_dataset(model, tokenizer, plan, args.h_norm, progress, cache, data_settings)
        t_collect = time.perf_counter() - t1
    hidden_dim = args.hidden_dim or data.features.shape[2] // 8
    t2 = time.perf_counter()
    linears, mlps, metrics = train_surrogates(
        data, hidden_dim, args.epochs, args.batch_size, args.lr, args.weight_decay, args.seed, progress=progress
    )
    t_fit = time.perf_counter() - t2
    if compared:
        metrics["compared"] = {"label": "before", "dir": args.compare_with, **surrogate_r2(compared, data)}
    save_surrogate(build_kvzap_model(linears, None), out / "linear")
    save_surrogate(build_kvzap_model(mlps, hidden_dim), out / "mlp")
    val = data.token_mask(val=True)
    report = {
        "command": "python -m kvpress_cpp.train_kvzap " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": model_name,
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("out", "data_cache", "fit_collected", "compare_with", "no_progress", "threads")
        },
        "mlp_hidden_dim": hidden_dim,
        "data": {
            "texts": text_names,
            "chunks": len(data.chunk_text),
            "chunks_planned": max(1, args.tokens // args.context_tokens),
            "chunks_val": sum(data.chunk_is_val),
            "chunks_per_text": {n: data.chunk_text.count(n) for n in dict.fromkeys(data.chunk_text)},
            "tokens_train": int((~val).sum()),
            "tokens_val": int(val.sum()),
            "layers": data.targets.shape[0],
            "kv_heads": data.targets.shape[2],
            "hidden_size": data.features.shape[2],
        },
        "seconds": {"load": round(t_load, 1), "collect": round(t_collect, 1), "fit": round(t_fit, 1)},
        **metrics,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    _plot(metrics, out / "r2_per_layer.png", f"KVzap surrogates for {model_name}: R² per layer")
    if progress:
        _print_table(metrics)
    print(
        f"wrote {out}/linear, {out}/mlp, training_report.json, r2_per_layer.png "
        f"(load {t_load:.0f}s, targets {t_collect:.0f}s, fit {t_fit:.0f}s)"
    )
    return report


if __name__ == "__main__":
    main()
