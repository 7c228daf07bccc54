"""The user-facing docs against the code: the config keys they name exist, their TOML examples are
valid configs, their commands use flags the programs take, and their links and paths resolve.

Checked: README.md, docs/*.md and examples/*/README.md (and the commands in the examples' TOML
comments). docs/benchmarks.md, a dated log whose old entries keep the names of their day, and
docs/config-reference.md, generated, are checked for links only. Keys are read from
docs/config-reference.md, which tests/config/test_reference.py keeps equal to the config classes
(so no torch import here). A ```toml fence must be a whole valid config of some command: write an
illustrative fragment in a fence without a language.
"""

import importlib
import re
import shlex
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ValidationError

from tandem.config.loader import deep_merge, format_validation_error, normalise_keys, spread_shared_fields

ROOT = Path(__file__).parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]
CURRENT = [p for p in DOCS if p.name not in ("benchmarks.md", "config-reference.md")]

# Config classes that import no torch, tried first; the others only when none of these fits.
LIGHT = [
    "tandem.launch.config:RLConfig",
    "tandem.orchestrator.config:OrchestratorConfig",
    "tandem.inference.config:InferenceConfig",
    "tandem.trainer.rl.config:RLTrainerConfig",
    "tandem.evaluate:EvalConfig",
]
HEAVY = ["tandem.trainer.sft.config:SFTConfig", "tandem.models.tiny:TinyModelConfig"]

NOT_KEYS = {"client.openai"}  # the inference client's attribute (environments.md), not a config key
OWN_FLAGS = {"dry_run", "help", "k8s"}  # the loader's and rl's own flags
FILE_SUFFIX = re.compile(r"\.(py|md|toml|json|jsonl|sh|yaml|txt|png|safetensors|jinja|j2|lock|log|pt|bin)$")
PROGRAMS = ("sft", "rl", "evaluate", "inference", "orchestrator", "trainer", "tiny-model")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def reference_keys() -> dict[str, set[str]]:
    """Every key path of each command's table in docs/config-reference.md."""
    keys: dict[str, set[str]] = {}
    for part in (ROOT / "docs" / "config-reference.md").read_text().split("\n## ")[1:]:
        command = re.search(r"\(`([^`]+)`\)", part.splitlines()[0])
        assert command, part.splitlines()[0]
        keys[command.group(1)] = set(re.findall(r"^\| `([^`]+)` \|", part, re.M))
    assert set(PROGRAMS) <= set(keys), keys.keys()
    return keys


def with_sections(paths: set[str]) -> set[str]:
    return paths | {".".join(p.split(".")[:i]) for p in paths for i in range(1, p.count(".") + 1)}


@cache
def all_paths() -> set[str]:
    return with_sections(set().union(*reference_keys().values()))


@cache
def table_keys() -> set[str]:
    """The keys whose value is a table of free keys (type dict in docs/config-reference.md)."""
    text = (ROOT / "docs" / "config-reference.md").read_text()
    return set(re.findall(r"^\| `([^`]+)` \| dict\[", text, re.M))


def leaves(keys: set[str]) -> set[str]:
    """The keys with no key under them: values, or tables of free keys (`orchestrator.env.args`)."""
    return {k for k in keys if not any(other.startswith(k + ".") for other in keys)}


def is_key(path: str, keys: set[str], values: set[str]) -> bool:
    """`path` is a key, or lies under a key whose value is a table of its own (`env.args.x`);
    `values` = leaves(keys)."""
    parts = path.split(".")
    return path in keys or any(".".join(parts[:i]) in values for i in range(1, len(parts)))


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) outside code fences."""
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield n, line


def fences(path: Path) -> Iterator[tuple[str, int, list[str]]]:
    """(language, line number of the first line, lines) of each code fence."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"\s*(`{3,})(\w*)", lines[i])
        if opening:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == opening.group(1))
            yield opening.group(2), i + 2, lines[i + 1 : end]
            i = end
        i += 1


def spans(line: str) -> list[str]:
    return re.findall(r"(?<!`)`([^`]+)`(?!`)", line)


def test_config_keys_named_in_prose_exist() -> None:
    """`section.key`, `--section.key ...`, `[section]` and `[section] key = ...` in backticks."""
    assert len(CURRENT) > 10  # (a moved directory would check nothing)
    paths = all_paths()
    firsts = {p.split(".")[0] for p in paths}
    wrong = []
    for doc in CURRENT:
        for n, line in prose(doc):
            for span in spans(line):
                table = re.fullmatch(r"\[\[?([a-z][a-z0-9_.]*)\]\]?(?:\s+([a-z][a-z0-9_]*)\b.*)?", span)
                if table:
                    named = [table.group(1)] + (
                        [f"{table.group(1)}.{table.group(2)}"] if table.group(2) else []
                    )
                else:
                    dotted = re.match(r"(?:--)?([a-z][a-z0-9_-]*(?:\.[a-z0-9_-]+)+)(?=$|\s|=)", span)
                    named = [dotted.group(1).replace("-", "_")] if dotted else []
                for key in named:
                    known = key.split(".")[0] not in firsts or FILE_SUFFIX.search(key) or key in NOT_KEYS
                    parts = key.split(".")
                    known = known or any(".".join(parts[:i]) in table_keys() for i in range(1, len(parts)))
                    if not known and key not in paths:
                        wrong.append(f"{rel(doc)}:{n}: `{span}`: no config has the key {key}")
    assert not wrong, "\n".join(wrong)


def config_class(target: str) -> type[BaseModel]:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def validation_error(data: dict) -> str | None:
    """None when some command's config takes `data` (with a model name), else RLConfig's complaint."""
    first = None
    for target in LIGHT + HEAVY:
        cls = config_class(target)
        given = deep_merge({"model": {"name": "m"}}, data) if "model" in cls.model_fields else data
        try:
            cls.model_validate(spread_shared_fields(cls, given))
            return None
        except ValidationError as e:
            first = first or format_validation_error(e, cls)
    return first


def test_toml_examples_are_valid_configs() -> None:
    wrong = []
    for doc in CURRENT:
        for language, n, lines in fences(doc):
            if language != "toml":
                continue
            try:
                data = normalise_keys(tomllib.loads("\n".join(lines)))
            except tomllib.TOMLDecodeError as e:
                wrong.append(f"{rel(doc)}:{n}: not TOML: {e}")
                continue
            if problem := validation_error(data):
                wrong.append(f"{rel(doc)}:{n}: {problem}")
    assert not wrong, "\n".join(wrong)


def commands() -> Iterator[tuple[str, str]]:
    """(where, command line) of every command in the docs' code fences and the examples' TOML
    comments, continuation lines joined."""
    sources: list[tuple[Path, int, list[str]]] = [
        (doc, n, lines) for doc in CURRENT for _, n, lines in fences(doc)
    ]
    for example in sorted((ROOT / "examples").glob("*/*.toml")):
        comments = [
            re.sub(r"^\s*#", "", line) if line.lstrip().startswith("#") else ""
            for line in example.read_text().splitlines()
        ]
        sources.append((example, 1, comments))
    for path, first, lines in sources:
        joined, start = "", None
        for i, line in enumerate(lines):
            start = first + i if start is None else start
            joined += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                yield f"{rel(path)}:{start}", joined.strip()
                joined, start = "", None


def takes_flag(source: str, flag: str) -> bool:
    """An argparse script names the flag; a script with a config class (parse_config) has a field
    of its name."""
    field = flag[2:].replace("-", "_").split(".")[0]
    return f'"{flag}"' in source or re.search(rf"^\s+{field}: ", source, re.M) is not None


def test_commands_use_flags_their_programs_take() -> None:
    """`uv run <console script> ...` flags are keys of its config (docs/config-reference.md);
    `python benchmarks/X.py --flag` flags are the script's (takes_flag); `@ FILE`s exist."""
    keys = reference_keys()
    values = {program: leaves(keys[program]) for program in PROGRAMS}
    wrong = []
    checked = 0
    for where, line in commands():
        tandem = re.search(r"\buv run (" + "|".join(PROGRAMS) + r")\s(.*)", line)
        script = re.search(r"\bpython3? ((?:benchmarks|examples|scripts)/\S+\.py)(.*)", line)
        if not (tandem or script):
            continue
        checked += 1
        words = shlex.split((tandem or script).group(2), comments=True)  # type: ignore[union-attr]
        for i, word in enumerate(words):
            named_file = words[i - 1] == "@" and word.startswith(("examples/", "docs/", "benchmarks/"))
            if named_file and not (ROOT / word).is_file():
                wrong.append(f"{where}: no file {word}")
            if not word.startswith("--"):
                continue
            flag = word.partition("=")[0]
            if script:
                source = ROOT / script.group(1)
                if not source.is_file():
                    wrong.append(f"{where}: no file {script.group(1)}")
                elif not takes_flag(source.read_text(), flag):
                    wrong.append(f"{where}: {script.group(1)} takes no {flag}")
                continue
            program = tandem.group(1)  # type: ignore[union-attr]
            key = flag[2:].replace("-", "_")
            if program == "inference" and key == "model":
                key = "model.name"  # its alias
            if key not in OWN_FLAGS and not is_key(key, keys[program], values[program]):
                wrong.append(f"{where}: `{program}` has no key {key} ({word})")
    assert checked > 20
    assert not wrong, "\n".join(wrong)


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors of `doc` (a repeated heading's get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose(doc):
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_links_and_paths_resolve() -> None:
    """Relative links (with their #anchors) in every doc; repository paths named in the current
    docs' prose (src/..., tests/..., benchmarks/..., examples/..., scripts/..., docs/...)."""
    wrong = []
    for doc in DOCS:
        for n, line in prose(doc):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                linked = (doc.parent / path) if path else doc
                if not linked.exists():
                    wrong.append(f"{rel(doc)}:{n}: link to a missing {target}")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    wrong.append(f"{rel(doc)}:{n}: no heading #{anchor} in {path or doc.name}")
            if doc not in CURRENT:
                continue
            for path in re.findall(
                r"(?<![\w/.$-])((?:src|tests|benchmarks|examples|scripts|docs)/[\w./-]*\w)", line
            ):
                if "*" not in path and not (ROOT / path).exists():
                    wrong.append(f"{rel(doc)}:{n}: no such path {path}")
    assert not wrong, "\n".join(wrong)
