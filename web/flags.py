"""The server's command-line flags, importable without aiohttp or torch so `main.py --help` is instant."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable


def build_parser(add_common_arguments: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """The server's command line: ComfyUI's flags plus the common ones."""
    parser = argparse.ArgumentParser(
        prog="main.py", description="Weft: serve the node editor and its HTTP/websocket protocol.",
        epilog="Other commands: `main.py run WORKFLOW.json` runs a workflow headless, `main.py validate "
               "WORKFLOW.json` checks one without running it (each takes --help).")
    parser.add_argument("--listen", type=str, default="127.0.0.1", nargs="?", const="0.0.0.0,::", metavar="IP",
                        help="addresses to listen on, comma-separated (default 127.0.0.1; without a value: all)")
    parser.add_argument("--port", type=int, default=8188, help="TCP port to listen on (default 8188; 0 picks a free one)")
    parser.add_argument("--max-upload-size", type=float, default=100, metavar="MB",
                        help="largest request body, in MB (default 100)")
    parser.add_argument("--front-end-root", type=Path, default=None, metavar="DIR",
                        help="serve another editor build from this folder instead of comfyui-frontend-package")
    parser.add_argument("--token", type=str, default=None, metavar="TOKEN",
                        help="access token clients must present (generated and printed when listening beyond loopback)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="listen beyond loopback without a token (anyone who can reach the port runs jobs)")
    parser.add_argument("--allowed-hosts", type=str, default="", metavar="HOSTS",
                        help="comma-separated host names the server may be reached by, beside loopback")
    parser.add_argument("--history-size", type=int, default=10_000, metavar="N",
                        help="finished jobs kept in the history (default 10000)")
    parser.add_argument("--interrupt-grace", type=float, default=10.0, metavar="SECONDS",
                        help="after an interrupt, how long a running node may take to stop before its worker "
                             "process is killed and restarted (default 10)")
    parser.add_argument("--in-process-jobs", action="store_true",
                        help="run jobs on a thread of the server's process instead of a worker process (one "
                             "process to debug; a node that never yields then stalls the server)")
    group = parser.add_argument_group("one job on several devices (sequence parallel)")
    group.add_argument("--ranks-per-worker", type=int, default=1, metavar="N",
                       help="run each job on N ranks (processes, one device each) that split the H3 transformer's "
                            "sequence and the video decode; N must divide the model's head count (56 for H3: 1, 2, "
                            "4, 7, 8). Without Ray the one worker is N local processes")
    group.add_argument("--rank-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long a rank waits for the others inside a collective before the job fails and "
                            "the group is restarted (default 300)")
    cluster = parser.add_argument_group("workers on Ray (needs the ray package: pip install ray==2.60.0)")
    cluster.add_argument("--workers", type=int, default=None, metavar="N",
                         help="run jobs on N workers: with --ray-address, actors on the cluster (default one per "
                              "GPU); alone, a local Ray instance with N CPU workers")
    cluster.add_argument("--ray-address", type=str, default=None, metavar="ADDR",
                         help="join the Ray cluster at ADDR (host:port, or 'auto' on a cluster machine); every "
                              "machine needs Weft and the same model folders at the same paths")
    cluster.add_argument("--worker-gpus", type=float, default=None, metavar="G",
                         help="GPUs each Ray worker takes (default 1 when the cluster has GPUs, else 0)")
    cluster.add_argument("--worker-threads", type=int, default=None, metavar="T",
                         help="compute threads each Ray worker uses (default: torch's own choice)")
    add_common_arguments(parser)
    return parser
