"""Tiny, random, fully offline test models: a GQA Llama, a GQA Qwen3 (with q_norm/k_norm) and a byte-level BPE
tokenizer trained on a short built-in text. Nothing here touches a hub or the network.

Everything is deterministic: the tokenizer's BPE training is deterministic on a fixed text, and the weights come from
``torch.manual_seed(seed)`` (the global RNG state is restored afterwards). Models are float32 and in eval mode.
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

#: A few paragraphs of ordinary English prose (written for these tests). Trains the tiny tokenizer and serves as
#: held-out-style text for the default model's perplexity sanity check.
ENGLISH_PROSE = """\
The old lighthouse keeper had lived on the island for nearly forty years, and in all that time he had never once \
missed lighting the lamp at dusk. Every evening he climbed the narrow spiral staircase, one hundred and twelve steps, \
carrying a small can of oil and a cloth for polishing the great glass lens. The villagers on the mainland set their \
clocks by the beam that swept across the bay, and fishermen returning late with their catch knew that as long as the \
light was burning, they would find their way home.

In the winter, storms battered the rocks and the wind howled around the tower, but the keeper only smiled and put \
another log on the fire. He kept a journal in which he recorded the weather, the ships that passed, and the birds \
that nested on the cliffs. When a young teacher from the village asked him whether he was ever lonely, he thought \
about it for a long while before answering. He said that a person is never truly alone when there is work that \
matters and a world that depends on it.

The market in the town square opened early on Saturdays. Farmers arrived before sunrise with baskets of apples, \
potatoes and fresh bread, and by seven o'clock the stalls were crowded with families looking for bargains. A woman \
who sold honey had kept bees for most of her life; she could tell you which flowers the bees had visited simply by \
tasting the honey. Children gathered around the baker's cart, hoping for a sample of the warm cinnamon rolls, while \
their parents argued cheerfully about the price of cheese.

Later that year the council decided to build a new library next to the school. The architect proposed a simple \
building of brick and timber, with large windows facing south so that the reading rooms would be bright even in \
December. It took two years and a great deal of patience, but when the doors finally opened, nearly everyone in the \
town came to see it. The librarian, a quiet man with round glasses, said that a library is the only place where a \
poor child and a rich child can sit at the same table and read the same book.
"""

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, IM_START, IM_END]  # ids 0..5, in this order

#: ChatML-style, like SmolLM2/Qwen; the content is copied verbatim (kvpress's pipeline splits the rendered prompt on
#: a separator placed inside the user message).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 4096

#: Shape shared by the tiny models: GQA with 2 query heads per kv head.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)

#: Offset added (through ``q_proj.bias``) to the lowest-frequency RoPE pair of every query head. Real LLMs' queries
#: have a large common component (in the slowly rotating dims); random zero-mean queries do not, and then e.g.
#: kvpress's head-wise masking (AdaKV & co. during decoding, ``kvpress.attention_patch.search_hyperplane``) finds no
#: half-space holding all of a question's queries and raises. 3.0 makes it succeed for questions of 200+ tokens.
#: ``query_offset=0`` gives the plain bias-free architecture.
QUERY_OFFSET = 3.0

#: Weight init std. The transformers default (0.02) makes attention on a 64-wide model almost uniform, which turns
#: every top-k over attention-derived scores into a coin toss between near-ties; 0.2 gives clearly peaked scores.
INIT_STD = 0.2


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    # Digits one per token (as SmolLM2 and Qwen do), then GPT-2 style byte-level splitting: every string encodes,
    # no unknown tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(ENGLISH_PROSE.split("\n\n"), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE tokenizer (same vocabulary every call) with bos/eos/pad/unk and a chat template.

    Encoding does not add special tokens (like SmolLM2's tokenizer); the chat template provides the structure.
    """
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids (generate() would reject them)
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _init_model(
    model_cls, config, tokenizer: PreTrainedTokenizerFast, seed: int, query_offset: float
) -> PreTrainedModel:
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = model_cls(config)
        # RMSNorm weights start at exactly 1, which would hide a dropped or misplaced norm weight: jitter them.
        # Qwen3's per-head q_norm/k_norm fix the q/k scale, so with weights near 1 attention is almost flat;
        # scale them up (trained Qwen3 checkpoints also have q/k norm weights well above 1).
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.copy_(1.6 + 0.3 * torch.randn_like(param))
                elif name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
            if query_offset:
                head_dim = config.head_dim
                for layer in model.model.layers:
                    bias = layer.self_attn.q_proj.bias.view(-1, head_dim)  # (num_heads, head_dim), zero-initialised
                    # HF RoPE rotates dim i with dim i + head_dim/2; the last such pair has the lowest frequency.
                    bias[:, head_dim // 2 - 1] = query_offset
                    bias[:, head_dim - 1] = query_offset
    model.to(torch.float32)
    model.eval()
    # Generation stops at the end-of-turn token as well as at eos (kvpress's pipeline reads this list).
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def _common_config(tokenizer: PreTrainedTokenizerFast, attn_implementation: str, query_offset: float) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        **TINY_SHAPE,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        attention_bias=bool(query_offset),  # q/k/v/o biases; only q's is non-zero
        **_special_ids(tokenizer),
        attn_implementation=attn_implementation,
    )


def make_tiny_llama(
    attn_implementation: str = "sdpa",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    query_offset: float = QUERY_OFFSET,
    **config_overrides,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer random Llama with GQA (4 query heads, 2 kv heads, head_dim 16) and its tokenizer.

    With ``query_offset`` (see :data:`QUERY_OFFSET`) the attention projections carry biases, only q's non-zero.
    ``config_overrides`` are passed to ``LlamaConfig`` (e.g. ``num_hidden_layers=3``).
    """
    tokenizer = tokenizer or make_tokenizer()
    common = _common_config(tokenizer, attn_implementation, query_offset)
    config = LlamaConfig(**{**common, "mlp_bias": False, **config_overrides})
    return _init_model(LlamaForCausalLM, config, tokenizer, seed, query_offset), tokenizer


def make_tiny_qwen3(
    attn_implementation: str = "sdpa",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    query_offset: float = QUERY_OFFSET,
    **config_overrides,
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer random Qwen3 (q_norm/k_norm per head) with GQA (4 query heads, 2 kv heads, head_dim 16).

    ``query_offset`` as for :func:`make_tiny_llama`; ``config_overrides`` are passed to ``Qwen3Config``.
    """
    tokenizer = tokenizer or make_tokenizer()
    common = _common_config(tokenizer, attn_implementation, query_offset)
    config = Qwen3Config(**{**common, "use_sliding_window": False, **config_overrides})
    return _init_model(Qwen3ForCausalLM, config, tokenizer, seed, query_offset), tokenizer


def make_tiny_phi3(seed: int = 0, **config_overrides) -> tuple[Phi3ForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer random Phi-3 (queries, keys and values from one packed projection) with GQA (4 query heads, 2 kv
    heads, head_dim 16), without biases. Its tensor-parallel plan shards the packed projection's weights but gathers
    its output on every rank. ``config_overrides`` are passed to ``Phi3Config``."""
    tokenizer = make_tokenizer()
    config = Phi3Config(**{**_common_config(tokenizer, "sdpa", query_offset=0.0), **config_overrides})
    return _init_model(Phi3ForCausalLM, config, tokenizer, seed, query_offset=0.0), tokenizer


def make_tiny_gemma3(layer_types: list[str], rope_bases: dict[str, float]) -> Gemma3ForCausalLM:
    """A 2-layer random Gemma 3 of `layer_types`, each type turning with the rotary base `rope_bases` gives it (a
    window longer than any prompt here), its q/k norms scaled up so that attention is peaked (trained ones are)."""
    if hasattr(Gemma3TextConfig(), "rope_parameters"):  # transformers 5: a rotary table per layer type
        rope = {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": base}
                                    for kind, base in rope_bases.items()}}
    else:
        rope = {"rope_local_base_freq": rope_bases.get("sliding_attention", 10_000.0),
                "rope_theta": rope_bases["full_attention"]}
    config = Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, pad_token_id=0, initializer_range=0.2, sliding_window=4096,
        layer_types=layer_types, attn_implementation="sdpa", **rope)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.fill_(3.0)
    return model


def make_tiny_gemma3_sliding_and_full_twin() -> tuple[Gemma3ForCausalLM, Gemma3ForCausalLM]:
    """A Gemma 3 whose layer 0 is sliding (local base 10^4, global 10^6), and its twin of the same weights whose layer
    0 is a full layer at 10^4: with a window longer than the prompt, whatever the first holds in layer 0 the second
    must hold too, if the sliding layer is turned with its own base."""
    sliding = make_tiny_gemma3(["sliding_attention", "full_attention"],
                               {"sliding_attention": 1e4, "full_attention": 1e6})
    full = make_tiny_gemma3(["full_attention", "full_attention"], {"full_attention": 1e4})
    full.load_state_dict(sliding.state_dict())
    return sliding, full
