"""Every `orthrus-rag run`, `index`, `serve` and `plan` command the docs show composes against the app's config: a
typo'd key, a removed option or a wrong group option in README.md or docs/**.md fails here, naming the doc line.

The commands come from the shell and text blocks (continuation lines joined, trailing comments, a `$ ` prompt,
leading `VAR=value` environment settings and a trailing `&` dropped) and from the inline code spans of the prose.
Each one's overrides are composed as the CLI composes them (Hydra's compose API, config "config" of
`orthrus_rag.conf`; a `-m` sweep takes the first value of each swept key; `resume=` without the saved-config logic);
then the values go through `validate()` and the model-free checks of the command itself (serve: the deploy mode
and its index settings), with every file and folder the command names made in tmp_path. No model loads."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_BLOCKS = {"bash", "console", "shell", "sh", "zsh", "text", ""}
COMMAND = re.compile(r"^orthrus-rag\s+(run|index|serve|plan)\b")
# Hydra's own flags: what they take, and that they change nothing in the composed config
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--resolve", "--version"}
MULTIRUN = {"-m", "--multirun"}
# placeholders the test fills: a count, and a path key's value (made in tmp_path below)
COUNT_PLACEHOLDERS = {"N": "2", "K": "5"}
PATH_KEYS = {"dataset.path", "corpus.path", "retriever.index_dir", "ingest.path", "resume", "run_dir", "model.name"}
PATH_PLACEHOLDER = re.compile(r"^(<[^<>]+>|FILE|DIR|PATH|RUN_DIR|FOLDER)$")

# Commands the docs show wrongly today, keyed by the exact command text (as extracted): each fails to compose or to
# validate, and the docs are to be fixed. Keep this empty: an entry here is a doc bug still open.
KNOWN_BROKEN: set[str] = set()


def _shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every line of the shell and text blocks, `\\` continuations joined."""
    lines = text.splitlines()
    out: list[tuple[int, str]] = []
    fence: tuple[str, str] | None = None
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if fence is None:
            if m:
                fence = (m.group(1), m.group(2).lower())
            i += 1
            continue
        if m and m.group(1).startswith(fence[0][0]) and len(m.group(1)) >= len(fence[0]) and not m.group(2):
            fence = None
            i += 1
            continue
        start, line = i, lines[i].strip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        if fence[1] in SHELL_BLOCKS:
            out.append((start + 1, line))
    return out


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the inline code spans outside fenced blocks (a span may wrap onto the next line)."""
    prose, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            prose.append("")
        else:
            prose.append("" if inside else line)
    joined = "\n".join(prose)
    return [(joined.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined)]


def _drop_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` inside quotes, or inside a word, stays)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _clean(line: str) -> str:
    line = _drop_comment(re.sub(r"^\$\s+", "", line.strip())).strip()
    line = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", line)  # VAR=value before the command
    return line.removesuffix("&").strip()


def doc_commands() -> list[tuple[str, str]]:
    """("file:line", command) of every `orthrus-rag run|index|serve` command in README.md and docs/."""
    found: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        for lineno, line in _shell_lines(text):
            command = _clean(line)
            if COMMAND.match(command):
                found.append((f"{name}:{lineno}", command))
        for lineno, span in _inline_spans(text):
            command = _clean(span)
            if COMMAND.match(command) and len(command.split()) > 2:  # a bare `orthrus-rag run` names the command
                found.append((f"{name}:{lineno}", command))
    return found


COMMANDS = doc_commands()


def _ids(commands: list[tuple[str, str]]) -> list[str]:
    seen: dict[str, int] = {}
    ids = []
    for where, _ in commands:
        seen[where] = seen.get(where, 0) + 1
        ids.append(where if seen[where] == 1 else f"{where}#{seen[where]}")
    return ids


class Unfillable(Exception):
    """A placeholder the test cannot sensibly fill."""


def parse(command: str) -> tuple[str, list[str], bool]:
    """(subcommand, Hydra overrides, multirun) of a doc command; placeholders filled or Unfillable."""
    if "..." in command or "…" in command or "$" in command:
        raise Unfillable("an elided part or a shell variable")
    argv = shlex.split(command)
    sub, rest = argv[1], argv[2:]
    overrides: list[str] = []
    multirun = False
    i = 0
    while i < len(rest):
        arg = rest[i]
        i += 1
        if arg in MULTIRUN:
            multirun = True
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            i += 1
        elif arg in HYDRA_FLAGS:
            pass
        elif "=" not in arg:
            raise Unfillable(f"a placeholder for more overrides: {arg!r}" if arg.startswith("<")
                             else f"not an override: {arg!r}")
        else:
            key, value = arg.split("=", 1)
            if value in COUNT_PLACEHOLDERS:
                value = COUNT_PLACEHOLDERS[value]
            elif PATH_PLACEHOLDER.match(value):
                if key.lstrip("+~") not in PATH_KEYS:
                    raise Unfillable(f"a placeholder for {key}")
                value = "placeholder"
            elif "<" in value or ">" in value:
                raise Unfillable(f"a placeholder in {arg!r}")
            overrides.append(f"{key}={value}")
    if multirun:
        overrides = first_of_sweeps(overrides)
    return sub, overrides, multirun


def first_of_sweeps(overrides: list[str]) -> list[str]:
    """A sweep's first job: each swept key (`k=a,b,c`, `k=range(...)`) at its first value."""
    out = []
    for text, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if parsed.is_sweep_override():
            first = next(iter(parsed.sweep_string_iterator()))
            text = f"{parsed.get_key_element()}={first}"
        out.append(text)
    return out


def compose_overrides(overrides: list[str]):
    from orthrus_rag.config.app import register_configs

    register_configs()
    with initialize_config_module(config_module="orthrus_rag.conf", version_base=None):
        return compose(config_name="config", overrides=overrides)


def _made(tmp_path: Path, value: str, folder: bool) -> str:
    """`value`, a path a doc names, as a file or folder made under tmp_path."""
    path = tmp_path / "fs" / str(value).lstrip("/~")
    if folder:
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return str(path)


def with_files_made(cfg, tmp_path: Path) -> None:
    """Point every path of a composed config at a file or folder made in tmp_path, as the doc's reader has them."""
    from orthrus_rag.models.registry import resolve_adapter_path

    cfg.run_dir = str(tmp_path / "run")
    if cfg.dataset.path is not None:
        cfg.dataset.path = _made(tmp_path, cfg.dataset.path, folder=False)
    if cfg.corpus.path is not None:
        cfg.corpus.path = _made(tmp_path, cfg.corpus.path, folder=cfg.corpus.kind == "files")
    if cfg.retriever.index_dir is not None:
        cfg.retriever.index_dir = _made(tmp_path, cfg.retriever.index_dir, folder=True)
    if cfg.ingest.path is not None:
        cfg.ingest.path = _made(tmp_path, cfg.ingest.path, folder=False)
    if cfg.resume is not None:
        cfg.resume = _made(tmp_path, cfg.resume, folder=True)
    cfg.model.embedding_adapters = [a if resolve_adapter_path(a).is_dir() else _made(tmp_path, a, folder=True)
                                    for a in cfg.model.embedding_adapters]
    for name, adapter in list(cfg.model.adapters.items()):
        if not resolve_adapter_path(adapter).is_dir():
            cfg.model.adapters[name] = _made(tmp_path, adapter, folder=True)


def check_command(sub: str, overrides: list[str], cfg) -> None:
    """What the command checks before any model loads."""
    from orthrus_rag.config.app import OPERATIONAL_KEYS
    from orthrus_rag.entrypoints.checks import validate

    validate(cfg)
    if sub == "run" and cfg.resume is not None:
        # a resumed run restores its saved config; a key beside the operational ones is refused unless it equals
        # the saved value, so a doc that resumes with one shows a command that stops with exit 2
        keys = {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)}
        other = sorted(keys - set(OPERATIONAL_KEYS))
        assert not other, f"resume= with keys a resumed run refuses: {other}"
    if sub == "serve":
        from orthrus_rag.entrypoints.openai.server import _check_index

        if cfg.deploy.mode not in ("engine", "ray"):
            raise ValueError(f"serve refuses deploy.mode={cfg.deploy.mode!r}")
        if cfg.deploy.mode == "engine":
            _check_index(cfg)
    if sub == "index" and cfg.deploy.mode == "ray" and cfg.retriever.kind == "bm25":
        raise ValueError("an index build on Ray refuses retriever.kind=bm25")


def test_the_docs_show_commands():
    """The extraction finds the quick starts (an empty list would pass every other test)."""
    where = {w.split(":")[0] for w, _ in COMMANDS}
    assert {"README.md", "docs/usage/runs.md", "docs/usage/corpus.md", "docs/serving/openai.md"} <= where
    subs = {c.split()[1] for _, c in COMMANDS}
    assert subs == {"run", "index", "serve", "plan"}
    assert len(COMMANDS) >= 80, len(COMMANDS)
    assert not KNOWN_BROKEN - {c for _, c in COMMANDS}, "KNOWN_BROKEN names commands the docs no longer show"


def test_the_extraction_rules():
    text = "```bash\nFOO=1 orthrus-rag run a=1 \\\n    b=2   # why\n$ orthrus-rag serve x='#1' &\n```\n"
    lines = [_clean(line) for _, line in _shell_lines(text)]
    assert lines == ["orthrus-rag run a=1 b=2", "orthrus-rag serve x='#1'"]
    assert _inline_spans("see `orthrus-rag run\n  k=1` and ```x```") == [(1, "orthrus-rag run k=1")]
    assert parse("orthrus-rag run -m scheduler=orthrus,hetero_fcfs 'model.embedding_adapters=[a,b]' k=3,5") == \
        ("run", ["scheduler=orthrus", "model.embedding_adapters=[a,b]", "k=3"], True)
    assert parse("orthrus-rag index resume=<run_dir> deploy.replicas=N")[1] == ["resume=placeholder",
                                                                               "deploy.replicas=2"]
    assert parse("orthrus-rag run --cfg job")[1] == []
    with pytest.raises(Unfillable):
        parse("orthrus-rag run -m pipeline=iter_retgen,ircot ...")


def test_a_typo_in_a_doc_command_fails():
    """The check below refuses what a stale doc would show."""
    from hydra.errors import ConfigCompositionException

    for bad in ("orthrus-rag run retriever.kk=3", "orthrus-rag serve scheduler=fifo",
                "orthrus-rag run dataset.limit=200,300"):
        with pytest.raises(ConfigCompositionException):
            compose_overrides(parse(bad)[1])


@pytest.mark.parametrize("where,command", COMMANDS, ids=_ids(COMMANDS))
def test_doc_command_composes(where, command, tmp_path):
    try:
        sub, overrides, _ = parse(command)
    except Unfillable as exc:
        pytest.skip(f"{where}: {exc}")
    if command in KNOWN_BROKEN:
        with pytest.raises(Exception):
            cfg = compose_overrides(overrides)
            with_files_made(cfg, tmp_path)
            check_command(sub, overrides, cfg)
        pytest.xfail(f"{where}: a known doc bug (KNOWN_BROKEN)")
    cfg = compose_overrides(overrides)
    OmegaConf.resolve(cfg)
    with_files_made(cfg, tmp_path)
    check_command(sub, overrides, cfg)
