"""Weft's command line.

    python main.py [server flags]            start the server and the editor (http://127.0.0.1:8188)
    python main.py run WORKFLOW [...]        run workflows headless (files, UI or API format, or template names)
    python main.py validate WORKFLOW         check a workflow without running it
    python main.py templates [WORDS]         list the template names `run` and `validate` accept
"""
from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from execution.spec import Registry
    from execution.validation import ValidatedPrompt

from execution.errors import PromptError
from execution.types import AUDIO_HEALTH_KEY

# The engine, the node packs and torch are imported where they are used, so `--help` (and a usage error)
# answers at once: tests/test_main.py checks that printing help imports neither torch nor a node pack.

ROOT = Path(__file__).resolve().parent
WORKFLOWS_DIR = ROOT / "workflows"  # Weft's own templates; the official ones come from their package


# ---------------------------------------------------------------------- arguments
def add_directory_arguments(parser: argparse.ArgumentParser, *, writes: bool = True) -> None:
    """The folder flags; `writes=False` leaves out the folders only a running job writes to."""
    group = parser.add_argument_group("folders")
    group.add_argument("--base-directory", type=Path, default=None, metavar="DIR",
                       help="folder holding models/, input/, output/, user/ and custom_nodes/ (default: Weft's own folder)")
    group.add_argument("--input-directory", type=Path, default=None, metavar="DIR",
                       help="folder of input files (images, videos, audio) that nodes load (default: <base>/input)")
    if writes:
        group.add_argument("--output-directory", type=Path, default=None, metavar="DIR",
                           help="folder saved outputs are written to (default: <base>/output)")
        group.add_argument("--temp-directory", type=Path, default=None, metavar="DIR",
                           help="folder of temporary files such as previews (default: <base>/temp)")
        group.add_argument("--user-directory", type=Path, default=None, metavar="DIR",
                           help="folder of user data: settings and saved workflows (default: <base>/user)")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the server and the headless runner."""
    add_directory_arguments(parser)
    cache = parser.add_argument_group("result cache").add_mutually_exclusive_group()
    cache.add_argument("--cache-classic", action="store_true", help="keep only what the latest prompt used")
    cache.add_argument("--cache-lru", type=int, default=0, metavar="N", help="keep the N most recent node results")
    cache.add_argument("--cache-ram", type=float, nargs="?", const=4.0, default=None, metavar="GB",
                       help="(default) evict results when free RAM falls below GB (4 when not given)")
    cache.add_argument("--cache-none", action="store_true", help="keep no results between runs")
    add_loop_limit_argument(parser)
    for extend in _argument_extensions():
        extend(parser)


def add_loop_limit_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-loop-iterations", type=int, default=10_000, metavar="N",
                        help="refuse loops with more iterations than this at validation time (default 10000)")


def _argument_extensions():
    """Argument groups owned by other parts (memory manager, previews, plugins); their flag modules are torch-free."""
    from media import limits as media_limits
    from models import memory_flags
    from nodes import plugins, preview_settings

    return [memory_flags.add_cli_arguments, media_limits.add_cli_arguments, preview_settings.add_cli_arguments,
            plugins.add_cli_arguments]


def cache_from_args(args: argparse.Namespace):
    """The result cache the cache flags ask for."""
    from execution.cache import CacheKind, make_cache

    if args.cache_classic:
        return make_cache(CacheKind.CLASSIC)
    if args.cache_lru:
        return make_cache(CacheKind.LRU, lru_size=args.cache_lru)
    if args.cache_none:
        return make_cache(CacheKind.NONE)
    return make_cache(CacheKind.RAM, ram_gb=args.cache_ram)


def paths_from_args(args: argparse.Namespace, *, create: bool = True):
    """The folders the flags name; `create=False` only names them (validation writes nothing)."""
    from execution.paths import Paths

    paths = Paths(args.base_directory or ROOT, input=args.input_directory,
                  output=getattr(args, "output_directory", None), temp=getattr(args, "temp_directory", None),
                  user=getattr(args, "user_directory", None))
    return paths.ensure() if create else paths


class Runtime:
    """Everything a server or a headless run needs, wired once.

    `runs_jobs=False` (the `validate` command) wires only what checking needs: no folder is created, no
    memory manager configured and no executor built.
    """

    def __init__(self, args: argparse.Namespace, *, events=None, runs_jobs: bool = True) -> None:
        from execution import context as run_context
        from execution.events import EventBus
        from execution.validation import ValidationMemo
        from nodes.registry import builtin_registry

        self.args = args
        self.paths = paths_from_args(args, create=runs_jobs)
        group = getattr(args, "rank_group", None)  # a cluster.rank_group.RankSpec when this runtime is one rank
        if runs_jobs and group is not None:
            from models import parallel  # before the memory manager: it takes the rank's device

            parallel.join_group(rank=group.rank, size=group.size, address=group.address, timeout_s=group.timeout_s)
        if runs_jobs:
            from media import limits as media_limits
            from models import memory

            memory.configure_from_args(args)
            media_limits.configure_from_args(args)
        self.registry = builtin_registry()
        self.plugin_reports: list[Any] = []
        self.events = events or EventBus()
        settings = {"max_loop_iterations": args.max_loop_iterations}
        if runs_jobs:
            from nodes import preview_settings

            settings.update(preview_settings.services_from_args(args))
        self.services = run_context.Services(**settings)
        run_context.configure(self.paths, self.services)
        # After configure: plugins may list model files (folder_paths) while they import.
        from nodes import plugins
        from execution.job_store import STORE_FILE
        from nodes.pack_server import PackServer

        # PromptServer.instance for this runtime's packs; its prompt_queue reads the server's job store.
        self.pack_server = PackServer(self.events, queue_file=Path(self.paths.user) / STORE_FILE)
        self.plugin_reports = plugins.load_from_args(self.registry, self.paths.base, args, server=self.pack_server)
        self.executor = None
        if runs_jobs:
            from execution.scheduler import Executor

            self.executor = Executor(self.registry, cache=cache_from_args(args), events=self.events,
                                     paths=self.paths, runtime=self.services)
        self.validation_memo = ValidationMemo()  # re-submitting an unchanged prompt skips re-checking it

    def unload_models(self) -> None:
        """Forget the loaded models (the server's /free with unload_models)."""
        self.services.release_shared()

    def validate(self, prompt: dict, *, partial_targets: list[str] | None = None):
        """The one validation path (server, headless runner and the editor's pre-check)."""
        from execution.validation import validate_prompt

        return validate_prompt(prompt, self.registry, partial_targets=partial_targets,
                               options={"max_loop_iterations": self.args.max_loop_iterations},
                               memo=self.validation_memo)

    def prepare(self, data: Any, *, partial_targets: list[str] | None = None,
                adjust: Callable[[Any], None] | None = None) -> tuple[Any, ValidatedPrompt]:
        """(API prompt, validated prompt) from a workflow a client sent or a file held: the one path
        of the server and the CLI. A UI-format workflow is converted first; `adjust` may then edit
        the API prompt (the CLI's --set) before it is validated. PromptError when it cannot run."""
        from execution.convert import to_api_prompt

        prompt = to_api_prompt(data, self.registry)
        if adjust is not None:
            adjust(prompt)
        return prompt, self.validate(prompt, partial_targets=partial_targets)


# ---------------------------------------------------------------------- workflows
def read_workflow_file(path: Path) -> Any:
    """The parsed JSON of a workflow file; PromptError when it is missing or not JSON (nothing imported)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PromptError("invalid_prompt", f"workflow file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise PromptError("invalid_prompt", f"workflow file {str(path)!r} is a folder, not a file") from None
    except json.JSONDecodeError as exc:
        raise PromptError("invalid_prompt", f"workflow file {str(path)!r} is not valid JSON", str(exc)) from None
    except UnicodeDecodeError as exc:
        raise PromptError("invalid_prompt", f"workflow file {str(path)!r} is not UTF-8 text", str(exc)) from None
    return data


def read_workflow(source: str | Path) -> Any:
    """The parsed workflow `source` names: a file when one exists there, else a template by name (Weft's
    `workflows/` first, then the official package; `.json` optional). PromptError naming both places
    when it is neither."""
    from execution import templates

    path = Path(source)
    if path.exists():
        return read_workflow_file(path)
    found = templates.find_template(str(source), WORKFLOWS_DIR)
    if found is None:
        names = templates.local_names(WORKFLOWS_DIR) + templates.official_names()
        similar = templates.similar_names(str(source), names)
        raise PromptError(
            "invalid_prompt",
            f"workflow file {str(source)!r} does not exist, and no template is called that",
            "templates are looked up in workflows/ and in the official template package "
            f"({templates.OFFICIAL_PACKAGE}); `python main.py templates` lists them"
            + (f"; similar names: {', '.join(similar)}" if similar else ""))
    where, text = found
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptError("invalid_prompt", f"template {where} is not valid JSON", str(exc)) from None


def saved_workflow(data: Any) -> Any:
    """The workflow in a parsed file: a saved `/prompt` body (`{"prompt": ...}`) holds it under "prompt"."""
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict) and "nodes" not in data:
        return data["prompt"]
    return data


def _split_set_target(target: str, prompt: dict) -> tuple[str, str] | None:
    """(node id, input name) of `NODE_ID.INPUT`; node ids may hold ':' and input names '.'."""
    candidates = [i for i, ch in enumerate(target) if ch == "."]
    for i in candidates:  # the first split whose left side is a node of the prompt
        if target[:i] in prompt:
            return target[:i], target[i + 1:]
    if candidates:
        return target[:candidates[0]], target[candidates[0] + 1:]
    return None


def declared_inputs(node: dict, registry: Registry) -> list[str] | None:
    """The input names a prompt node's class declares for its current values (None: unknown class)."""
    spec = registry.get(node.get("class_type")) if isinstance(node, dict) else None
    if spec is None:
        return None
    values = node.get("inputs") if isinstance(node.get("inputs"), dict) else {}
    return list(spec.instance_inputs(spec.normalize_input_names(dict(values))))


def _node_by_title(title: str, prompt: dict) -> str | None:
    """The id of the one prompt node titled `title` (`_meta.title`); PromptError when several are."""
    found = [node_id for node_id, node in prompt.items()
             if isinstance(node, dict) and (node.get("_meta") or {}).get("title") == title]
    if len(found) > 1:
        raise PromptError("invalid_prompt", f"--set: {len(found)} nodes are titled {title!r}",
                          f"address one by its id: {', '.join(found)}")
    return found[0] if found else None


def _exposed_matches(target: str, exposed: list) -> list:
    """Exposed subgraph widgets `target` names: `LABEL`, `NAME`, or either after `INSTANCE_TITLE.` or
    `INSTANCE_ID.`."""
    def names(widget) -> set[str]:
        return {widget.label, widget.name}

    plain = [w for w in exposed if target in names(w)]
    if plain:
        return plain
    qualified = []
    for i, ch in enumerate(target):
        if ch == ".":
            owner, rest = target[:i], target[i + 1:]
            qualified += [w for w in exposed if rest in names(w) and owner in (w.instance, w.instance_title)]
    return qualified


def parse_set(assignments: list[str], prompt: dict, registry: Registry | None = None,
              exposed: list | None = None) -> None:
    """Apply `--set TARGET=VALUE` (VALUE read as JSON when it parses, else as text). TARGET is
    `NODE.INPUT`, NODE being a node id or a node's title, or the name (or label) of a widget a subgraph
    exposes (`duration`, optionally `SUBGRAPH_TITLE.duration`), which sets every input it feeds.

    With `registry`, an input the node's class does not declare is refused, naming the inputs it has.
    """
    exposed = exposed or []
    for assignment in assignments:
        target, eq, raw = assignment.partition("=")
        if not eq or not target:
            raise PromptError("invalid_prompt", f"--set {assignment!r}: expected NODE.INPUT=VALUE or WIDGET=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = {"__value__": value}
        for node_id, input_name in _set_targets(assignment, target, prompt, exposed):
            node = prompt[node_id]
            if registry is not None:
                trial = {**node, "inputs": {**(node.get("inputs") or {}), input_name: value}}
                known = declared_inputs(trial, registry)
                spec = registry.get(node.get("class_type"))
                if known is not None and spec.normalize_input_names({input_name: value}).keys() - set(known):
                    raise PromptError(
                        "invalid_prompt",
                        f"--set {assignment!r}: node {node_id} ({node.get('class_type')}) has no input {input_name!r}",
                        f"its inputs: {', '.join(known) or '(none)'}",
                        extra_info={"node_id": node_id, "class_type": node.get("class_type")})
            node.setdefault("inputs", {})[input_name] = value


def _set_targets(assignment: str, target: str, prompt: dict, exposed: list) -> list[tuple[str, str]]:
    """The (node id, input) pairs one --set target addresses (see parse_set)."""
    split = _split_set_target(target, prompt)
    if split is not None and split[0] in prompt and split[1]:
        return [split]
    for i, ch in enumerate(target):  # a title may hold '.': the first split naming a titled node
        if ch == "." and i + 1 < len(target):
            node_id = _node_by_title(target[:i], prompt)
            if node_id is not None:
                return [(node_id, target[i + 1:])]
    widgets = _exposed_matches(target, exposed)
    if len({(w.instance, w.name) for w in widgets}) > 1:
        owners = ", ".join(f"{w.instance_title}.{w.label} (instance {w.instance})" for w in widgets)
        raise PromptError("invalid_prompt", f"--set {assignment!r}: several subgraph widgets are called that",
                          f"qualify it: {owners}")
    if widgets:
        if not widgets[0].targets:
            raise PromptError("invalid_prompt", f"--set {assignment!r}: widget {widgets[0].label!r} feeds no input")
        return list(widgets[0].targets)
    shown = ", ".join(sorted({w.label for w in exposed})[:30])
    raise PromptError("invalid_prompt", f"--set {assignment!r}: no node id or title, and no subgraph widget, is "
                      f"called {target.rpartition('.')[0] or target!r}",
                      f"nodes: {', '.join(list(prompt)[:30])}" + (f"; subgraph widgets: {shown}" if shown else "")
                      + "; `--show-inputs` lists what can be set")


def undeclared_input_warnings(prompt: dict, registry: Registry) -> list[str]:
    """One line per input a prompt node sets that its class does not declare (tolerated, as ComfyUI does)."""
    warnings = []
    for node_id, node in prompt.items():
        known = declared_inputs(node, registry)
        if known is None or not isinstance(node.get("inputs"), dict):
            continue
        spec = registry.get(node["class_type"])
        extra = [name for name in spec.normalize_input_names(dict(node["inputs"])) if name not in known]
        if extra:
            warnings.append(f"node {node_id} ({node['class_type']}): input(s) {', '.join(map(repr, extra))} are "
                            f"not declared by the node and are ignored; its inputs: {', '.join(known) or '(none)'}")
    return warnings


def written_files(result, paths) -> list[str]:
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

    def start(self, prompt: dict) -> None:
        """Follow the next job, of `prompt` (the API prompt whose node classes it shows)."""
        self.prompt = prompt
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


def _workflow_parser(prog: str, description: str, *, several: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    what = ("a workflow file (UI format, as the editor saves it, or API format, as /prompt takes it) or a "
            "template's name (`python main.py templates` lists them)")
    if several:
        parser.add_argument("workflows", nargs="+", metavar="workflow",
                            help=what + "; several run one after another in this process, each reusing the models "
                                        "and node results the ones before it computed (--set applies to each)")
    else:
        parser.add_argument("workflow", help=what)
    parser.add_argument("--set", action="append", default=[], metavar="TARGET=VALUE",
                        help="override one input before checking (repeatable): NODE.INPUT=VALUE with NODE a node id "
                             "or title (--set 3.seed=42, --set 'Resolution Selector.megapixels=0.1'), or a widget a "
                             "subgraph exposes by its name (--set duration=1). VALUE is read as JSON when it parses, "
                             "else as text; `--show-inputs` lists the targets")
    parser.add_argument("--show-inputs", action="store_true",
                        help="list the workflow's adjustable inputs (what --set can address) and their values, "
                             "then stop")
    parser.add_argument("--verbose", action="store_true",
                        help="print an error in full (JSON, with a failed node's traceback), not as one line")
    return parser


def adjustable_inputs(prompt: dict, exposed: list) -> list[dict[str, Any]]:
    """What `--set` can address: each widget a subgraph exposes, then each constant input of the nodes
    outside subgraphs (by node id, with the node's title)."""
    def now(widget) -> Any:  # the value after any --set: what its first target holds
        node, name = widget.targets[0]
        return (prompt.get(node) or {}).get("inputs", {}).get(name, widget.value)

    rows = [{"set": w.label, "value": now(w), "subgraph": w.instance_title,
             "feeds": [f"{node}.{name}" for node, name in w.targets]} for w in exposed if w.targets]
    for node_id, node in prompt.items():
        if ":" in node_id or not isinstance(node, dict):
            continue
        title = (node.get("_meta") or {}).get("title") or node.get("class_type")
        for name, value in (node.get("inputs") or {}).items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                continue  # a link, not a value
            rows.append({"set": f"{node_id}.{name}", "value": value, "title": title})
    return rows


def _print_inputs(rows: list[dict[str, Any]], stream=sys.stdout) -> None:
    width = max((len(r["set"]) for r in rows), default=10)
    for row in rows:
        shown = json.dumps(row["value"], default=repr)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        where = f"({row['subgraph']}: {', '.join(row['feeds'])})" if "feeds" in row else f"({row['title']})"
        print(f"  --set {row['set']:<{width}} = {shown:<60} {where}", file=stream)


def format_prompt_error(error: PromptError) -> str:
    """A workflow that cannot run, for a person: one line for the workflow, one per failing input."""
    lines = []
    for node_id, entry in (error.node_errors or {}).items():
        for item in entry.get("errors") or []:
            name = (item.get("extra_info") or {}).get("input_name")
            where = f"node {node_id} ({entry.get('class_type')})" + (f", input {name!r}" if name else "")
            # A node check's details already say what is wrong; its fixed message would only repeat it.
            what = item.get("details") or item.get("message")
            lines.append(f"error: {where}: {what}")
    if not lines:  # a workflow-level problem: no node to name
        lines.append(f"error: {error.message}" + (f": {error.details}" if error.details else ""))
    return "\n".join(lines)


def format_run_error(error: dict) -> str:
    """A run that failed in a node, as one line: the node, its type and what went wrong."""
    node = error.get("node_id")
    where = f"node {node} ({error.get('node_type')})" if node is not None else "the run"
    message = str(error.get("exception_message") or error.get("message") or "failed").strip()
    return f"error: {where} failed: {message}"


def _report_prompt_error(error: PromptError, args: argparse.Namespace) -> None:
    if getattr(args, "json", False) or args.verbose:
        print(json.dumps(error.to_json(), indent=None if getattr(args, "json", False) else 2))
    else:
        print(format_prompt_error(error), file=sys.stderr)


def _validated_workflow(args: argparse.Namespace, runtime: Runtime, source: str):
    """Read, override (--set) and validate the workflow `source`; PromptError when it cannot run."""
    from execution.convert import exposed_widgets

    workflow = saved_workflow(read_workflow(source))
    exposed = exposed_widgets(workflow, runtime.registry)
    return runtime.prepare(workflow, adjust=lambda prompt: parse_set(args.set, prompt, runtime.registry, exposed))


def _show_inputs(args: argparse.Namespace, runtime: Runtime, source: str) -> int:
    """`--show-inputs`: the workflow's adjustable inputs (after --set), without validating or running it."""
    from execution.convert import exposed_widgets, to_api_prompt

    try:
        workflow = saved_workflow(read_workflow(source))
        exposed = exposed_widgets(workflow, runtime.registry)
        prompt = to_api_prompt(workflow, runtime.registry)
        parse_set(args.set, prompt, runtime.registry, exposed)
    except PromptError as error:
        _report_prompt_error(error, args)
        return 2
    print(f"adjustable inputs of {source}:")
    _print_inputs(adjustable_inputs(prompt, exposed))
    return 0


def run_parser() -> argparse.ArgumentParser:
    """`main.py run`'s command line."""
    parser = _workflow_parser("main.py run", "Run a workflow headless and print where its outputs went.", several=True)
    parser.add_argument("--profile-json", type=Path, default=None, metavar="PATH",
                        help="also write the per-node timing profile to PATH as JSON (a list of them, in order, "
                             "when several workflows run)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (one line per workflow) instead of text")
    add_common_arguments(parser)
    return parser


def validate_parser() -> argparse.ArgumentParser:
    """`main.py validate`'s command line: only the flags that change what a check finds."""
    parser = _workflow_parser("main.py validate", "Check a workflow without running it (creates and writes nothing).")
    add_directory_arguments(parser, writes=False)
    add_loop_limit_argument(parser)
    from nodes import plugins

    plugins.add_cli_arguments(parser)
    return parser


def sound_warnings(outputs: dict, prompt: dict) -> list[str]:
    """One line per checked sound that crossed a threshold (the `audio_health` entries of the outputs)."""
    lines = []
    for node_id, ui in outputs.items():
        entries = ui.get(AUDIO_HEALTH_KEY) if isinstance(ui, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("warnings"):
                node_type = prompt.get(node_id, {}).get("class_type", "")
                lines.append(f"node {node_id} ({node_type}) {entry.get('file', 'sound')}: "
                             + "; ".join(map(str, entry["warnings"])))
    return lines


def server_parser() -> argparse.ArgumentParser:
    """`main.py`'s command line (the server)."""
    from web.flags import build_parser

    return build_parser(add_common_arguments)


def command_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    try:
        for source in args.workflows:
            read_workflow(source)  # a missing or broken file is reported before any set-up
    except PromptError as error:
        _report_prompt_error(error, args)
        return 2
    if args.preview_method is None:
        args.preview_method = "none"  # nobody sees previews on a terminal: skip fitting and drawing them
    runtime = Runtime(args)
    if args.show_inputs:
        return max(_show_inputs(args, runtime, source) for source in args.workflows)
    progress = None if args.json else TerminalProgress({})
    if progress is not None:
        runtime.events.subscribe(progress)
    profiles = []
    for source in args.workflows:
        # One runtime for all: a later workflow finds the earlier ones' models and node results in its
        # caches, so a workflow run again with one input changed re-runs only what that input reaches.
        try:
            prompt, validated = _validated_workflow(args, runtime, source)
        except PromptError as error:
            _report_prompt_error(error, args)
            return 2
        if progress is not None:
            progress.start(prompt)
        result = _run_one(args, runtime, validated)
        profiles.append(result.profile)
        if args.profile_json:
            profile = profiles[0] if len(args.workflows) == 1 else profiles
            args.profile_json.write_text(json.dumps(profile, indent=2))
        if result.status != "success":
            return 1
    return 0


def _run_one(args: argparse.Namespace, runtime: Runtime, validated):
    """Run one validated workflow in this process and print its report; the job's result."""
    prompt_id = str(uuid.uuid4())
    # In this process, not a worker: a headless run has no server to keep answering, and ^C stops it.
    result = runtime.executor.run(validated, prompt_id=prompt_id)
    files = written_files(result, runtime.paths)
    if args.json:
        print(json.dumps({"prompt_id": prompt_id, "status": result.status, "outputs": result.outputs,
                          "files": files, "profile": result.profile, "error": result.error}, default=repr))
        return result
    from execution.scheduler import print_profile_table

    print_profile_table(result, validated.prompt)
    if result.status != "success":
        if args.verbose:
            print(json.dumps(result.error, indent=2, default=repr))
        else:
            print(format_run_error(result.error or {}), file=sys.stderr)
            print("(run again with --verbose for the full error and its traceback)", file=sys.stderr)
    for text in (t for ui in result.outputs.values() for t in ui.get("text", []) if isinstance(t, str)):
        print(f"text: {text[:500]}")
    for line in sound_warnings(result.outputs, validated.prompt.raw):
        print(f"warning: {line}", file=sys.stderr)
    for path in files:
        print(f"wrote {path}")
    return result


def command_validate(argv: list[str]) -> int:
    args = validate_parser().parse_args(argv)
    try:
        read_workflow(args.workflow)  # a missing or broken file is reported before any set-up
        runtime = Runtime(args, runs_jobs=False)
        if args.show_inputs:
            return _show_inputs(args, runtime, args.workflow)
        prompt, validated = _validated_workflow(args, runtime, args.workflow)
    except PromptError as error:
        print(json.dumps(error.to_json(), indent=2))
        if not args.verbose:
            print(format_prompt_error(error), file=sys.stderr)
        return 2
    warnings = undeclared_input_warnings(prompt, runtime.registry)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    print(json.dumps({"valid": True, "outputs": validated.outputs, "node_errors": validated.node_errors,
                      "warnings": warnings}, indent=2))
    return 0


def templates_parser() -> argparse.ArgumentParser:
    """`main.py templates`'s command line."""
    parser = argparse.ArgumentParser(prog="main.py templates",
                                     description="List the template names `run` and `validate` accept: Weft's own "
                                                 "(workflows/) and the official ones, grouped as the editor groups them.")
    parser.add_argument("words", nargs="*", help="only names containing every one of these words (e.g. h3)")
    parser.add_argument("--write-examples", metavar="INPUT_DIR", default=None,
                        help="instead of listing: write small example pictures under the names the official H3 "
                             "templates load into INPUT_DIR (a file already there is kept), for the tiny models")
    return parser


def command_templates(argv: list[str]) -> int:
    from execution import templates

    args = templates_parser().parse_args(argv)
    if args.write_examples is not None:
        for path in templates.write_example_inputs(Path(args.write_examples)):
            print(f"{'example input':60s} {path}")
        return 0

    def wanted(name: str) -> bool:
        return all(word.lower() in name.lower() for word in args.words)

    local = [n for n in templates.local_names(WORKFLOWS_DIR) if wanted(n)]
    if local:
        print("Weft (workflows/):")
        for name in local:
            print(f"  {name}")
    listed = set()
    for category in templates.official_categories():
        names = [e["name"] for e in category.entries if wanted(e["name"]) and e["name"] not in listed]
        if names:
            print(f"{category.title} (official):")
            for entry in category.entries:
                if entry["name"] in names:
                    listed.add(entry["name"])
                    print(f"  {entry['name']:<48} {str(entry.get('title') or '')[:70]}")
    rest = [n for n in templates.official_names() if wanted(n) and n not in listed]
    if rest:
        print("Other (official):")
        for name in rest:
            print(f"  {name}")
    if not (local or listed or rest):
        print("no template matches " + " ".join(args.words), file=sys.stderr)
        return 1
    return 0


def command_serve(argv: list[str]) -> int:
    parser = server_parser()
    args = parser.parse_args(argv)  # --help and usage errors end here, before the server is imported
    from web import server

    return server.serve(parser, args, runtime_factory=Runtime, worker_pool=worker_pool_from_args(parser, args))


def worker_pool_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The Ray worker pool --workers / --ray-address ask for, or None (then Ray is never imported)."""
    ranks = getattr(args, "ranks_per_worker", 1)
    if ranks < 1:
        parser.error(f"--ranks-per-worker {ranks}: a worker needs at least one rank")
    if args.workers is None and not args.ray_address:
        if ranks == 1:
            return None
        if args.in_process_jobs:
            parser.error("--ranks-per-worker runs a job on several processes; it cannot be used with --in-process-jobs")
        from cluster.rank_group import local_group_pool

        return local_group_pool(ranks, timeout_s=args.rank_timeout)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers {args.workers}: at least one worker is needed")
    if args.worker_threads is not None and args.worker_threads < 1:
        parser.error("--worker-threads must be at least 1")
    try:
        from cluster.ray_pool import pool_from_args
    except ImportError as exc:
        parser.error(f"--workers and --ray-address run jobs on Ray, which is not installed ({exc}); "
                     "install it with: pip install ray==2.60.0")
    return pool_from_args(args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return command_run(argv[1:])
    if argv and argv[0] == "validate":
        return command_validate(argv[1:])
    if argv and argv[0] == "templates":
        return command_templates(argv[1:])
    return command_serve(argv)


if __name__ == "__main__":
    sys.exit(main())
