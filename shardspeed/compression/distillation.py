"""Knowledge distillation for XTC's recipe: the student learns the teacher's output distribution.

DeepSpeed leaves the distillation loss to user code; this is one documented function for it:

    loss = distillation_loss(student_logits, teacher_logits, labels, temperature=2.0, alpha=0.5)

``alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * cross_entropy(student,
labels)`` (Hinton et al.; the T^2 keeps the soft term's gradients on the scale of the hard one). Without
``labels`` it is the soft term alone (alpha is then 1). ``hidden_state_loss`` adds XTC's layer-wise term:
the mean squared error between chosen student and teacher hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["distillation_loss", "hidden_state_loss"]


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    alpha: float = 0.5,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Soft (teacher) plus hard (labels) loss over the last dimension of the logits; fp32 internally."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"distillation_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape"
        )
    if temperature <= 0 or not 0 <= alpha <= 1:
        raise ValueError(
            f"distillation_loss: temperature must be > 0 and alpha in [0, 1], got {temperature}, {alpha}"
        )
    vocab = student_logits.shape[-1]
    student = student_logits.float().reshape(-1, vocab)
    teacher = teacher_logits.detach().float().reshape(-1, vocab)
    keep = None
    if labels is not None:
        keep = labels.reshape(-1) != ignore_index
    log_student = F.log_softmax(student / temperature, dim=-1)
    log_teacher = F.log_softmax(teacher / temperature, dim=-1)
    per_token = F.kl_div(log_student, log_teacher, log_target=True, reduction="none").sum(-1)
    soft = (per_token[keep].mean() if keep is not None else per_token.mean()) * temperature**2
    if labels is None:
        return soft
    hard = F.cross_entropy(student, labels.reshape(-1), ignore_index=ignore_index)
    return alpha * soft + (1 - alpha) * hard


def hidden_state_loss(student_states, teacher_states, pairs) -> torch.Tensor:
    """Mean over ``pairs`` ((student index, teacher index), ...) of the MSE between the hidden states."""
    losses = [F.mse_loss(student_states[s].float(), teacher_states[t].detach().float()) for s, t in pairs]
    if not losses:
        raise ValueError("hidden_state_loss: pairs is empty")
    return torch.stack(losses).mean()
