"""Weft's command line.

    python main.py [server flags]            start the server and the editor (http://127.0.0.1:8188)
    python main.py run WORKFLOW.json [...]   run a workflow headless (UI or API format)
    python main.py validate WORKFLOW.json    check a workflow without running it
"""
from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from execution import context as run_context
from execution.cache import make_cache
from execution.errors import PromptError
from execution.events import EventBus
from execution.paths import Paths
from execution.scheduler import Executor, JobResult, print_profile_table
from execution.validation import ValidationMemo, validate_prompt

ROOT = Path(__file__).resolve().parent


# ---------------------------------------------------------------------- arguments
def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the server and the headless runner."""
    parser.add_argument("--base-directory", type=Path, default=None,
                        help="folder holding models/, input/, output/, user/ and custom_nodes/ (default: Weft's own folder)")
    parser.add_argument("--output-directory", type=Path, default=None)
    parser.add_argument("--input-directory", type=Path, default=None)
    parser.add_argument("--temp-directory", type=Path, default=None)
    parser.add_argument("--user-directory", type=Path, default=None)
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cache-classic", action="store_true", help="keep only what the latest prompt used")
    cache.add_argument("--cache-lru", type=int, default=0, metavar="N", help="keep the N most recent node results")
    cache.add_argument("--cache-ram", type=float, nargs="?", const=4.0, default=None, metavar="GB",
                       help="(default) evict results when free RAM falls below GB (4 when not given)")
    cache.add_argument("--cache-none", action="store_true", help="keep no results between runs")
    parser.add_argument("--max-loop-iterations", type=int, default=10_000,
                        help="refuse loops with more iterations than this at validation time")
    for extend in _argument_extensions():
        extend(parser)


def _argument_extensions():
    """Argument groups owned by other parts (memory manager, plugins), when present."""
    extensions = []
    try:
        from models import memory

        extensions.append(memory.add_cli_arguments)
    except (ImportError, AttributeError):
        pass
    from nodes import plugins

    extensions.append(plugins.add_cli_arguments)
    return extensions


def cache_from_args(args: argparse.Namespace):
    if args.cache_classic:
        return make_cache("classic")
    if args.cache_lru:
        return make_cache("lru", lru_size=args.cache_lru)
    if args.cache_none:
        return make_cache("none")
    return make_cache("ram", ram_gb=args.cache_ram)


def paths_from_args(args: argparse.Namespace) -> Paths:
    base = args.base_directory or ROOT
    return Paths(base, input=args.input_directory, output=args.output_directory, temp=args.temp_directory,
                 user=args.user_directory).ensure()


class Runtime:
    """Everything a server or a headless run needs, wired once."""

    def __init__(self, args: argparse.Namespace, *, events: EventBus | None = None) -> None:
        from nodes.registry import builtin_registry

        self.args = args
        self.paths = paths_from_args(args)
        try:
            from models import memory

            memory.configure_from_args(args)
        except (ImportError, AttributeError):
            pass
        self.registry = builtin_registry()
        self.plugin_reports: list[Any] = []
        self.events = events or EventBus()
        services = {"max_loop_iterations": args.max_loop_iterations}
        run_context.configure(self.paths, services)
        # After configure: plugins may list model files (folder_paths) while they import.
        from nodes import plugins

        self.plugin_reports = plugins.load_from_args(self.registry, self.paths.base, args)
        self.executor = Executor(self.registry, cache=cache_from_args(args), events=self.events, paths=self.paths,
                                 runtime=services)
        self.validation_memo = ValidationMemo()  # re-submitting an unchanged prompt skips re-checking it

    def validate(self, prompt: dict, *, partial_targets: list[str] | None = None):
        """The one validation path (server, headless runner and the editor's pre-check)."""
        return validate_prompt(prompt, self.registry, partial_targets=partial_targets,
                               options={"max_loop_iterations": self.args.max_loop_iterations},
                               memo=self.validation_memo)


# ---------------------------------------------------------------------- workflows
def load_workflow(path: Path, registry) -> dict:
    """Read a UI- or API-format workflow file and return an API prompt."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PromptError("invalid_prompt", f"workflow file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise PromptError("invalid_prompt", f"workflow file {str(path)!r} is not valid JSON", str(exc)) from None
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict) and "nodes" not in data:
        data = data["prompt"]
    from execution.convert import is_ui_workflow, ui_to_api

    if is_ui_workflow(data):
        return ui_to_api(data, registry)
    return data


def parse_set(assignments: list[str], prompt: dict) -> None:
    """Apply `--set NODE_ID.INPUT=VALUE` (VALUE read as JSON when it parses, else as text)."""
    for assignment in assignments:
        target, eq, raw = assignment.partition("=")
        node_id, dot, input_name = target.rpartition(".") if target.count(".") > 1 else target.partition(".")
        if not eq or not dot or not node_id or not input_name:
            raise PromptError("invalid_prompt", f"--set {assignment!r}: expected NODE_ID.INPUT=VALUE")
        if node_id not in prompt:
            raise PromptError("invalid_prompt", f"--set {assignment!r}: the workflow has no node {node_id!r}",
                              f"nodes: {', '.join(list(prompt)[:30])}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = {"__value__": value}
        prompt[node_id].setdefault("inputs", {})[input_name] = value


def written_files(result: JobResult, paths: Paths) -> list[str]:
    """Files the job's output nodes reported, as absolute paths."""
    files = []
    for ui in result.outputs.values():
        for items in ui.values():
            if not isinstance(items, list):
                continue
            for item in items:
                if isinstance(item, dict) and "filename" in item and item.get("type", "output") in ("output", "temp"):
                    folder = paths.folder(item.get("type", "output"))
                    files.append(str(folder / item.get("subfolder", "") / item["filename"]))
    return files


class TerminalProgress:
    """A one-line progress display on a terminal, fed by the event stream."""

    def __init__(self, prompt: dict, stream=sys.stderr) -> None:
        self.prompt = prompt
        self.stream = stream
        self.enabled = stream.isatty()
        self.done = 0

    def __call__(self, event: str, data: dict) -> None:
        if not self.enabled:
            return
        if event == "executing" and data.get("node") is not None:
            self.done += 1
            node = data["node"]
            cls = self.prompt.get(node, {}).get("class_type", "")
            self._line(f"[{self.done}] {node} {cls}")
        elif event == "progress":
            width = 30
            filled = int(width * data["value"] / max(data["max"], 1))
            self._line(f"[{self.done}] {data.get('node')} |{'#' * filled}{'.' * (width - filled)}| "
                       f"{data['value']}/{data['max']}")
        elif event == "progress_text":
            self._line(f"[{self.done}] {data.get('node')} {data.get('text')}")
        elif event in ("execution_success", "execution_error", "execution_interrupted"):
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _line(self, text: str) -> None:
        self.stream.write("\r\033[K" + text[:120])
        self.stream.flush()


def _workflow_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("workflow", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="NODE_ID.INPUT=VALUE")
    return parser


def _validated_workflow(args: argparse.Namespace, runtime: Runtime):
    """Read, override (--set) and validate the workflow; PromptError when it cannot run."""
    prompt = load_workflow(args.workflow, runtime.registry)
    parse_set(args.set, prompt)
    return prompt, runtime.validate(prompt)


def command_run(argv: list[str]) -> int:
    parser = _workflow_parser("main.py run", "Run a workflow headless.")
    parser.add_argument("--profile-json", type=Path, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    runtime = Runtime(args)
    try:
        prompt, validated = _validated_workflow(args, runtime)
    except PromptError as error:
        print(json.dumps(error.to_json(), indent=None if args.json else 2))
        return 2
    if not args.json:
        runtime.events.subscribe(TerminalProgress(prompt))
    prompt_id = str(uuid.uuid4())
    result = runtime.executor.run(validated, prompt_id=prompt_id)
    files = written_files(result, runtime.paths)
    if args.profile_json:
        args.profile_json.write_text(json.dumps(result.profile, indent=2))
    if args.json:
        print(json.dumps({"prompt_id": prompt_id, "status": result.status, "outputs": result.outputs,
                          "files": files, "profile": result.profile, "error": result.error}, default=repr))
    else:
        print_profile_table(result, validated.prompt)
        if result.status != "success":
            print(json.dumps(result.error, indent=2, default=repr))
        for text in (t for ui in result.outputs.values() for t in ui.get("text", []) if isinstance(t, str)):
            print(f"text: {text[:500]}")
        for path in files:
            print(f"wrote {path}")
    return 0 if result.status == "success" else 1


def command_validate(argv: list[str]) -> int:
    parser = _workflow_parser("main.py validate", "Check a workflow without running it.")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    runtime = Runtime(args)
    try:
        _, validated = _validated_workflow(args, runtime)
    except PromptError as error:
        print(json.dumps(error.to_json(), indent=2))
        return 2
    print(json.dumps({"valid": True, "outputs": validated.outputs, "node_errors": validated.node_errors}, indent=2))
    return 0


def command_serve(argv: list[str]) -> int:
    from web import server

    return server.main(argv, add_common_arguments=add_common_arguments, runtime_factory=Runtime)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return command_run(argv[1:])
    if argv and argv[0] == "validate":
        return command_validate(argv[1:])
    return command_serve(argv)


if __name__ == "__main__":
    sys.exit(main())
