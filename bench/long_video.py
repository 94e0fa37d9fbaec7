"""Long H3 clips on the tiny models, both ways Weft makes a clip longer than one pass, in one run.

    python bench/long_video.py [--cases windowed segments]

Cases, each in its own process (its script prints its own table; see its docstring for the method):
  windowed   bench/long_video_windows.py: a clip sampled in context windows against one pass over the same
             clip: time, peak memory, the largest block output.
  segments   bench/long_video_segments.py: a 4-segment chained clip: the full run against re-making its
             last segment from the cache (goal <= 0.35x), and how the seams look.

The last line printed is one JSON object: {"windowed": ..., "segments": ...}, each the figures its script
printed as its own last line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"windowed": HERE / "long_video_windows.py", "segments": HERE / "long_video_segments.py"}


def run_case(name: str) -> dict:
    """Run one case's script, passing its table through; the figures of its last line."""
    done = subprocess.run([sys.executable, str(SCRIPTS[name])], stdout=subprocess.PIPE, text=True, check=True)
    lines = done.stdout.rstrip("\n").splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    args = parser.parse_args()
    figures = {}
    for name in args.cases:
        print(f"== {name} ({SCRIPTS[name].name})", flush=True)
        figures[name] = run_case(name)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
