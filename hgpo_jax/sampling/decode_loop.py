"""What both lockstep decode loops share (`engine.lockstep_decode`,
`jump_forward.jump_forward_decode`): their result and the device loop that runs a step
function, one step or a chunk of steps per iteration."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class DecodeResult:
  """What the generate program returns (B rows, M = max_new_tokens).

  Attributes:
    tokens: i32[B, M] sampled tokens (pad after a row's end).
    logprobs: f32[B, M] their raw log-probs (0 after a row's end; NaN where a call without
      `need_logprobs` computed none, `jump_forward`).
    lengths: i32[B] tokens each row sampled.
    reasons: i32[B] stop reasons (`types.STOP_REASONS` indices).
    steps: i32[] decode steps the loop ran.
  """
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  reasons: jax.Array
  steps: jax.Array


def run_loop(decode_chunk: int, body, cond, state, max_steps: int) -> DecodeResult:
  """The `DecodeResult` of a decode loop (`body` while `cond`, at most `max_steps` steps)
  from `state`: one step per device-loop iteration, or `decode_chunk` steps
  (`engine.Engine.decode_chunk`, `_chunk_step`); `state` has a `DecodeResult`'s fields but
  `steps`, and `step` (the steps run)."""
  chunk = min(decode_chunk, max_steps)
  if chunk <= 1:
    state = jax.lax.while_loop(cond, body, state)
    steps = state.step
  else:
    state, steps = jax.lax.while_loop(
        lambda carry: cond(carry[0]),
        lambda carry: jax.lax.fori_loop(0, chunk, _chunk_step(body, cond), carry), (state, 0))
  return DecodeResult(tokens=state.tokens, logprobs=state.logprobs, lengths=state.lengths,
                      reasons=state.reasons, steps=jnp.asarray(steps, jnp.int32))


def _chunk_step(body, cond):
  """One step of a decode chunk over (state, steps run): `body`'s state where the one-step
  loop would still run (`cond`), else the state unchanged, with `steps` counting the steps
  that ran. Both sides are computed (a `lax.cond` would cost XLA:GPU the host round trip
  the chunk exists to avoid); only the cache is taken from `body` either way: a skipped
  step writes its keys/values at the frozen next slot, which nothing reads afterwards (the
  loop exits at the chunk's end), and a select over the whole cache would copy it."""
  def step(_, carry):
    state, steps = carry
    run = cond(state)
    new = body(state)
    kept = jax.tree.map(lambda n, o: jnp.where(run, n, o), new.replace(cache=None),
                        state.replace(cache=None))
    return kept.replace(cache=new.cache), steps + run.astype(jnp.int32)
  return step
