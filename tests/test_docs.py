"""The documentation stays honest: links and anchors resolve, the run-config page, the README's methods table and
docs/layout.md's module list are generated from the code, every default a page states is the code's, every strategy
has a page, every documented command names only keys, strategies, modules and files that exist, and no page points
outside the repository or at words only its writer could see. Fast: no training, no Flower processes."""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args

from medflower import docpages
from medflower.config import ConfigError, ExperimentConfig, all_options, defaults, run_config_markdown
from medflower.experiments import ExperimentFileError, read_file
from medflower.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_CONFIG_DOC = ROOT / "docs" / "run-config.md"


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


# ----------------------------------------------------------------------------------------------- markdown parsing

_FENCE = re.compile(r"^\s*(```|~~~)")


def split_fenced(text: str) -> tuple[str, list[str]]:
    """(the text with fenced code blocks blanked out, the code blocks' contents)."""
    prose, blocks, current, fence = [], [], [], None
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if fence is None and match:
            fence, current = match.group(1), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            blocks.append("\n".join(current))
            fence = None
            prose.append("")
        elif fence is not None:
            current.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def strip_code_spans(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", text)


def inline_code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", split_fenced(text)[0])


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation except '-' and '_' dropped,
    each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fenced(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        if slug in seen:
            seen[slug] += 1
            out.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            out.add(slug)
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[str]:
    prose, _ = split_fenced(path.read_text())
    return _LINK.findall(strip_code_spans(prose))


# ------------------------------------------------------------------------------------------------------ 1. links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: link {target!r}"
        if not resolved.exists():
            problems.append(f"{where}: {resolved} does not exist")
            continue
        if anchor:
            if resolved.suffix != ".md" or not resolved.is_file():
                problems.append(f"{where}: an anchor into {resolved.name}, which is not a Markdown file")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}: no heading of {resolved.relative_to(root)} has the anchor #{anchor}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = [p for path in doc_files() for p in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_the_link_checker_catches_a_broken_file_an_unknown_anchor_and_slugs_like_github(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Results on synthetic (8 classes, 4 tasks × 2 classes)\n\n## `sgca`\n\n## SGCA\n\n"
        "[ok](#results-on-synthetic-8-classes-4-tasks--2-classes) [ok](#sgca-1) "
        "[ok](b.md#code-and-links) [bad](#nope) [bad](missing.md) [bad](b.md#nope) "
        "`[not a link](nowhere.md)`\n"
    )
    (tmp_path / "b.md").write_text("## Code and [links](a.md)\n```\n# not a heading\n[not a link](gone.md)\n```\n")
    problems = broken_links(tmp_path / "a.md", tmp_path) + broken_links(tmp_path / "b.md", tmp_path)
    assert len(problems) == 3, problems
    assert any("#nope" in p and "a.md" in p for p in problems)
    assert any("missing.md" in p for p in problems)
    assert any("b.md#nope" in p for p in problems)


# ------------------------------------------------------------------------------------------------ 2. run config


def test_every_run_config_key_is_on_the_generated_page():
    page = RUN_CONFIG_DOC.read_text()
    missing = [o.key for o in all_options() if f"| `{o.key}` |" not in page]
    assert not missing, f"docs/run-config.md lacks {missing}: run `python -m medflower.config --write`"
    assert page == run_config_markdown(), "docs/run-config.md is stale: run `python -m medflower.config --write`"


def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def run_config_page_defaults() -> dict[str, str]:
    """key -> its default as the generated docs/run-config.md writes it (a TOML value)."""
    out = {}
    for line in RUN_CONFIG_DOC.read_text().split("\n"):
        if line.startswith("| `"):
            key, default = table_cells(line)[:2]
            out[key.strip("`")] = default[1:-1]
    return out


def stated_defaults(path: Path) -> list[tuple[int, str, str]]:
    """(line, key, default) of every row of a table with a 'key' and a 'default' column. A row may name several
    keys and as many defaults (`a`, `b` | `1`, `2`); code spans after those are comments (`0` (= `lr`))."""
    found, header = [], None
    for number, line in enumerate(split_fenced(path.read_text())[0].split("\n"), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = table_cells(line)
        if header is None:
            header = [cell.lower() for cell in cells]
        elif "key" in header and "default" in header and not re.fullmatch(r"[-:| ]+", line):
            keys = re.findall(r"`([\w-]+)`", cells[header.index("key")])
            values = re.findall(r"`([^`]*)`", cells[header.index("default")])
            if len(values) < len(keys):
                found.append((number, ", ".join(keys), "<fewer defaults than keys>"))
            found += [(number, key, value) for key, value in zip(keys, values)]
    return found


def toml_value(text: str):
    """A default as written: a TOML value, or a bare word (pages may write `full` for 'full')."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def same_default(stated: str, code: str) -> bool:
    a, b = toml_value(stated), toml_value(code)
    number = lambda x: isinstance(x, int | float) and not isinstance(x, bool)
    return (number(a) and number(b) and a == b) or (type(a) is type(b) and a == b)


def test_every_default_a_page_states_is_the_codes():
    """Method pages keep a table of their keys with defaults; each default must be the one docs/run-config.md
    (generated from the code) lists, so a changed default cannot leave a page behind."""
    code = run_config_page_defaults()
    problems, checked = [], 0
    for path in doc_files():
        if path == RUN_CONFIG_DOC:
            continue
        for number, key, value in stated_defaults(path):
            where = f"{path.relative_to(ROOT)}:{number}: `{key}`"
            checked += 1
            if key not in code:
                problems.append(f"{where} is no run-config key")
            elif not same_default(value, code[key]):
                problems.append(f"{where} default `{value}`, the code's is `{code[key]}` (docs/run-config.md)")
    assert not problems, "\n".join(problems)
    assert checked >= 90, f"only {checked} stated defaults found: has the tables' layout changed?"


def test_the_default_check_reads_multi_key_rows_and_refuses_a_wrong_default(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "| key | default | meaning |\n|---|---|---|\n| `lr`, `seed` | `0.003`, `0` | two |\n"
        "| `head-lr` | `0` (= `lr`) | one |\n| `sift-variant` | `full` | a bare word |\n\n"
        "| key | meaning |\n|---|---|\n| `lr` | no default column |\n"
    )
    stated = stated_defaults(page)
    assert [(k, v) for _, k, v in stated] == [
        ("lr", "0.003"),
        ("seed", "0"),
        ("head-lr", "0"),
        ("sift-variant", "full"),
    ]
    code = run_config_page_defaults()
    assert all(same_default(v, code[k]) for _, k, v in stated)
    assert not same_default("0.01", code["lr"]) and not same_default("true", "1") and not same_default("'x'", "'y'")


# ------------------------------------------------------------------------------------------------ 3. strategies


def methods_table_rows() -> dict[str, str]:
    """strategy name -> the docs/methods page its README row links to."""
    rows = {}
    for line in split_fenced(README.read_text())[0].split("\n"):
        match = re.match(r"^\|\s*\[`([\w-]+)`\]\((docs/methods/[\w-]+\.md)(?:#[\w-]*)?\)\s*\|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def names_strategy(page: Path, name: str) -> bool:
    """The page names the strategy in a heading or in the first cell of a table row."""
    prose, _ = split_fenced(page.read_text())
    for line in prose.split("\n"):
        if line.startswith("#") and f"`{name}`" in line:
            return True
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2 and f"`{name}`" in cells[1]:
            return True
    return False


def test_every_strategy_has_a_page_linked_from_the_readme_methods_table():
    rows = methods_table_rows()
    problems = []
    for name in STRATEGIES:
        if name not in rows:
            problems.append(f"{name}: no row [`{name}`](docs/methods/<page>.md) in README's methods table")
            continue
        page = ROOT / rows[name]
        if not page.is_file():
            problems.append(f"{name}: README links to {rows[name]}, which does not exist")
        elif not names_strategy(page, name):
            problems.append(f"{name}: {rows[name]} names it in no heading or table row")
    unknown = sorted(set(rows) - set(STRATEGIES))
    assert not problems and not unknown, "\n".join(problems + [f"README's methods table lists unknown {unknown}"])


# ------------------------------------------------------------------------------------------------- 4. commands


def logical_lines(block: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, current = [], ""
    for line in block.split("\n"):
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    if current:
        out.append(current)
    return out


def flwr_run_commands() -> list[tuple[str, str]]:
    """(where, command line) of every `flwr run` in a fenced code block."""
    found = []
    for path in doc_files():
        for block in split_fenced(path.read_text())[1]:
            for line in logical_lines(block):
                if "flwr run" in line:
                    found.append((str(path.relative_to(ROOT)), line[line.index("flwr run") :]))
    return found


def run_config_of(command: str) -> dict | None:
    """The run-config overrides of one `flwr run` command line (None: it has no --run-config)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = []
    for token in lexer:
        if token in (";", "&", "&&", "|", "||"):
            break
        tokens.append(token)
    for i, token in enumerate(tokens):
        if token.startswith("--run-config"):
            value = token.split("=", 1)[1] if "=" in token and token.startswith("--run-config=") else tokens[i + 1]
            if value.endswith(".toml") and "=" not in value:
                toml = ROOT / value
                assert toml.is_file(), f"--run-config file {value} does not exist"
                return parse_config_args([str(toml)])
            parsed = parse_config_args([value])
            unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "''", value)  # '=' inside a string value is no key
            pairs = re.findall(r"(\S+?)=", unquoted)
            assert len(parsed) == len(set(pairs)), f"some of {value!r} are not key=TOML-value pairs"
            return parsed
    return None


def check_run_config(config: dict) -> None:
    ExperimentConfig.from_run_config({**defaults(), **config}, check_paths=False)


def test_the_flwr_run_commands_found_include_continued_lines():
    commands = flwr_run_commands()
    assert len(commands) >= 15
    fedbkd = [c for where, c in commands if "fedbkd.md" in where and "strategy='fedbkd'" in c]
    assert fedbkd and "fedbkd-capacities=" in fedbkd[0], "a command continued with \\ was not joined"


def test_every_documented_flwr_run_names_only_keys_and_strategies_that_exist():
    problems = []
    for where, command in flwr_run_commands():
        try:
            config = run_config_of(command)
            if config is not None:
                check_run_config(config)
        except Exception as err:  # ConfigError, a TOML format error (click), a missing --run-config file
            problems.append(f"{where}: {command}\n    {type(err).__name__}: {err}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "command, why",
    [
        ("flwr run . --run-config \"strategy='sgca' sgca-alpah=0.8\"", "unknown"),
        ("flwr run . --run-config \"strategy='fedsomething'\"", "strategy"),
        ("flwr run . --run-config \"strategy='sgca' dataset='synthetic-seg'\"", "partition"),
        ("flwr run . --run-config \"strategy='sift'\"", "class embeddings"),
        ('flwr run . --run-config "lat-layers=all"', "format"),
    ],
)
def test_the_command_check_refuses_bad_keys_values_and_combinations(command, why):
    with pytest.raises(Exception, match=why):
        check_run_config(run_config_of(command))


def python_commands() -> list[tuple[str, str]]:
    """(where, text) of every `python ...` command, in code blocks and inline code."""
    found = []
    for path in doc_files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for block in split_fenced(text)[1]:
            found += [(where, line) for line in logical_lines(block) if re.search(r"\bpython3?\s", line)]
        found += [(where, span) for span in inline_code_spans(text) if re.search(r"\bpython3?\s", span)]
    return found


def check_experiment_file(path: Path) -> None:
    """The structure load_plan checks, without needing the data files the runs read."""
    try:
        plan = read_file(path)  # with the file its ``extends`` names merged in
    except ExperimentFileError as err:
        raise AssertionError(str(err)) from err
    assert isinstance(plan.get("runs"), list) and plan["runs"], f"{path}: no 'runs' list"
    names = [run.get("name") for run in plan["runs"]]
    assert all(names) and len(set(names)) == len(names), f"{path}: run names missing or repeated: {names}"
    if plan.get("reference") is not None:
        assert plan["reference"] in names, f"{path}: reference {plan['reference']!r} is not a run"
    for run in plan["runs"]:
        for seed in plan.get("seeds", [0]):
            config = {**plan.get("base", {}), **{k: v for k, v in run.items() if k != "name"}, "seed": seed}
            weights = config.get("backbone-weights")
            if isinstance(weights, str) and weights not in ("none", "auto"):
                config["backbone-weights"] = "none"  # a file made by a documented step (e.g. medflower.pretrain)
            try:
                check_run_config(config)
            except ConfigError as err:
                raise AssertionError(f"{path}: run {run['name']!r}: {err}") from err


def test_every_documented_python_command_names_a_module_or_script_that_exists():
    problems, modules, files = [], set(), set()
    for where, text in python_commands():
        for module in re.findall(r"python3?\s+-m\s+(medflower(?:\.\w+)*)", text):
            modules.add(module)
            if importlib.util.find_spec(module) is None:
                problems.append(f"{where}: module {module} does not exist ({text})")
        for yaml_file in re.findall(r"python3?\s+-m\s+medflower\.experiments\s+(\S+\.ya?ml)", text):
            try:
                assert (ROOT / yaml_file).is_file(), f"{yaml_file} does not exist"
                check_experiment_file(ROOT / yaml_file)
            except AssertionError as err:
                problems.append(f"{where}: {err} ({text})")
        for script in re.findall(r"python3?\s+([\w./-]+\.py)\b", text):
            files.add(script)
            if not (ROOT / script).is_file():
                problems.append(f"{where}: {script} does not exist ({text})")
    assert not problems, "\n".join(problems)
    assert {"medflower.experiments", "medflower.config", "medflower.pretrain"} <= modules
    assert "benchmarks/sgca_aggregation.py" in files


def test_every_experiment_file_is_valid():
    problems = []
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        try:
            check_experiment_file(path)
        except AssertionError as err:
            problems.append(str(err))
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- no pointers outside the repository


def outside_pointers(path: Path, text: str) -> list[str]:
    """Names a user who cloned the repository alone cannot follow: a ``*.md`` file that exists nowhere in the
    repository, or a ``../`` path that leaves it."""
    markdown_names = {p.name for p in ROOT.rglob("*.md") if not {".git", "outputs"} & set(p.relative_to(ROOT).parts)}
    markdown_names |= {"summary.md", "comparison.md"}  # what a run and the experiments runner write
    problems = [
        f"{path.relative_to(ROOT)}: names {name}, which is not in the repository"
        for name in sorted(set(re.findall(r"[\w-]+\.md\b", text)) - markdown_names)
    ]
    problems += [
        f"{path.relative_to(ROOT)}: {rel} leaves the repository"
        for rel in sorted(set(re.findall(r"(?:\.\./)+[\w./-]*", text)))
        if not (path.parent / rel).resolve().is_relative_to(ROOT)
    ]
    return problems


def test_docs_do_not_point_outside_the_repository():
    problems = [p for path in doc_files() for p in outside_pointers(path, path.read_text())]
    assert not problems, "\n".join(problems)
    bad = outside_pointers(ROOT / "docs" / "data.md", "see NOTES.md and `data-dir: ../../elsewhere/data`")
    assert len(bad) == 2 and "NOTES.md" in bad[0] and "leaves the repository" in bad[1]


# Words that only mean something to whoever wrote them: a tracker's number for an issue, or "this" computer or sitting
# of the writer's (a user reads the docs on another computer, on another day).
_UNSEEN = re.compile(r"\bissues? #?\d+|\bthis (?:machine|session)\b", re.IGNORECASE)


def unseen_words(text: str) -> list[str]:
    return [m.group(0) for m in _UNSEEN.finditer(text)]


def test_docs_and_experiment_files_use_no_words_a_user_cannot_see():
    paths = [*doc_files(), *sorted((ROOT / "experiments").glob("*.yaml"))]
    problems = [f"{p.relative_to(ROOT)}: {w!r}" for p in paths for w in unseen_words(p.read_text())]
    assert not problems, "\n".join(problems)
    # the examples are built from parts, so that this file passes the same scan
    flagged = ["issue " + "12", "this " + "machine", "This " + "Session"]
    assert unseen_words(f"fixed in {flagged[0]}; measured on {flagged[1]}, In {flagged[2]}") == flagged
    assert unseen_words("the issues page; a machine like this one") == []


# ------------------------------------------------------------------------------------------- generated parts


@pytest.mark.parametrize("path", list(docpages.GENERATED), ids=lambda p: p.name)
def test_the_generated_methods_table_and_layout_are_up_to_date(path):
    assert path.read_text() == docpages.rendered(path), (
        f"{path.relative_to(ROOT)} is stale: run `python -m medflower.docpages --write`"
    )


def test_the_layout_names_every_module_of_the_package():
    page = docpages.LAYOUT_DOC.read_text()
    modules = sorted(p for p in (ROOT / "medflower").rglob("*.py") if p.name != "__init__.py")
    missing = [str(p.relative_to(ROOT)) for p in modules if f"](../{p.relative_to(ROOT).as_posix()})" not in page]
    assert not missing, f"docs/layout.md misses {missing}: run `python -m medflower.docpages --write`"


def test_the_methods_table_has_one_row_per_strategy_from_its_docstring():
    table = docpages.methods_table(STRATEGIES)
    rows = [line for line in table.split("\n") if line.startswith("| [`")]
    assert len(rows) == len(STRATEGIES)
    fedavg = next(row for row in rows if row.startswith("| [`fedavg`]"))
    assert "(docs/methods/baselines-fedavg-like.md#fedavg)" in fedavg and "FedAvg (McMahan et al. 2017)" in fedavg
    assert "n_k" in fedavg  # its 'Leaves a site:' sentence


def test_first_sentence_skips_abbreviations_and_asides():
    assert (
        docpages.first_sentence("DP-SGD (Abadi et al. 2016) with Opacus. More.")
        == "DP-SGD (Abadi et al. 2016) with Opacus."
    )
    assert docpages.first_sentence("its gradients w.r.t. the K modules; e.g. this. Next") == (
        "its gradients w.r.t. the K modules; e.g. this."
    )
    assert (
        docpages.first_sentence("What every strategy shares, by concern:") == "What every strategy shares, by concern."
    )
    assert docpages.summary("FedKEI (docs/methods/fedkei.md; equations of the paper): tasks. More.") == (
        "FedKEI (equations of the paper): tasks."
    )
    assert docpages.summary("Augmentation (run-config ``augment``, docs/data.md#augmentation), |x|.") == (
        "Augmentation (run-config `augment`), \\|x\\|."
    )


def test_the_generator_finds_each_strategys_page_and_refuses_a_gap(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Spec\n\n### `alpha`\n\n## Others\n\n| strategy |\n|---|\n| `beta` |\n")
    (tmp_path / "b.md").write_text("# B\n\n```\n### `gamma` (in code, not a heading)\n```\n## B (`beta`)\n")
    pages = docpages.strategy_pages(["alpha", "beta"], tmp_path)
    assert (pages["alpha"][0].name, pages["alpha"][2]) == ("a.md", "alpha")
    assert (pages["beta"][0].name, pages["beta"][2]) == ("b.md", "b-beta")  # a heading wins over a table row
    with pytest.raises(docpages.DocPageError, match="gamma"):
        docpages.strategy_pages(["gamma"], tmp_path)
    (tmp_path / "c.md").write_text("## `alpha` again\n")
    with pytest.raises(docpages.DocPageError, match="headings of"):
        docpages.strategy_pages(["alpha"], tmp_path)
    with pytest.raises(docpages.DocPageError, match="methods:start"):
        docpages.replace_block("no markers", "methods", "body")
    assert docpages.replace_block("a\n<!-- m:start -->\nold\n<!-- m:end -->\nb", "m", "new") == (
        "a\n<!-- m:start -->\nnew\n<!-- m:end -->\nb"
    )


def test_every_test_file_the_docs_and_docstrings_name_exists():
    """Tests live in tests/<package>/ beside the package they test: a path to a test file in the docs, the README or a
    docstring must name a file that is there (the tests moved once, and a stale path sends a reader nowhere)."""
    named = re.compile(r"tests/(?:[a-z_]+/)*test_[a-z0-9_]+\.py")
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "medflower").rglob("*.py"))]
    stale = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in texts
        for name in set(named.findall(path.read_text()))
        if not (ROOT / name).is_file()
    )
    assert not stale, stale
