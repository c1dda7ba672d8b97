"""The configuration reference, generated: every CLI key with its type, default and the comment the dataclass
gives it, then each Hydra group's options from conf/. The docs site's Configuration page is this text (its build
hook calls `render_reference`), so a field documented once in its dataclass is documented there too."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from pathlib import Path

import yaml

from orthrus_rag.config.app import AppConf



def _conf_dir() -> Path:
    import orthrus_rag.conf  # the Hydra groups, installed as orthrus_rag.conf (pyproject's package-dir)

    return Path(orthrus_rag.conf.__file__).parent


CONF_DIR = _conf_dir()

# what each top-level node is for, in a line (the dataclass docstrings say more where they exist)
GROUP_SUMMARY = {
    "dataset": "the questions a run asks",
    "corpus": "what the retriever searches, independent of the dataset",
    "model": "which weights run: the generation model, a separate encoder or embedding adapters, rerankers, and the "
             "kernels",
    "cache": "the paged KV cache",
    "scheduler": "the policy that shares each engine step, its token budget and latency targets",
    "deploy": "how the engine runs: in process, as two worker processes (the baselines) or on Ray Serve",
    "retriever": "dense (FAISS), sparse (BM25) or hybrid retrieval, and the index",
    "pipeline": "the RAG method and its generation settings",
    "serve": "`orthrus-rag serve`: the OpenAI-compatible server",
    "ingest": "`orthrus-rag run ingest.path=F`: documents added to the index while a run answers",
}


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str
    type: str
    default: str
    doc: str


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment the class's source gives it: the lines of `#` comment right above the field,
    then its own trailing comment."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    block = ""  # a comment block above a field speaks for the uncommented fields right after it too
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            block = ""
            continue
        above: list[str] = []
        row = node.lineno - 1  # 1-based line above the field
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, lines[row - 1].strip().lstrip("#").strip())
            row -= 1
        own = [trailing[node.lineno]] if node.lineno in trailing and not lines[node.lineno - 1].strip().startswith(
            "#") else []
        if above:
            block = " ".join(above)
        elif own:
            block = ""
        text = " ".join(above + own) or block
        out[node.target.id] = text.removeprefix("NOTE:").strip()
    return out


def _type_name(tp: object) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(group)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if not isinstance(value, str) else value or '""'


def field_docs(cls: type, prefix: str) -> list[FieldDoc]:
    """Every leaf key of a config dataclass, nested dataclasses flattened (`scheduler.slo.itl_s`)."""
    hints = typing.get_type_hints(cls)
    notes = _comments(cls)
    rows: list[FieldDoc] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}.{f.name}" if prefix else f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows.extend(field_docs(tp, key))
            continue
        rows.append(FieldDoc(key, _type_name(tp), _default(f), notes.get(f.name, "")))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[FieldDoc]) -> list[str]:
    out = ["| key | type | default | what it does |", "|---|---|---|---|"]
    out += [f"| `{r.key}` | `{_cell(r.type)}` | `{_cell(r.default)}` | {_cell(r.doc)} |" for r in rows]
    return out


def _leading_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def _flatten(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out: list[str] = []
        for k, v in node.items():
            if k == "defaults":
                continue
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [f"{prefix}={yaml.safe_dump(node, default_flow_style=True).strip().removesuffix('...').strip()}"]


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of one Hydra group (`conf/<group>/*.yaml`) as table rows: name, its comment, what it sets."""
    folder = conf_dir / group
    if not folder.is_dir():
        return []
    out = [f"| `{group}=` | what it is | what it sets |", "|---|---|---|"]
    for path in sorted(folder.glob("*.yaml")):
        sets = _flatten(yaml.safe_load(path.read_text()) or {}, "" if group == "experiment" else group)
        shown = ", ".join(f"`{_cell(s)}`" for s in sets) or "(the defaults)"
        out.append(f"| `{path.stem}` | {_cell(_leading_comment(path))} | {shown} |")
    return out


def _defaults_line(conf_dir: Path) -> str:
    cfg = yaml.safe_load((conf_dir / "config.yaml").read_text())
    picks = [f"`{k}={v}`" for item in cfg.get("defaults", []) if isinstance(item, dict) for k, v in item.items()]
    return ", ".join(picks)


def render_reference(conf_dir: Path = CONF_DIR) -> str:
    """The Configuration page: the CLI's groups, then every key of every node, then the experiments."""
    top = [f for f in dataclasses.fields(AppConf)]
    out = [
        "# Configuration reference",
        "",
        "Every key that `orthrus-rag run`, `index` and `serve` take, generated from the config dataclasses "
        "(`orthrus_rag/config/app.py`, `orthrus_rag/config/engine.py`) and the Hydra groups under `conf/`; the "
        "text of each key is its comment in the code. Set a key on the command line (`scheduler.max_num_seqs=32`), "
        "pick a group's option by name (`retriever=hnsw`), print the composed config with `orthrus-rag run --cfg "
        "job`. A typo fails when the config is composed; a bad value fails before any model loads, with the rule "
        "it broke.",
        "",
        f"The defaults: {_defaults_line(conf_dir)}.",
        "",
    ]
    hints = typing.get_type_hints(AppConf)
    groups = [f for f in top if dataclasses.is_dataclass(hints[f.name])]
    for f in groups:
        cls = hints[f.name]
        out += [f"## {f.name}", "", f"`{f.name}`: {GROUP_SUMMARY.get(f.name, (cls.__doc__ or '').strip())}.", ""]
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses write a signature where none is given
            out += [doc.replace("\n", " "), ""]
        options = group_options(f.name, conf_dir)
        if options:
            out += ["Options:", ""] + options + [""]
        out += _table(field_docs(cls, f.name)) + [""]
    rest = [r for f in top if f not in groups for r in field_docs_of_field(f, hints[f.name])]
    out += ["## Run settings", "", "Top-level keys of a run.", ""] + _table(rest) + [""]
    out += ["## experiment", "", "Presets that set several keys at once (`experiment=smoke`).", ""]
    out += group_options("experiment", conf_dir) + [""]
    return "\n".join(out)


def field_docs_of_field(f: dataclasses.Field, tp: object) -> list[FieldDoc]:
    return [FieldDoc(f.name, _type_name(tp), _default(f), _comments(AppConf).get(f.name, ""))]
