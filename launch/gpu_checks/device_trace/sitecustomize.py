"""Import tracer of `launch/gpu_checks/device_check.sh --trace-imports FILE` (nothing else loads it).

device_check.sh puts this directory first on PYTHONPATH and sets HGPO_TRACE_IMPORTS=FILE;
every Python process of the step (the env servers it starts included: they inherit both)
then appends the first two dotted components of each module it imports to FILE (`google.protobuf`:
a namespace package's distribution shows in the second), once per process, as the import happens (so a server ended by a signal has still written its names).
`launch/gpu_checks/device_wheels.sh --closure FILE` maps the names to distributions.
"""

import os
import sys

_LOG = os.environ.get("HGPO_TRACE_IMPORTS")
if _LOG:
  _seen: set[str] = set()

  def _hook(event, args):
    if event != "import":
      return
    top = ".".join(str(args[0]).split(".")[:2])
    if top and top not in _seen:
      _seen.add(top)
      with open(_LOG, "a") as f:
        f.write(top + "\n")

  sys.addaudithook(_hook)
