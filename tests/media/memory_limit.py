"""Run a piece of decoding in a child process under an address-space limit, and report what happened.

The child imports what it needs first, then caps its own address space at what it has mapped so far
plus `headroom_mb`: a decoder that spends more memory than that gets a MemoryError (or dies), while
a refusal made before decoding comes back as the decoder's own error. The report also gives the peak
resident memory the call added.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_CHILD = r'''
import json, re, resource, sys, traceback
{imports}

def _status_kb(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1))

def _reset_peak():
    # Writing 5 to clear_refs resets the peak resident size (VmHWM), so the peak read after the call is
    # the call's own, not the imports' (Linux 4.0 and later).
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")

mapped = int(re.search(r"VmSize:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
cap = mapped + {headroom_mb} * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
_reset_peak()
before_kb = _status_kb("VmRSS")
outcome = {{"error": None, "type": None}}
try:
{call}
    outcome["type"] = "returned"
except BaseException as exc:
    outcome["type"] = type(exc).__name__
    outcome["error"] = str(exc)
peak_kb = _status_kb("VmHWM")
outcome["added_mb"] = max(0, peak_kb - before_kb) / 1024
print("OUTCOME " + json.dumps(outcome), flush=True)
'''


def run_under_memory_limit(imports: str, call: str, *, headroom_mb: int = 768, timeout_s: float = 300) -> dict:
    """{'type': exception class name or 'returned', 'error': message, 'added_mb': peak growth} of `call`."""
    source = _CHILD.format(imports=textwrap.dedent(imports), headroom_mb=headroom_mb,
                           call=textwrap.indent(textwrap.dedent(call), "    "))
    root = Path(__file__).resolve().parents[2]
    # Few malloc arenas and decoder threads: each reserves address space the cap would count.
    env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout_s,
                          cwd=root, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("OUTCOME "):
            return json.loads(line[len("OUTCOME "):])
    # No report: the child died (a decoder that ran out of memory inside C code).
    return {"type": f"died with exit code {done.returncode}", "error": done.stderr[-2000:], "added_mb": None}
