"""cuDNN's fused attention against the float32 `xla` reference, on a small case (GPU only).

`attention_impl=auto` picks cuDNN on a GPU (hgpo_jax.models.attention), and no CPU test can
run it. `check()` compares it on one GPU with the readable reference: the output and dq,
dk, dv of a causal, grouped-query attention on padded and packed bf16 rows, each as the
max |error| against the float32 `xla` attention on the same inputs. cuDNN passes when it
is no further from that reference than XLA's own bf16 attention, up to 2x plus 4e-3
(half a bf16 ulp of the values' scale). `tests/models/test_attention.py` and the
accelerator benchmarks (launch/benchmarks: train_step --accelerator, decode_step,
attention_speed) call it first on a GPU, so every GPU run checks the path it times.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax.models import attention

LENGTHS = (37, 512)  # odd (cuDNN gets it padded to 38) and a power of two
NAMES = ("out", "dq", "dk", "dv")


class CudnnMismatch(RuntimeError):
  """cuDNN attention is further from the float32 reference than the bound allows."""


def segments(t: int) -> np.ndarray:
  """int32[4, T]: left padding, right padding, two packed segments + padding, no padding."""
  seg = np.zeros((4, t), np.int32)
  seg[0, 5:] = 1
  seg[1, :t - 4] = 1
  seg[2, :t // 3] = 1
  seg[2, t // 3:t - 3] = 2
  seg[3] = 1
  return seg


def inputs(t: int, heads=4, kv_heads=2, dim=16, dtype=jnp.float32, seed=0):
  """(q, k, v, segment ids, output weights) of 4 rows of length `t`, standard normal."""
  rng = np.random.default_rng(seed)
  b = 4
  q = jnp.asarray(rng.standard_normal((b, t, heads, dim)), dtype)
  k = jnp.asarray(rng.standard_normal((b, t, kv_heads, dim)), dtype)
  v = jnp.asarray(rng.standard_normal((b, t, kv_heads, dim)), dtype)
  w = jnp.asarray(rng.standard_normal((b, t, heads, dim)), jnp.float32)
  return q, k, v, jnp.asarray(segments(t)), w


def loss_and_grads(impl, q, k, v, seg, w, causal, **kw):
  """The attention output and the gradients of sum(out * w) with respect to q, k, v."""
  def loss(q, k, v):
    out = attention.attention(q, k, v, seg, causal=causal, impl=impl, **kw)
    return jnp.sum(out.astype(jnp.float32) * w)
  out = jax.jit(lambda q, k, v: attention.attention(q, k, v, seg, causal=causal, impl=impl,
                                                    **kw))(q, k, v)
  return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def errors(t: int, heads=4, kv_heads=2, dim=64, seed=0) -> dict[str, tuple[float, float]]:
  """{name: (cudnn error, bf16 xla error)} for the output and dq, dk, dv: max |error|
  against the float32 `xla` reference on the same bf16 inputs. Needs a GPU."""
  q, k, v, seg, w = inputs(t, heads, kv_heads, dim, dtype=jnp.bfloat16, seed=seed)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = loss_and_grads("xla", *f32, seg, w, True)
  sides = {impl: loss_and_grads(impl, q, k, v, seg, w, True) for impl in ("cudnn", "xla")}
  flat = lambda r: [r[0], *r[1]]
  out = {}
  for i, name in enumerate(NAMES):
    want = np.asarray(flat(ref)[i], np.float64)
    out[name] = tuple(float(np.max(np.abs(np.asarray(flat(sides[impl])[i], np.float64) - want)))
                      for impl in ("cudnn", "xla"))
  return out


def within_bound(cudnn: float, xla: float) -> bool:
  """cuDNN's error is at most 2x XLA's bf16 error plus 4e-3 (half a bf16 ulp at ~1)."""
  return cudnn <= 2 * xla + 4e-3


def has_gpu(devices=None) -> bool:
  return any(d.platform == "gpu" for d in (devices if devices is not None else jax.devices()))


def check(lengths=LENGTHS) -> str:
  """Runs `errors` for each length on the default GPU; raises CudnnMismatch naming every
  quantity out of bound, else returns a one-line summary."""
  if not has_gpu():
    raise RuntimeError("cudnn_check.check needs a GPU (this process has none)")
  bad, worst = [], 0.0
  for t in lengths:
    for name, (cudnn, xla) in errors(t).items():
      worst = max(worst, cudnn / (2 * xla + 4e-3))
      if not within_bound(cudnn, xla):
        bad.append(f"{name} at T={t}: cuDNN error {cudnn:.3g} > 2 x XLA bf16 error {xla:.3g} "
                   "+ 4e-3")
  if bad:
    raise CudnnMismatch("cuDNN attention disagrees with the float32 xla reference: "
                        + "; ".join(bad))
  return (f"cuDNN attention check: output and dq/dk/dv within 2 x XLA's bf16 error + 4e-3 "
          f"of the float32 reference at T={', '.join(map(str, lengths))} (largest error / "
          f"bound {worst:.2f})")


def check_if_gpu() -> str | None:
  """The benchmarks' first call: on a GPU, `check()` with its line printed (a mismatch
  ends the process with that one-line error); elsewhere None, nothing run."""
  if not has_gpu():
    return None
  try:
    line = check()
  except CudnnMismatch as e:
    raise SystemExit(str(e)) from None
  print(line, flush=True)
  return line
