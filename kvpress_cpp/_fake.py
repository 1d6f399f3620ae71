"""Shape functions (fake kernels) of every kvcomp op, so torch.compile and meta tensors can trace them.

The C++ kernels validate everything; the checks here are only those a trace needs to produce the right shapes.
"""

import torch


@torch.library.register_fake("kvcomp::update_scores")
def _update_scores_fake(scores, attn, decay, input_scale):
    torch._check(
        attn.shape[-1] == scores.shape[-1] + attn.shape[2],
        lambda: f"kvcomp::update_scores: expected attn.size(3) == T_old + q, got attn {tuple(attn.shape)} "
        f"and scores {tuple(scores.shape)}",
    )
    return scores.new_empty((scores.shape[0], scores.shape[1], attn.shape[-1]))
