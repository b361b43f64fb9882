"""The build and the JAX versions: what build_info reports, the tested range,
and the errors and warnings at the edges of that range."""

import ast
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import types

import jax
import jaxlib
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxring
from jaxring._src import jax_compat, runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_build_info_names_the_build_and_the_running_versions():
    info = jaxring.build_info()
    assert info["version"] == jaxring.__version__
    assert info["jax"] == jax.__version__
    assert info["jaxlib"] == jaxlib.__version__
    assert info["backends"]["cpu"] is True
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", info["built_with_jaxlib"])
    assert re.fullmatch(r"\d+\.\d+", info["ffi_api"])
    assert info["jax_tested"] is jax_compat.in_tested_range()
    assert "cuda" in info and isinstance(info["cuda"], str)


def test_the_running_jax_is_in_the_tested_range():
    # CI runs the suite on each supported release; an untested one here
    # means the matrix or the range is out of date.
    assert jax_compat.in_tested_range(), jax_compat.untested_versions()


def test_one_build_runs_on_the_running_jaxlib():
    """The handlers were compiled against build_info()["built_with_jaxlib"]'s
    headers (0.10.2 for a default pip install) and run here on whatever
    jaxlib is installed: an allreduce equals lax.psum."""
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(
        np.arange(8 * 5, dtype=np.float32).reshape(8, 5), NamedSharding(mesh, P("i"))
    )

    def step(reduce):
        return jax.jit(
            jax.shard_map(
                lambda v: reduce(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False
            )
        )

    np.testing.assert_array_equal(
        np.asarray(step(jaxring.psum)(x)), np.asarray(step(jax.lax.psum)(x))
    )


def test_pyproject_declares_the_tested_range():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (lo_major, lo_minor), (hi_major, hi_minor) = jax_compat.SUPPORTED_JAX
    want = f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"
    deps = meta["project"]["dependencies"]
    for name in ("jax", "jaxlib"):
        assert f"{name}{want}" in deps, (name, want, deps)
    # The build compiles against the oldest supported jaxlib's FFI headers.
    assert f"jaxlib=={lo_major}.{lo_minor}.2" in meta["build-system"]["requires"]


@pytest.mark.parametrize(
    "jax_version,jaxlib_version,outside",
    [
        ("0.12.0.1", "0.12.0.1", []),
        ("0.10.0", "0.11.2", []),
        ("0.13.0", "0.12.0.1", ["jax 0.13.0"]),
        ("0.9.2", "0.9.2", ["jax 0.9.2", "jaxlib 0.9.2"]),
        (
            "0.13.0.dev20270101",
            "0.13.0.dev20270101",
            ["jax 0.13.0.dev20270101", "jaxlib 0.13.0.dev20270101"],
        ),
    ],
)
def test_versions_outside_the_range_are_named(monkeypatch, jax_version, jaxlib_version, outside):
    monkeypatch.setattr(jax, "__version__", jax_version)
    monkeypatch.setattr(jaxlib, "__version__", jaxlib_version)
    assert jax_compat.untested_versions() == outside
    monkeypatch.setattr(jax_compat, "_warned", False)
    if outside:
        with pytest.warns(
            RuntimeWarning,
            match="jaxring is tested with jax and "
            r"jaxlib >= 0\.10, < 0\.13; this process runs",
        ):
            jax_compat.warn_if_untested()
    else:
        with jax_compat.warnings.catch_warnings():
            jax_compat.warnings.simplefilter("error")
            jax_compat.warn_if_untested()


def test_ffi_api_mismatch_names_both_jaxlibs(monkeypatch):
    """XLA's refusal of a handler built against newer headers becomes an
    error that says which jaxlib each side is and how to rebuild."""
    xla_text = (
        "XLA FFI handler registration for jaxring_allreduce_cpu on "
        "platform Host (canonical host) failed because the handler's "
        "API version (0.5) is incompatible with the framework's API "
        "version (0.4)"
    )

    def refuse(name, capsule, platform):
        raise RuntimeError(xla_text)

    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse)
    with pytest.raises(RuntimeError, match="is too old to load") as caught:
        runtime.register_targets({"jaxring_allreduce_cpu": object()}, platform="cpu")
    text = str(caught.value)
    assert jaxlib.__version__ in text and xla_text in text
    assert "--no-build-isolation" in text


def test_other_registration_errors_pass_through(monkeypatch):
    def refuse(name, capsule, platform):
        raise ValueError("some other failure")

    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse)
    with pytest.raises(ValueError, match="some other failure"):
        runtime.register_targets({"x": object()}, platform="cpu")


def test_every_jax_internal_goes_through_jax_compat():
    offenders = []
    for path in [
        *(ROOT / "jaxring").rglob("*.py"),
        *(ROOT / "examples").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]:
        if path.name == "jax_compat.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bjax\._src\b|from jax import core\b", line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, offenders


_EXTENSIONS = {"_jaxring", "_jaxring_cuda", "_build_config"}


def test_only_lib_imports_the_compiled_extensions():
    # One door (jaxring/_src/lib.py): no module imports the extensions
    # itself, at its top or inside a function (the package's __init__ checks
    # that the build is there, with an error that says what to do).
    offenders = []
    for path in (ROOT / "jaxring").rglob("*.py"):
        if path.name == "lib.py" or path == ROOT / "jaxring" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxring":
                names = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module.removeprefix("jaxring.")}
            elif isinstance(node, ast.Import):
                names = {a.name.removeprefix("jaxring.") for a in node.names}
            else:
                continue
            if names & _EXTENSIONS:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_the_library_imports_its_modules_at_their_top():
    # An import inside a function hides a dependency (and an import circle)
    # from the reader. The CUDA extension is the exception: optional, it is
    # loaded on first use (lib.cuda()).
    inside = []
    for path in (ROOT / "jaxring" / "_src").rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                if any(n.startswith("jaxring") for n in names) and path.name != "lib.py":
                    inside.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not inside, inside


def _stub_names(stub: pathlib.Path) -> dict:
    """{top-level name: set of member names (classes) or None}."""
    out = {}
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))
            }
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign):
            out[node.target.id] = None
        elif isinstance(node, ast.ImportFrom) and node.module is None:  # a submodule
            out.update({a.asname or a.name: None for a in node.names})
    return out


def _module_names(module) -> dict:
    out = {}
    for name, value in vars(module).items():
        if name.startswith("__"):
            continue
        if isinstance(value, type):
            out[name] = {
                m for m in vars(value) if not m.startswith("_") or m in ("__init__", "__repr__")
            }
        else:
            out[name] = None
    return out


def _stubs_match(module, stub: pathlib.Path) -> None:
    """The stub names what the module has; a submodule, what its own stub
    beside it names."""
    assert _stub_names(stub) == _module_names(module), stub
    for name, value in vars(module).items():
        if isinstance(value, types.ModuleType):
            _stubs_match(value, stub.parent / f"{name}.pyi")


@pytest.mark.parametrize("name", ["_jaxring", "_jaxring_cuda"])
def test_the_extension_stubs_name_what_the_extensions_have(name):
    # The stubs beside the installed package (so they ship in the wheel)
    # list exactly the extension's functions, classes, their members,
    # constants and submodules. Regenerate: python -m nanobind.stubgen -r
    # -m jaxring.NAME (a module with submodules gets a folder of stubs).
    from jaxring._src import lib

    module = lib.cpu if name == "_jaxring" else lib.cuda()
    if module is None:
        pytest.skip(f"the CUDA extension is {lib.cuda_status()}")
    here = pathlib.Path(jaxring.__file__).parent
    stub = here / name / "__init__.pyi"
    if not stub.exists():
        stub = here / f"{name}.pyi"
    assert stub.exists(), f"no stub of {name} is installed in {here}"
    _stubs_match(module, stub)


@pytest.mark.slow
@pytest.mark.parametrize("value, ok", [("yes", False), ("cuda", False), ("off", True)])
def test_the_cuda_build_setting_is_checked_at_configure(tmp_path, value, ok):
    # JAXRING_CUDA comes from the environment; a value CMake does not know
    # must stop the build rather than fall to AUTO and build without CUDA.
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed (pip install cmake)"
    res = subprocess.run(
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(tmp_path),
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DJAXRING_BUILD_PYTHON=OFF",
            f"-DJAXRING_CUDA={value}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if ok:
        assert res.returncode == 0, res.stderr[-2000:]
    else:
        assert res.returncode != 0
        assert f"JAXRING_CUDA is '{value}'; it must be AUTO, ON or OFF" in res.stderr
