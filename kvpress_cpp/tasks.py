"""Retrieval prompts on real text: a fact hidden in Jane Austen, asked back through the model's chat template.

The demo asks this question, and the quality tests check that a press still answers it where the full cache does.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from kvpress_cpp.texts import austen_novel


@dataclass(frozen=True)
class HiddenFact:
    fact: str = "The secret passphrase is 7294."
    question: str = "What is the secret passphrase?"
    answer: str = "7294"  # digits tokenise one per token in SmolLM2's vocabulary


def hidden_fact_prompt(tokenizer, context_tokens: int = 3000, depth: float = 0.5,
                       fact: HiddenFact = HiddenFact()) -> str:
    """A chat prompt: Pride and Prejudice cut to `context_tokens` tokens with `fact.fact` inserted at the line
    break nearest to `depth` (0 = start, 1 = end), followed by `fact.question`."""
    # A negative count sliced from the end of the novel (a 168k-token prompt), a depth outside [0, 1] was clamped.
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, Integral) or context_tokens < 1:
        raise ValueError(f"hidden_fact_prompt: context_tokens must be an integer >= 1, got {context_tokens!r}")
    if not 0 <= depth <= 1:
        raise ValueError(f"hidden_fact_prompt: depth must be in [0, 1] (0 = start, 1 = end), got {depth!r}")
    # Austen runs ~4.3 characters a token: 8 per token is enough text without tokenising the whole novel.
    opening = austen_novel("prideprejudice")[: 8 * context_tokens]
    context = tokenizer.decode(tokenizer(opening).input_ids[:context_tokens])
    cut = context.rfind("\n", 0, int(len(context) * depth)) + 1
    context = context[:cut] + fact.fact + "\n" + context[cut:]
    message = f"{context}\n\nAnswer the question using the text above. {fact.question}"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
