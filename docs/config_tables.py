"""Write the "Every key" tables of docs/configuration.md from the config schema (shardspeed/config/).

    python docs/config_tables.py          # rewrite the section in place
    python docs/config_tables.py --check  # exit 1 if the section is out of date (tests/config runs this)

One table per config block: key (with the names DeepSpeed also accepts), type, default, whether shardspeed
honours it ("yes") or refuses a value other than the default ("refused"), and the field's docstring. A
paragraph written under a block's heading, above its table, is kept.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "configuration.md"
START, END = "## Every key\n", "\n## "  # the section runs to the next level-2 heading (or the end)

sys.path.insert(0, str(ROOT))

from shardspeed.config import ShardspeedConfig  # noqa: E402
from shardspeed.config.build import _schema  # noqa: E402
from shardspeed.config.implemented import IMPLEMENTED, REMOVED_IN_DEEPSPEED  # noqa: E402

INTRO = """## Every key

Types: `int` fields accept integral floats (`5e8`); `number` fields accept integers; `bool` fields accept 0 and 1
as DeepSpeed's blocks do (other numbers and strings are errors). Sizes are counts
of elements, not bytes. dtype fields accept `fp32`/`fp16`/`bf16` and DeepSpeed's other spellings
(`float32`, `half`, `bfloat16`, `torch.float16`, ...), case-insensitively. "honoured" says what shardspeed
does with a key: **yes** (implemented, or honoured by construction), or **refused** (a value other than the
default is an error naming the key; a block with an `enabled` switch only when enabled). Keys DeepSpeed 0.19
removed are not listed: they are refused whenever present (see "Keys DeepSpeed removed"). This section is
written by `python docs/config_tables.py` from the schema.
"""


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its documentation)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and documented:
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


_SHORT = {bool: "bool", int: "int", float: "number", str: "string", type(None): "null", typing.Any: "any"}


def _type(tp) -> str:
    """A type annotation in the tables' short words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, __import__("types").UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"list of ({_type(args[0])})"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "object"
    return _SHORT.get(tp, getattr(tp, "__name__", str(tp)))


def _block(tp) -> type | None:
    for arg in (tp, *typing.get_args(tp), *[a for t in typing.get_args(tp) for a in typing.get_args(t)]):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(block)" if dataclasses.is_dataclass(value) else json.dumps(value)
    value = f.default
    if value is dataclasses.MISSING:
        return "(required)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6:
        return (
            "sys.maxsize" if value == sys.maxsize else f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
        )
    return json.dumps(value)


def _status(path: str) -> str:
    if path in IMPLEMENTED or any(path.startswith(k + ".") for k in IMPLEMENTED):
        return "yes"
    if any(k.startswith(path + ".") for k in IMPLEMENTED):
        return "partly"
    return "refused"


def _tables(cls: type, path: str, out: list[tuple[str, str, str]]) -> None:
    schema, docs = _schema(cls), _field_docs(cls)
    rows, children = [], []
    for f in dataclasses.fields(cls):
        if f.name not in schema.hints:
            continue  # set by the loader, not a key
        full = f"{path}.{f.name}" if path else f.name
        if full in REMOVED_IN_DEEPSPEED and full not in IMPLEMENTED:
            continue
        names = [n for n, target in schema.aliases.items() if target == f.name]
        shown = f"`{f.name}`" + (f" (alias {', '.join(f'`{n}`' for n in names)})" if names else "")
        rows.append(f"| {shown} | {_type(schema.hints[f.name])} | {_default(f)} | {_status(full)} | "
                    f"{docs.get(f.name, '')} |")  # fmt: skip
        child = _block(schema.hints[f.name])
        if child is not None:
            children.append((child, full))
    title = (cls.__doc__ or "").strip().splitlines()[0]
    title = title.split(": ", 1)[1] if title.startswith("``") and ": " in title else title
    table = "| key | type | default | honoured | meaning |\n|---|---|---|---|---|\n" + "\n".join(rows)
    out.append((path or "top level", title, table))
    for child, full in children:
        _tables(child, full, out)


def _prose(existing: str) -> dict[str, tuple[str, str]]:
    """Per block heading of `existing`: the text written above its table and below it."""
    prose = {}
    for chunk in existing.split("\n### ")[1:]:
        heading, _, rest = chunk.partition("\n")
        key = heading.split("`")[1] if "`" in heading else heading
        lines = rest.split("\n")
        start = next((i for i, line in enumerate(lines) if line.startswith("| key |")), len(lines))
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        prose[key] = ("\n".join(lines[:start]).strip(), "\n".join(lines[end:]).strip())
    return prose


def render(existing: str) -> str:
    """The whole "Every key" section, keeping the prose around each table of `existing`."""
    prose = _prose(existing)
    parts = [INTRO]
    out: list[tuple[str, str, str]] = []
    _tables(ShardspeedConfig, "", out)
    for key, title, table in out:
        above, below = prose.get(key, ("", ""))
        parts.append(f"### `{key}` — {title}\n")
        parts += [above + "\n"] if above else []
        parts.append(table + "\n")
        parts += [below + "\n"] if below else []
    return "\n".join(parts)


def _split(text: str) -> tuple[str, str, str]:
    start = text.index(START)
    end = text.find(END, start + len(START))
    end = len(text) if end < 0 else end + 1
    return text[:start], text[start:end], text[end:]


def main() -> int:
    text = DOCS.read_text()
    before, section, after = _split(text)
    fresh = render(section)
    if "--check" in sys.argv:
        return 0 if fresh.rstrip() == section.rstrip() else 1
    DOCS.write_text(before + fresh.rstrip() + "\n" + ("\n" + after if after else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
