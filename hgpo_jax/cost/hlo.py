"""What a compiled executable costs, read from its optimised HLO: FLOPs, memory traffic,
device ops (launches), XLA:TPU's cost-model cycles and memory.

* `compiled_flops(compiled)`: FLOPs of one call of a compiled executable. XLA's own
  `compiled.cost_analysis()["flops"]` counts the body of every `while` loop once (a
  `lax.scan` over 10 matmuls reports one matmul; see tests/compiled/test_flops.py), and the
  decoder scans its layers, the update scans micro-batches and the sampler loops over
  tokens. So the matmul FLOPs (`dot`, `convolution`: 2 x output elements x contracted
  size, the convention of XLA's HloCostAnalysis) are summed per HLO computation (cuBLAS
  gemm custom calls of XLA:GPU included), and each `while` body is weighted by the
  `known_trip_count` that XLA writes into the compiled loop. Elementwise ops are left out
  (the usual MFU convention; a few percent of a transformer's FLOPs). For an SPMD program
  the compiled module is one device's share, so the count is per device.
* `hlo_memory_traffic(hlo_text)`: the device-memory bytes one run of a compiled module
  reads and writes, loops weighted by trip count the same way (XLA's "bytes accessed"
  counts a loop body once too); `loop_iteration` takes one iteration of the outermost
  data-dependent loop (a decode step: `hgpo_jax.sampling.decode_traffic`).
* `hlo_launches`, `hlo_estimated_cycles`: device ops and XLA:TPU's cycles, weighted alike.
* `memory_bytes(compiled)`: the executable's per-device argument, output, temporary and
  peak bytes.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

# ---------------------------------------------------------------------------------------
# FLOPs of a compiled executable
# ---------------------------------------------------------------------------------------

_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY_SHAPE = re.compile(r"^([a-z]\w*)\[([\d,]*)\]")


def cost_analysis(compiled) -> dict[str, float]:
  """XLA's cost analysis of a compiled executable as one flat dict.

  Current JAX returns a dict; older versions a list with one dict per partition (summed
  here); some backends None (an empty dict).
  """
  raw = compiled.cost_analysis()
  if raw is None:
    return {}
  if isinstance(raw, dict):
    return {k: float(v) for k, v in raw.items() if isinstance(v, (int, float))}
  out: dict[str, float] = {}
  for part in raw:
    for k, v in (part or {}).items():
      if isinstance(v, (int, float)):
        out[k] = out.get(k, 0.0) + float(v)
  return out


def _dims(shape_text: str) -> Optional[list[int]]:
  m = _ARRAY_SHAPE.match(shape_text.strip())
  if not m:
    return None
  return [int(d) for d in m.group(2).split(",") if d]


def array_dims(shape_text: str) -> Optional[list[int]]:
  """The dimensions of an HLO array shape (`bf16[28,128,2,1536,128]{4,3,2,1,0}` -> [28, 128,
  2, 1536, 128]); None for a tuple or a token."""
  return _dims(shape_text)


def _operand_names(args: str) -> list[str]:
  """Names of the operands in the text after `op(` (up to the matching parenthesis)."""
  depth, end = 1, len(args)
  for i, ch in enumerate(args):
    if ch == "(":
      depth += 1
    elif ch == ")":
      depth -= 1
      if depth == 0:
        end = i
        break
  return re.findall(r"%([\w.\-]+)", args[:end])


def _int_list(attrs: str, key: str) -> list[int]:
  m = re.search(key + r"=\{([\d,]*)\}", attrs)
  return [int(x) for x in m.group(1).split(",") if x] if m else []


def _window(attrs: str) -> dict[str, list]:
  """`window={size=4x3 stride=3x1 pad=0_0x1_1 lhs_dilate=4x1}` -> per-spatial-dim lists
  (absent keys: XLA's defaults, stride/dilations 1 and padding 0)."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  out: dict[str, list] = {}
  for item in (m.group(1).split() if m else []):
    key, _, value = item.partition("=")
    parts = value.split("x")
    out[key] = [tuple(int(v) for v in p.split("_")) if key == "pad" else int(p) for p in parts]
  return out


def _valid_positions(out_size: int, kernel: int, in_size: int, stride: int, pad_low: int,
                     lhs_dilate: int, rhs_dilate: int) -> int:
  """(output position, kernel tap) pairs of one spatial dimension that read a real input
  element (not padding, not a hole of the base dilation): XLA's HloCostAnalysis rule."""
  o = np.arange(out_size, dtype=np.int64)[:, None]
  k = np.arange(kernel, dtype=np.int64)[None, :]
  undilated = o * stride - pad_low + k * rhs_dilate
  hit = (undilated % lhs_dilate == 0) & (undilated >= 0) & (undilated // lhs_dilate < in_size)
  return int(hit.sum())


def _convolution_flops(out: list[int], lhs: list[int], rhs: list[int], attrs: str) -> float:
  """2 x multiply-adds of an HLO convolution, as XLA's HloCostAnalysis counts them:
  (input features / feature groups) x output features x (batch / batch groups) x the
  valid (output, tap) pairs of every spatial dimension. XLA:TPU writes batched matmuls
  (attention scores) as convolutions whose batch dimension is a base-dilated spatial
  window, so a count from the kernel's size alone would multiply by the batch again."""
  labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attrs)
  if labels is None:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  if len(lhs_l) != len(lhs) or len(rhs_l) != len(rhs) or len(out_l) != len(out):
    return 0.0
  feature_groups = (_int_list_scalar(attrs, "feature_group_count") or 1)
  batch_groups = (_int_list_scalar(attrs, "batch_group_count") or 1)
  input_feature = lhs[lhs_l.index("f")]
  input_batch = lhs[lhs_l.index("b")]
  output_feature = out[out_l.index("f")]
  win = _window(attrs)
  fma = (input_feature // feature_groups) * output_feature * (input_batch // batch_groups)
  spatial = sorted(c for c in rhs_l if c.isdigit())
  for i, c in enumerate(spatial):
    get = lambda key, default: win[key][i] if key in win and i < len(win[key]) else default
    fma *= _valid_positions(out[out_l.index(c)], rhs[rhs_l.index(c)], lhs[lhs_l.index(c)],
                            get("stride", 1), get("pad", (0, 0))[0], get("lhs_dilate", 1),
                            get("rhs_dilate", 1))
  return 2.0 * fma


def _int_list_scalar(attrs: str, key: str) -> int:
  m = re.search(key + r"=(\d+)", attrs)
  return int(m.group(1)) if m else 0


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CONSTANT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[su]\d+\[\]\S*\s+constant\((-?\d+)\)")
_COMPARE = re.compile(r"^\s*ROOT\s+%?[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%([\w.\-]+),\s*"
                      r"%([\w.\-]+)\),\s*direction=(LT|GT|LE|GE|NE)")


def _loop_bound(cond_lines: list[str]) -> Optional[int]:
  """The constant N of a loop condition `ROOT compare(counter, N), direction=LT` (XLA:TPU
  does not write `known_trip_count`; a scan's counter starts at 0 and steps by 1), or None
  for a condition that is not one comparison with a constant (e.g. the sampler's
  `step < max_new_tokens & ~all(done)`)."""
  constants = {}
  for line in cond_lines:
    m = _CONSTANT.match(line)
    if m:
      constants[m.group(1)] = int(m.group(2))
  for line in cond_lines:
    m = _COMPARE.match(line)
    if m:
      a, b, direction = m.groups()
      if direction == "LT" and b in constants:
        return constants[b]
      if direction == "GT" and a in constants:
        return constants[a]
      return None
  return None


def _parse_hlo(text: str):
  """{computation: (direct matmul FLOPs, [(callee, multiplier)])}, and the entry name.

  A `while` body's multiplier is its trip count: XLA:CPU/GPU's `known_trip_count`, else
  the bound of a `counter < N` condition (XLA:TPU), else None (unknown; see
  `hlo_matmul_flops`)."""
  comps: dict[str, tuple[float, list]] = {}
  cycles_of: dict[str, float] = {}
  lines_of: dict[str, list[str]] = {}
  entry = None
  name, shapes, flops, calls, lines, cycles = None, {}, 0.0, [], [], 0.0
  for line in text.splitlines():
    if name is None:
      m = _COMP_HEADER.match(line)
      if m:
        name, shapes, flops, calls, lines, cycles = m.group(1), {}, 0.0, [], [], 0.0
        if line.lstrip().startswith("ENTRY"):
          entry = name
        # Parameters of the computation are declared again as instructions below.
      continue
    if line.strip() == "}":
      comps[name] = (flops, calls)
      cycles_of[name] = cycles
      lines_of[name] = lines
      name = None
      continue
    lines.append(line)
    m = _INSTR.match(line)
    if not m:
      continue
    iname, shape_text, op, rest = m.groups()
    shapes[iname] = shape_text
    est = _CYCLES.search(rest)
    if est:
      cycles += float(est.group(1))
    if op in ("dot", "convolution"):
      out = _dims(shape_text)
      operands = _operand_names(rest)
      lhs = _dims(shapes.get(operands[0], "")) if operands else None
      if out is None or lhs is None:
        continue
      if op == "dot":
        n_out = 1
        for d in out:
          n_out *= d
        contracted = 1
        for d in _int_list(rest, "lhs_contracting_dims"):
          contracted *= lhs[d]
        flops += 2.0 * n_out * contracted
      else:
        rhs = _dims(shapes.get(operands[1], "")) if len(operands) > 1 else None
        if rhs is not None:
          flops += _convolution_flops(out, lhs, rhs, rest)
    if op == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)', rest, re.I):
      # XLA:GPU rewrites dots into cuBLAS/cuBLASLt calls; their output is the first array
      # of the result tuple and the contraction is in the backend config.
      out = _dims(shape_text.lstrip("("))
      operands = _operand_names(rest)
      lhs = _dims(shapes.get(operands[0], "").lstrip("(")) if operands else None
      dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
      if out is not None and lhs is not None and dims:
        contracted = 1
        for d in re.findall(r"\d+", dims.group(1)):
          contracted *= lhs[int(d)]
        flops += 2.0 * float(np.prod(out)) * contracted if out else 0.0
    # Callees: fusions/calls/maps run once, while bodies their trip count,
    # conditionals' branches at most once each (counted once: the largest is unknown).
    if op == "while":
      t = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
      body = re.search(r"body=%?([\w.\-]+)", rest)
      cond = re.search(r"condition=%?([\w.\-]+)", rest)
      trip = int(t.group(1)) if t else ("cond", cond.group(1) if cond else None)
      if body:
        calls.append((body.group(1), trip))
      continue
    for key in ("calls", "to_apply"):
      for callee in re.findall(key + r"=%?([\w.\-]+)", rest):
        calls.append((callee, 1))
    br = re.search(r"branch_computations=\{([^}]*)\}", rest)
    if br:
      for callee in re.findall(r"%?([\w.\-]+)", br.group(1)):
        calls.append((callee, 1))
  # Loops without known_trip_count: the bound of their condition, when it is a constant.
  for cname, (direct, calls) in comps.items():
    resolved = []
    for callee, mult in calls:
      if isinstance(mult, tuple):
        mult = _loop_bound(lines_of.get(mult[1], [])) if mult[1] else None
      resolved.append((callee, mult))
    comps[cname] = (direct, resolved)
  return comps, entry, cycles_of


def _weighted_total(comps, entry: str, direct_of, unknown_trip_count) -> float:
  """Sum of `direct_of[c]` over the computations run from `entry`, callees weighted by
  their multipliers (loops by trip count; an unknown count by `unknown_trip_count`: a
  number, or one weight per nesting depth of such loops, the last for any deeper)."""
  weights = (tuple(unknown_trip_count) if isinstance(unknown_trip_count, (tuple, list))
             else (unknown_trip_count,))
  memo: dict[tuple[str, int], float] = {}

  def total(c: str, depth: int, stack=()) -> float:
    if (c, depth) in memo:
      return memo[c, depth]
    if c not in comps or c in stack:
      return 0.0
    _, calls = comps[c]
    value = direct_of[c]
    for callee, mult in calls:
      if mult is None:
        value += weights[min(depth, len(weights) - 1)] * total(callee, depth + 1, stack + (c,))
      else:
        value += mult * total(callee, depth, stack + (c,))
    memo[c, depth] = value
    return value

  return total(entry, 0)


def hlo_matmul_flops(hlo_text: str, unknown_trip_count: int = 1) -> float:
  """Matmul FLOPs of one run of an HLO module's entry computation, loops unrolled by
  their trip counts. A loop whose count the HLO does not fix (a data-dependent exit, as
  the sampler's decode loop) counts `unknown_trip_count` times: 1 (one body), or an upper
  bound such as max_new_tokens; a tuple gives one count per nesting depth of such loops
  (a slotted decode loop and the admission loop inside it, whose count per decode step
  may be a fraction)."""
  comps, entry, _ = _parse_hlo(hlo_text)
  if entry is None:
    raise ValueError("hlo_matmul_flops: no ENTRY computation in the HLO text.")
  return _weighted_total(comps, entry, {c: v[0] for c, v in comps.items()}, unknown_trip_count)


def hlo_estimated_cycles(hlo_text: str, unknown_trip_count: int = 1) -> float:
  """XLA:TPU's own cost-model cycles of one run of a compiled module: the
  `estimated_cycles` it writes into each scheduled op's backend config, loops weighted by
  trip count as in `hlo_matmul_flops`. 0 for backends that write none (CPU, GPU).
  Collectives carry no estimate (communication is not in this number)."""
  comps, entry, cycles_of = _parse_hlo(hlo_text)
  if entry is None:
    raise ValueError("hlo_estimated_cycles: no ENTRY computation in the HLO text.")
  return _weighted_total(comps, entry, cycles_of, unknown_trip_count)


def compiled_flops(compiled, unknown_trip_count: int = 1,
                   hlo_text: Optional[str] = None) -> float:
  """Per-device FLOPs of one call of `jax.jit(f).lower(...).compile()` (see module doc;
  `unknown_trip_count` as in `hlo_matmul_flops`; `hlo_text`: `compiled.as_text()` when
  the caller has it already, since printing a large program takes seconds).

  Falls back to XLA's cost analysis when the HLO holds no dot (e.g. a backend that
  lowers matmuls to custom calls)."""
  text = compiled.as_text() if hlo_text is None else hlo_text
  flops = hlo_matmul_flops(text, unknown_trip_count)
  if flops == 0.0:
    flops = cost_analysis(compiled).get("flops", 0.0)
  return flops


# ---------------------------------------------------------------------------------------
# Memory traffic of a compiled executable
# ---------------------------------------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
                "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
_ARRAY_TEXT = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
# Ops that move no array through memory themselves (control flow, views, bookkeeping; a
# generic async op's wrapped computation books its op). Another async pair (copy-start /
# copy-done, all-gather-start / -done, ...) books its reads at its start and its writes at
# its done; an async slice (`slice-start`, which XLA:TPU's as_text() prints for a prefetch
# of part of a weight into on-chip memory) reads only the slice it takes, as a slice does.
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
               "conditional", "after-all", "add-dependency", "opt-barrier", "partition-id",
               "replica-id", "domain", "async-start", "async-update", "async-done"}
_SLICING = {"dynamic-slice", "slice", "gather"}


def array_bytes(shape_text: str, any_memory: bool = False) -> float:
  """Bytes of the arrays in an HLO shape (a tuple sums its elements) that live in device
  memory: an array in another memory space (`S(n)` in its layout: on-chip VMEM or host
  memory on TPU) moves no device-memory bytes, unless `any_memory`."""
  total = 0.0
  for dtype, dims, layout in _ARRAY_TEXT.findall(shape_text):
    if dtype not in _DTYPE_BYTES or (
        not any_memory and layout and re.search(r"S\(\d+\)", layout)):
      continue
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return total


def _computations(text: str):
  """{computation: [(name, shape text, op, rest of the line)]}, {computation: its root
  instruction's name} and the entry's name."""
  comps: dict[str, list[tuple[str, str, str, str]]] = {}
  roots: dict[str, str] = {}
  entry, name = None, None
  for line in text.splitlines():
    if name is None:
      m = _COMP_HEADER.match(line)
      if m:
        name = m.group(1)
        comps[name] = []
        if line.lstrip().startswith("ENTRY"):
          entry = name
      continue
    if line.strip() == "}":
      name = None
      continue
    m = _INSTR.match(line)
    if m:
      comps[name].append(m.groups())
      if line.lstrip().startswith("ROOT"):
        roots[name] = m.group(1)
  return comps, roots, entry


def _fused_param_reads(comps, roots, comp: str, index: int, full: float, depth: int = 0) -> float:
  """Bytes a fusion reads of its operand `index` (`full` bytes in device memory): the
  slices it takes when the fused computation only slices it (a layer's weights out of the
  stacked [L, ...] array; wherever the slice goes, on-chip memory included), nothing when
  it only updates it in place (dynamic-update-slice), else all of it (XLA's
  HloCostAnalysis books fusion operands the same way). An operand that leaves a nested
  fused computation as its root (a bitcast of a weight that the enclosing fusion's matmul
  reads) is read in full."""
  instrs = comps.get(comp, [])
  params = [i for i in instrs if i[2] == "parameter" and re.match(rf"{index}\)", i[3])]
  if not params or depth > 4:
    return full
  return _value_reads(comps, roots, comp, params[0][0], full, depth)


def _value_reads(comps, roots, comp: str, value: str, full: float, depth: int) -> float:
  if roots.get(comp) == value:
    return full
  total = 0.0
  instrs = comps.get(comp, [])
  for name, shape, op, rest in instrs:
    operands = _operand_names(rest)
    if value not in operands:
      continue
    if op in _SLICING and operands[0] == value:
      total += array_bytes(shape, any_memory=True)
    elif op == "dynamic-update-slice" and operands[0] == value and operands.count(value) == 1:
      continue  # updated in place: the written slice is booked as the fusion's output
    elif op == "bitcast":
      total += _value_reads(comps, roots, comp, name, full, depth)
    elif op == "fusion" and operands.count(value) == 1:
      callee = re.search(r"calls=%?([\w.\-]+)", rest)
      if callee is None:
        return full
      total += _fused_param_reads(comps, roots, callee.group(1), operands.index(value), full,
                                  depth + 1)
    else:
      return full
  return min(total, full)


def _fused_writes(comps, roots, comp: str, shape: str) -> float:
  """Bytes a fusion writes to device memory: its output, except the part that is a
  dynamic-update-slice of one of its operands (written in place: only the update's
  bytes, when the updated buffer is in device memory)."""
  instrs = comps.get(comp, [])
  by_name = {i[0]: i for i in instrs}
  root = by_name.get(roots.get(comp, ""))
  if root is None:
    return array_bytes(shape)
  parts = [by_name.get(n) for n in _operand_names(root[3])] if root[2] == "tuple" else [root]
  total = 0.0
  for part in parts:
    if part is None:
      continue
    if part[2] == "dynamic-update-slice":
      operands = _operand_names(part[3])
      update = by_name.get(operands[1]) if len(operands) > 1 else None
      if update is not None and array_bytes(part[1]):
        total += array_bytes(update[1], any_memory=True)
    else:
      total += array_bytes(part[1])
  return total


def _instruction_traffic(comps, roots, shapes: dict[str, str], op: str, shape: str,
                         rest: str, custom_reads=None) -> float:
  """Device-memory bytes one top-level instruction reads and writes (`custom_reads`: as
  `hlo_memory_traffic`)."""
  if op in _NO_TRAFFIC:
    return 0.0
  operands = _operand_names(rest)
  reads = [array_bytes(shapes.get(o, "")) for o in operands]
  if op == "custom-call" and custom_reads is not None:
    credited = custom_reads(rest, [shapes.get(o, "") for o in operands])
    if credited is not None:
      return sum(credited) + array_bytes(shape)
  if op == "fusion":
    callee = re.search(r"calls=%?([\w.\-]+)", rest)
    if callee is None:
      return sum(reads) + array_bytes(shape)
    fused = callee.group(1)
    return (sum(_fused_param_reads(comps, roots, fused, i, r) for i, r in enumerate(reads))
            + _fused_writes(comps, roots, fused, shape))
  if op in _SLICING:  # reads the slice where its operand lives, writes it where it goes
    source = array_bytes(shapes.get(operands[0], "")) if operands else 0.0
    return (array_bytes(shape, any_memory=True) if source else 0.0) + array_bytes(shape)
  if op == "dynamic-update-slice":  # in place: reads the update, writes it into the buffer
    update = shapes.get(operands[1], "") if len(operands) > 1 else ""
    return reads[1] + (array_bytes(update, any_memory=True) if array_bytes(shape) else 0.0)
  if op.endswith("-start") and op[:-len("-start")] in _SLICING:
    # shape: ((operands), output, context): the output, the second array, is what it reads
    arrays = [m.group(0) for m in _ARRAY_TEXT.finditer(shape)]
    taken = arrays[len(operands)] if len(arrays) > len(operands) else ""
    return array_bytes(taken, any_memory=True) if sum(reads) else 0.0
  if op.endswith("-start"):
    return sum(reads)
  if op.endswith("-done"):
    return array_bytes(shape)
  return sum(reads) + array_bytes(shape)


def hlo_memory_traffic(hlo_text: str, unknown_trip_count=1, custom_reads=None) -> float:
  """Device-memory bytes one run of an HLO module's entry computation reads and writes,
  loops weighted by their trip counts as in `hlo_matmul_flops` (`unknown_trip_count` for
  loops without a fixed count, one weight per nesting depth).

  A custom call (a cuBLAS gemm, a Pallas kernel) books all its operands and its output,
  unless `custom_reads(rest_of_line, operand_shapes)` returns the bytes it reads of each
  operand: a kernel that reads only part of an operand (the decode attention kernels, each
  row's valid cache blocks of one layer: `decode_traffic.kernel_reads`) is credited with
  that part; None keeps the full count.

  XLA's `cost_analysis()["bytes accessed"]` counts a loop body once: the decoder's layer
  loop reads one layer's weights in it. Here every top-level instruction of the entry, of
  loop bodies, called computations and conditional branches books its operands and its
  output (a fusion only the slices it takes of an operand and the update it writes in
  place; arrays in another memory space, `S(n)`, are not device memory); what happens
  inside a fusion stays on chip. Conditional branches count once each (an upper bound)."""
  return _control_total(
      hlo_text, unknown_trip_count, "hlo_memory_traffic",
      lambda comps, roots, shapes, op, shape, rest: _instruction_traffic(
          comps, roots, shapes, op, shape, rest, custom_reads))


def hlo_launches(hlo_text: str, unknown_trip_count=1) -> float:
  """Device ops one run of an HLO module's entry computation launches, loops weighted as in
  `hlo_memory_traffic`: every top-level instruction of the entry, loop bodies, called
  computations and conditional branches that does work on the device (a fusion, a custom
  call, a copy, ...; an async pair counts once, at its start), not the tuples, bitcasts and
  control flow around them. On XLA:GPU each is a kernel (a memcpy for a copy): the count of
  one decode step is what a launch-bound step pays for (docs/performance.md)."""
  return _control_total(
      hlo_text, unknown_trip_count, "hlo_launches",
      lambda comps, roots, shapes, op, shape, rest: (
          0.0 if op in _NO_TRAFFIC or op.endswith("-done") else 1.0))


def _control_total(hlo_text: str, unknown_trip_count, caller: str, per_instruction) -> float:
  """Sum of `per_instruction(comps, roots, shapes, op, shape, rest)` over the top-level
  instructions of the computations control reaches (the entry, loop bodies, calls,
  conditional branches), loops weighted by trip count (`_weighted_total`)."""
  comps, roots, entry = _computations(hlo_text)
  if entry is None:
    raise ValueError(f"{caller}: no ENTRY computation in the HLO text.")
  control = {entry}
  todo = [entry]
  while todo:
    for name, shape, op, rest in comps.get(todo.pop(), []):
      callees = []
      if op == "while":
        callees = re.findall(r"body=%?([\w.\-]+)", rest)
      elif op == "call" or op == "async-start":
        callees = re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", rest)
      elif op == "conditional":
        br = re.search(r"branch_computations=\{([^}]*)\}", rest)
        callees = re.findall(r"%?([\w.\-]+)", br.group(1)) if br else re.findall(
            r"(?:true|false)_computation=%?([\w.\-]+)", rest)
      for c in callees:
        if c in comps and c not in control:
          control.add(c)
          todo.append(c)
  direct = {}
  for c, instrs in comps.items():
    shapes = {i[0]: i[1] for i in instrs}
    direct[c] = (sum(per_instruction(comps, roots, shapes, op, shape, rest)
                     for _, shape, op, rest in instrs) if c in control else 0.0)
  graph, graph_entry, _ = _parse_hlo(hlo_text)
  return _weighted_total(graph, graph_entry, direct, unknown_trip_count)


def loop_iteration(hlo_cost, hlo_text: str, unknown_trip_count) -> float:
  """`hlo_cost` (`hlo_memory_traffic`, `hlo_estimated_cycles`, `hlo_matmul_flops`) of one
  iteration of the outermost loop without a fixed trip count (one decode step of the
  sampler), loops inside it weighted as given: the cost with that loop's weight 1 minus
  the cost with weight 0."""
  weights = (tuple(unknown_trip_count) if isinstance(unknown_trip_count, (tuple, list))
             else (unknown_trip_count,))
  return (hlo_cost(hlo_text, (1,) + weights[1:]) - hlo_cost(hlo_text, (0,) + weights[1:]))


def memory_bytes(compiled) -> dict[str, int]:
  """Per-device bytes of a compiled executable (`memory_analysis()`): arguments, outputs,
  aliased (donated arguments reused as outputs), temporaries, generated code, and peak
  = arguments + outputs - aliased + temporaries."""
  m = compiled.memory_analysis()
  if m is None:
    raise ValueError("memory_analysis() is not available on this backend.")
  out = dict(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
             alias=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes),
             code=int(m.generated_code_size_in_bytes))
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out
