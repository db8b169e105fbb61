"""Reads a trainer checkpoint's `state` item back as numpy arrays (tests only)."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def state_arrays(workdir: str, step: int) -> dict[str, np.ndarray]:
  """The `state` item of `<workdir>/checkpoints/<step>` (actor TrainState, plus the
  critic's under "critic") as numpy arrays, keyed by tree path."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(path)  # orbax >= 0.11: StepMetadata(item_metadata=TreeMetadata)
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = ckptr.restore(path, restore_args=args)
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
