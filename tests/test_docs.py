"""The README and docs/ cannot rot: every Python block runs, every command
that names one of jaxring's scripts is accepted by that script, every link
between pages resolves, and the troubleshooting page lists exactly the
errors the sources raise."""

import ast
import functools
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

pytestmark = pytest.mark.docs


def blocks(kind):
    out = []
    for page in PAGES:
        for i, code in enumerate(re.findall(rf"```{kind}\n(.*?)```", page.read_text(), re.S)):
            out.append(pytest.param(code, id=f"{page.relative_to(ROOT)}#{i}"))
    return out


PYTHON_BLOCKS = blocks("python")


def test_docs_exist_and_have_examples():
    assert (ROOT / "docs" / "README.md").exists()
    assert len(PYTHON_BLOCKS) >= 8


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_python_block_runs(script, code):
    # As pasted into a fresh interpreter: no XLA_FLAGS, so a block that
    # needs several devices must ask for them (jaxring.use_cpu_devices).
    res = script(code, devices=None, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]


def _block_with(page: str, text: str) -> str:
    return next(
        code
        for code in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
        if text in code
    )


# Appended to a page's training step: its update against the gradient of the
# whole batch on one device (an extra or missing reduction is off by 8x).
_UPDATE_CHECKS = {
    "README.md": (
        "jaxring.overlap",
        """
host = jax.tree.map(np.asarray, batch)
whole = jax.grad(lambda p: jnp.mean(
    (jnp.tanh(host["x"] @ p["w1"]) @ p["w2"] - host["y"]) ** 2))(params)
new = train_step(params, batch)[0]
for k in whole:
    np.testing.assert_allclose(np.asarray(params[k] - new[k]), 0.1 * np.asarray(whole[k]),
                               rtol=1e-4, atol=1e-8)
""",
    ),
    "docs/overlap.md": (
        'report="full"',
        """
import numpy as np
before = [jnp.full((256, 256), 0.01) for _ in range(6)]
whole = jax.grad(loss_fn)(before, np.asarray(x))
new = step(before, x)[0]
for b, n, g in zip(before, new, whole):
    np.testing.assert_allclose(np.asarray(b - n), 0.1 * np.asarray(g), rtol=1e-4, atol=1e-9)
""",
    ),
}


@pytest.mark.parametrize("page", sorted(_UPDATE_CHECKS))
def test_training_step_updates_as_one_device_on_the_whole_batch(script, page):
    marker, check = _UPDATE_CHECKS[page]
    res = script(_block_with(page, marker) + check, devices=None, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]


# ---- shell commands ----------------------------------------------------------

# Commands whose options are checked, and how to ask each for its help.
_TOOLS = {
    "jaxring-demo": ["-m", "jaxring.demo"],
    "jaxring-bench": ["-m", "jaxring.bench"],
    "jaxring-launch": ["-m", "jaxring.launch"],
}


def _invocations():
    """(how to run the tool, the options a page passes it) for every shell
    line that runs one of jaxring's scripts or modules."""
    found = []
    for page in PAGES:
        for code in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.S):
            for line in code.splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                for segment in line.split("&&"):
                    words = shlex.split(segment)
                    # Skip what runs the command (sudo, srun ..., mpirun ...).
                    while words and words[0] not in ("python", "python3", *_TOOLS):
                        words.pop(0)
                    tool = _tool_of(words)
                    if tool:
                        found.append((page.name, *tool))
    return found


def _tool_of(words):
    if not words:
        return None
    if words[0] in _TOOLS:
        return tuple(_TOOLS[words[0]]), _options(words[1:])
    if words[0] not in ("python", "python3") or len(words) < 2:
        return None
    if words[1] == "-m" and words[2].startswith("jaxring"):
        return ("-m", words[2]), _options(words[3:])
    if words[1].startswith(("examples/", "benchmarks/")):
        return (str(ROOT / words[1]),), _options(words[2:])
    return None


def _options(words):
    """The options before the first script argument (`x.py`), `--`, or the
    launcher's `-m MODULE` (what follows it is the module's)."""
    opts = []
    for w in words:
        if w == "--" or w.endswith(".py"):
            break
        if w.startswith("-"):
            opts.append(w.split("=")[0])
        if w == "-m":
            break
    return tuple(opts)


@functools.cache
def _help(tool):
    res = subprocess.run(
        [sys.executable, *tool, "--help"], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert res.returncode == 0, (tool, res.stderr[-2000:])
    return res.stdout


INVOCATIONS = _invocations()


def test_pages_run_jaxrings_tools():
    assert len(INVOCATIONS) >= 10, INVOCATIONS


# The options are argparse's, the same on every jax: the newest runs these.
@pytest.mark.slow
@pytest.mark.parametrize(
    "page,tool,options", INVOCATIONS, ids=[f"{p}:{' '.join(t)}" for p, t, _ in INVOCATIONS]
)
def test_command_options_exist(page, tool, options):
    if not tool[0].startswith("-"):
        assert pathlib.Path(tool[0]).exists(), tool
    text = _help(tool)
    for opt in options:
        assert re.search(rf"(^|[\s,\[]){re.escape(opt)}\b", text), (page, tool, opt)


# ---- links ---------------------------------------------------------------------


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)
    assert "docs/README.md" in (ROOT / "README.md").read_text()


# ---- troubleshooting -------------------------------------------------------------

TROUBLE = ROOT / "docs" / "troubleshooting.md"


def _python_literals(path):
    """Every string constant of a Python file, f-strings as their fixed parts."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def _cpp_literals(path):
    """Every string literal of a C++ file, adjacent literals joined."""
    text = path.read_text()
    out = []
    for run in re.finditer(r'(?:"(?:[^"\\\n]|\\.)*"\s*)+', text):
        out.append("".join(re.findall(r'"((?:[^"\\\n]|\\.)*)"', run.group(0))))
    return out


@functools.cache
def _source_literals():
    lits = []
    for p in (ROOT / "jaxring").rglob("*.py"):
        lits += _python_literals(p)
    for p in (ROOT / "xla_ffi").rglob("*.cc"):
        lits += _cpp_literals(p)
    return lits


def _headings():
    return re.findall(r"^### `(.+)`$", TROUBLE.read_text(), re.M)


def test_every_documented_message_is_in_the_sources():
    headings = _headings()
    assert len(headings) >= 40
    for heading in headings:
        for fragment in heading.split("` … `"):
            assert any(fragment in lit for lit in _source_literals()), fragment


def _raised_messages():
    """The longest fixed part of each message the Python package raises."""
    out = []
    for path in (ROOT / "jaxring").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                arg = node.exc.args[0]
                if isinstance(arg, ast.BinOp):
                    arg = arg.left
                parts = (
                    [arg.value]
                    if isinstance(arg, ast.Constant)
                    else [v.value for v in arg.values if isinstance(v, ast.Constant)]
                    if isinstance(arg, ast.JoinedStr)
                    else []
                )
                parts = [p.strip(" .,:;()") for p in parts if isinstance(p, str)]
                if parts and max(map(len, parts)) >= 6:
                    out.append((f"{path.name}:{node.lineno}", max(parts, key=len)))
    return out


def test_every_raised_message_is_documented():
    # A message is documented when a heading quotes it, or quotes enough of it.
    fragments = [f for h in _headings() for f in h.split("` … `")]
    raised = _raised_messages()
    assert len(raised) >= 30
    missing = [
        (where, msg)
        for where, msg in raised
        if not any(msg[:60] in f or (len(f) >= 12 and f in msg) for f in fragments)
    ]
    assert not missing, missing


def _layout_entries(heading: str) -> set:
    """The first column of the table under `heading` in docs/layout.md."""
    lines = (ROOT / "docs" / "layout.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if heading in line)
    rows = []
    for line in lines[start:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return {m.group(1) for r in rows if (m := re.match(r"\| `([^`]+)` \|", r))}


def test_the_layout_page_names_every_folder_and_module():
    # docs/layout.md's tables match the tree: every folder of tracked files
    # and every module of jaxring/_src, and nothing that is gone.
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    folders = {str(pathlib.PurePosixPath(f).parent) + "/" for f in listed.stdout.split()}
    folders.discard("./")
    assert _layout_entries("| folder |") == folders
    modules = {p.name for p in (ROOT / "jaxring" / "_src").glob("*.py")}
    assert _layout_entries("module by module") == modules
