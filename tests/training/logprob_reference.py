"""Readable reference of the update's log-probs: every column of an unpacked batch.

`train_step.scored_logprobs` (the one log-prob function of the update, on score slots)
must give these numbers on an unpacked row's response columns
(tests/training/test_train_step.py).
"""

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx


def token_logprobs(model: nnx.Module, tokens_bl: jax.Array, positions_bl: jax.Array,
                   input_mask_bl: jax.Array, with_entropy: bool = True,
                   scored_tail: Optional[int] = None):
  """Log-prob (and full-softmax entropy) of every token given the tokens before it.

  Column l holds the value for token l predicted from position l - 1 (the `train_batch`
  convention); column 0 is 0.

  Args:
    model: the decoder (`hidden(...)`, `logits(hidden)`).
    tokens_bl: int32[B, L]; positions_bl: int32[B, L]; input_mask_bl: bool[B, L].
    with_entropy: also return the entropy (else None).
    scored_tail: if set, only the last `scored_tail` columns are computed; other columns
      hold 0.

  Returns:
    (logp_bl f32[B, L], entropy_bl f32[B, L] or None).
  """
  hidden_bld, _ = model.hidden(tokens_bl, positions_bl, input_mask_bl)
  seq = tokens_bl.shape[1]
  tail = seq - 1 if scored_tail is None else min(scored_tail, seq - 1)
  logits_blv = model.logits(hidden_bld[:, seq - 1 - tail:seq - 1]).astype(jnp.float32)
  logz_bl = jax.nn.logsumexp(logits_blv, axis=-1)
  picked_bl = jnp.take_along_axis(logits_blv, tokens_bl[:, seq - tail:, None], axis=-1)[..., 0]
  pad = ((0, 0), (seq - tail, 0))
  logp_bl = jnp.pad(picked_bl - logz_bl, pad)
  if not with_entropy:
    return logp_bl, None
  probs_blv = jnp.exp(logits_blv - logz_bl[..., None])
  entropy_bl = logz_bl - jnp.sum(probs_blv * logits_blv, axis=-1)
  return logp_bl, jnp.pad(entropy_bl, pad)


def constrained_token_logprobs(model: nnx.Module, tokens_bl, positions_bl, input_mask_bl,
                               choices_blk):
  """`token_logprobs` of the constrained policy, token by token: where column l names the
  ids the constraint allowed (`choices_blk[b, l]`, -1 padded), the log-softmax and the
  entropy run over those ids only; elsewhere over the whole vocabulary.

  Returns:
    (logp_bl, entropy_bl) as float64 numpy arrays; column 0 is 0.
  """
  import numpy as np
  hidden_bld, _ = model.hidden(tokens_bl, positions_bl, input_mask_bl)
  logits_blv = np.asarray(model.logits(hidden_bld).astype(jnp.float32), np.float64)
  tokens, choices = np.asarray(tokens_bl), np.asarray(choices_blk)
  logp, entropy = np.zeros(tokens.shape), np.zeros(tokens.shape)
  for b in range(tokens.shape[0]):
    for col in range(1, tokens.shape[1]):
      logits = logits_blv[b, col - 1]
      ids = [int(i) for i in choices[b, col] if i >= 0] or list(range(logits.shape[0]))
      z = np.log(np.sum(np.exp(logits[ids] - logits[ids].max()))) + logits[ids].max()
      p = np.exp(logits[ids] - z)
      logp[b, col] = logits[tokens[b, col]] - z
      entropy[b, col] = -np.sum(p * (logits[ids] - z))
  return logp, entropy
