"""Every ```python snippet of README.md and docs/*.md runs as a reader would run it.

A page is one session: its snippets run in order in one namespace (a later snippet may use what
an earlier one made), in a scratch folder that holds the folders the docs name (a tiny run at
``runs/laptop``, its transformers export at ``hf/laptop``, ...: see ``FOLDERS``). Where an
expression statement ends in a comment that is a Python literal (``band.counts()  # {...}``),
its value must equal that literal. Every import the snippets show works, also in a block that is
not run whole.

Markers are HTML comments on the lines right above a fence, unseen on a rendered page:

- ``<!-- snippet: given CODE -->``: CODE runs first, for names the page's prose only implies
  (a ``prompt``, a process's ``rank``);
- ``<!-- snippet: needs MODULE -->``: skipped where MODULE (an optional extra) is not installed;
- ``<!-- snippet: skip REASON -->``: not run, for text that is not a statement (a signature
  written with ``...``);
- ``<!-- snippet: xfail REASON -->``: run, and expected to fail until REASON is gone (not
  strict: it passes once it works).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from octlm import ModelConfig
from octlm.tokenizer import ByteTokenizer, with_chat_tokens
from tests.transformers_folders import make_run

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- snippet: (\w+)(?: (.*?))? -->")
KINDS = ("given", "needs", "skip", "xfail")

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    markers: dict[str, list[str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The ```python blocks of ``page``, each with the markers on the lines right above it."""
    lines = page.read_text().splitlines()
    found, at = [], 0
    while at < len(lines):
        if lines[at].strip() != "```python":
            at += 1
            continue
        end = next(i for i in range(at + 1, len(lines)) if lines[i].strip() == "```")
        markers: dict[str, list[str]] = {}
        above = at - 1
        while above >= 0 and (match := MARKER.fullmatch(lines[above].strip())):
            markers.setdefault(match[1], []).insert(0, match[2] or "")
            above -= 1
        found.append(Snippet(page, at + 1, "\n".join(lines[at + 1 : end]) + "\n", markers))
        at = end + 1
    return found


ALL = [snippet for page in PAGES for snippet in snippets(page)]

# A run (as `octlm train` leaves it) and exports of it (as `octlm export` writes them): tiny,
# with room for the prompts and generations the docs show.
RUN_CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=1, n_heads=4, max_length=128)
RUNS = ("runs/laptop", "runs/train", "runs/chat")
EXPORTS = ("hf/train", "hf/laptop", "exported", "llama-folder", "some-folder", "exported-chat")


def _folder(workspace: Path, name: str) -> None:
    """Make the folder ``name`` that a snippet names, if it is not there yet: a run (a chat
    run's with the byte tokenizer and the chat tokens), or an export of one."""
    path = workspace / name
    if path.exists():
        return
    if name == "runs/chat":
        chat = with_chat_tokens(ByteTokenizer())
        (workspace / "chat-tokenizer").mkdir()
        chat.save(workspace / "chat-tokenizer")
        config = replace(RUN_CONFIG, vocab_size=chat.vocab_size)
        make_run(path, config, tokenizer=workspace / "chat-tokenizer" / "tokenizer.json")
        return
    if name in RUNS:
        make_run(path, RUN_CONFIG)
        return
    from octlm.export import export

    run = RUNS[2] if name == "exported-chat" else RUNS[0]
    _folder(workspace, run)
    export(workspace / run, path)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tmp_path_factory.mktemp("docs")


def test_markers_are_known_and_snippets_were_found():
    assert ALL, "no ```python snippet found"
    for snippet in ALL:
        unknown = set(snippet.markers) - set(KINDS)
        assert not unknown, f"{snippet.name}: unknown marker {unknown}; known: {KINDS}"
        for kind in ("skip", "xfail"):
            assert all(snippet.markers.get(kind, ["a reason"])), f"{snippet.name}: {kind} why?"


def _literal(comment: str):
    """The Python literal a comment holds (``# ('sdpa', ...)``), or None."""
    try:
        return (ast.literal_eval(comment.lstrip("#").strip()),)
    except (ValueError, SyntaxError):
        return None


def _execute(snippet: Snippet, namespace: dict) -> None:
    """Run ``snippet`` statement by statement in ``namespace``, checking every expression
    statement whose line ends in a literal comment against that literal."""
    for given in snippet.markers.get("given", []):
        exec(compile(given, f"{snippet.name} (given)", "exec"), namespace)
    source = snippet.code
    comments = {
        token.start[0]: token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    for statement in ast.parse(source, snippet.name).body:
        expected = None
        if isinstance(statement, ast.Expr) and statement.end_lineno in comments:
            expected = _literal(comments[statement.end_lineno])
        if expected is None:
            code = compile(ast.Module([statement], []), snippet.name, "exec")
            exec(code, namespace)
            continue
        value = eval(compile(ast.Expression(statement.value), snippet.name, "eval"), namespace)
        line = snippet.line + statement.lineno
        assert value == expected[0], f"{snippet.page.name}:{line} gives {value!r}"


class Session:
    """One page's namespace and how many of its snippets have run in it, so that each snippet
    is its own test and still sees what the earlier ones made (replayed if needed)."""

    def __init__(self):
        self.namespace: dict = {"__name__": "__docs__"}
        self.done = 0


SESSIONS: dict[Path, Session] = {}


def _runnable(snippet: Snippet) -> bool:
    return "skip" not in snippet.markers and all(
        _installed(module) for module in snippet.markers.get("needs", [])
    )


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _apply_markers(snippet: Snippet, request) -> None:
    """Skip for what ``needs`` names and is not installed; expect the failure ``xfail`` names."""
    for module in snippet.markers.get("needs", []):
        pytest.importorskip(module, reason=f"needs {module}, an optional extra")
    if "xfail" in snippet.markers:
        request.applymarker(pytest.mark.xfail(reason=snippet.markers["xfail"][0], strict=False))


def _imports(code: str) -> list[str]:
    """The import statements of ``code``, read line by line (a parenthesised list may span
    lines), so that a block which is not Python as a whole (a signature) still yields them."""
    lines, found, at = code.splitlines(), [], 0
    while at < len(lines):
        if not lines[at].startswith(("import ", "from ")):
            at += 1
            continue
        statement = lines[at]
        while statement.count("(") > statement.count(")") and at + 1 < len(lines):
            at += 1
            statement += "\n" + lines[at]
        found.append(statement)
        at += 1
    return found


IMPORTING = [snippet for snippet in ALL if _imports(snippet.code)]


@pytest.mark.parametrize("snippet", IMPORTING, ids=[s.name for s in IMPORTING])
def test_every_import_the_docs_show_works(snippet, request):
    """Also in the blocks that are not run as a whole (signatures)."""
    _apply_markers(snippet, request)
    for statement in _imports(snippet.code):
        exec(compile(statement, snippet.name, "exec"), {})


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs(snippet, workspace, monkeypatch, request):
    if "skip" in snippet.markers:
        pytest.skip(snippet.markers["skip"][0])
    _apply_markers(snippet, request)
    monkeypatch.chdir(workspace)
    page = [s for s in ALL if s.page == snippet.page]
    index = page.index(snippet)
    session = SESSIONS.get(snippet.page)
    if session is None or session.done > index:  # run alone or out of order: start afresh
        session = SESSIONS[snippet.page] = Session()
    grouped = dist.is_available() and dist.is_initialized()
    try:
        for earlier in page[session.done : index]:  # replay what this one may build on
            if _runnable(earlier) and "xfail" not in earlier.markers:
                _run(earlier, session.namespace, workspace)
            session.done += 1
        _run(snippet, session.namespace, workspace)
    finally:
        session.done = index + 1
        if not grouped and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a snippet's process group ends with it


def _run(snippet: Snippet, namespace: dict, workspace: Path) -> None:
    for name in (*RUNS, *EXPORTS):
        if f'"{name}"' in snippet.code:
            _folder(workspace, name)
    torch.manual_seed(0)
    _execute(snippet, namespace)
