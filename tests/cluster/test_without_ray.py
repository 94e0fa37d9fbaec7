"""Without --workers or --ray-address nothing of Ray is imported: the server runs jobs as before."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys, tempfile
import main
from tests.web.conftest import const_prompt, post_json, wait_terminal
from tests.web.serve import ServerThread

parser = main.server_parser()
assert main.worker_pool_from_args(parser, parser.parse_args([])) is None
server = ServerThread(tempfile.mkdtemp(), light=True)
status, reply = post_json(server.url + "/prompt", {"prompt": const_prompt(3, "plain")})
record = wait_terminal(server.url, reply["prompt_id"], 60)
server.stop()
print("STATUS", record["status"]["status_str"])
print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "cluster")))
"""


def test_a_server_without_pool_flags_imports_nothing_of_ray():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "STATUS success" in done.stdout and "LOADED []" in done.stdout, done.stdout


def test_pool_flags_are_checked_before_ray_starts():
    import main

    parser = main.server_parser()
    probe = ("import main\nparser = main.server_parser()\n"
             "main.worker_pool_from_args(parser, parser.parse_args(['--workers', '0']))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--workers 0: at least one worker is needed" in done.stderr
    build = main.worker_pool_from_args(parser, parser.parse_args(["--workers", "2", "--worker-threads", "1"]))
    assert callable(build)  # Ray itself starts only when the server builds its pool
