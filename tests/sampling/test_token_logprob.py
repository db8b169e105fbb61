"""`logits.token_logprob`, the chosen token's log-prob without the [B, V] array of all of
them, against `jax.nn.log_softmax` taken at the token: the same bits, compiled or not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hgpo_jax.sampling import logits as logits_lib


def _rows(kind: str, vocab: int) -> np.ndarray:
  rng = np.random.default_rng(vocab)
  if kind == "normal":
    return rng.normal(0.0, 3.0, (6, vocab)).astype(np.float32)
  if kind == "peaked":  # one token holds almost all the mass: lse ~ 0, log-probs ~ -40
    x = rng.normal(0.0, 1.0, (6, vocab)).astype(np.float32)
    x[np.arange(6), rng.integers(0, vocab, 6)] = 40.0
    return x
  if kind == "ties":  # integer logits: equal maxima
    return rng.integers(-3, 3, (6, vocab)).astype(np.float32)
  return rng.normal(1e4, 50.0, (6, vocab)).astype(np.float32)  # "large": the shift matters


@pytest.mark.parametrize("vocab", [300, 49152])
@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "large"])
def test_token_logprob_is_log_softmax_at_the_token_bit_for_bit(kind, vocab):
  logits = jnp.asarray(_rows(kind, vocab))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, vocab, 6), jnp.int32)
  tokens = tokens.at[0].set(int(jnp.argmax(logits[0])))  # the row's most likely token too
  want = lambda x, t: jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), t[:, None], 1)[:, 0]
  for fn in (lambda f: f, jax.jit):
    got = np.asarray(fn(logits_lib.token_logprob)(logits, tokens))
    np.testing.assert_array_equal(got, np.asarray(fn(want)(logits, tokens)))
  assert got.shape == (6,) and got.dtype == np.float32 and (got <= 0).all()
