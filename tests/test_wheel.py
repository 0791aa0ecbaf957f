"""The wheel: what ``pip wheel --no-build-isolation --no-deps .`` ships, and its size.

The package's .py files, the _C extension, any prebuilt CUDA kernels (torch_tree_attn/backends/cuda/kernels/,
none here: TORCH_TREE_ATTN_CUDA_ARCHS=none) and the metadata; the shaders are embedded in _C
(build/generated/shader_source.h, compiled in on macOS only); no demo weights (examples/assets),
no tests, no examples. At most 2 MB besides the kernels.

The build must not cost CI a second C++ compile (about 2.5 minutes on CI's 2 cores): the
extension this process imported (CI's editable install built it in place, from the same
sources by the same setup.py) is put in the wheel build's private build_lib with its mtime,
and the build is told that ninja is absent (a `ninja` that fails, first on PATH), so torch's
BuildExtension does not force a rebuild and setuptools' own check finds the extension newer
than every source: only the Python files are staged. An extension older than a source (a
stale in-place build) is compiled; TREE_ATTN_WHEEL_FRESH_BUILD=1 compiles it with ninja from
scratch, to time a clean build. Every build directory is under pytest's tmp_path
(DIST_EXTRA_CONFIG), so no stale build/lib of the checkout can leak into the wheel.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

import torch_tree_attn

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "torch_tree_attn"
KERNELS = PACKAGE + "/backends/cuda/kernels/"   # the prebuilt CUDA kernels
SIZE_LIMIT = 2 * 2**20  # bytes of wheel besides the prebuilt kernels

pytestmark = pytest.mark.wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    lib, out = tmp / "lib", tmp / "dist"
    (lib / PACKAGE).mkdir(parents=True)
    ext_name = PACKAGE + "/_C" + sysconfig.get_config_var("EXT_SUFFIX")
    built = pathlib.Path(torch_tree_attn._C.__file__)
    env = dict(os.environ, TORCH_TREE_ATTN_CUDA_ARCHS="none")
    env.pop("TORCH_TREE_ATTN_SANITIZE", None)
    if not os.environ.get("TREE_ATTN_WHEEL_FRESH_BUILD") and built.name == pathlib.Path(ext_name).name:
        shutil.copy2(built, lib / ext_name)  # mtime kept: up to date if it is newer than the sources
        no_ninja = tmp / "no-ninja"
        no_ninja.mkdir()
        (no_ninja / "ninja").write_text("#!/bin/sh\nexit 1\n")
        (no_ninja / "ninja").chmod(0o755)
        env["PATH"] = os.pathsep.join([str(no_ninja), env.get("PATH", "")])
    config = tmp / "build.cfg"
    config.write_text(textwrap.dedent(f"""\
        [build]
        build_lib = {lib}
        build_temp = {tmp / "temp"}
        [bdist_wheel]
        bdist_dir = {tmp / "bdist"}
        [egg_info]
        egg_base = {tmp}
        """))
    env["DIST_EXTRA_CONFIG"] = str(config)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                           "-w", str(out), str(ROOT)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_the_package_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = [i.filename for i in z.infolist() if not i.is_dir()]
    dist_info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
    assert {n.split("/")[0] for n in dist_info} == {wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                    + ".dist-info"}
    assert {"METADATA", "WHEEL", "RECORD", "top_level.txt"} <= {n.split("/")[1] for n in dist_info}
    package = [n for n in names if n not in dist_info]
    assert all(n.startswith(PACKAGE + "/") for n in package), [n for n in package if not n.startswith(PACKAGE)]
    py = {n for n in package if n.endswith(".py")}
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts}
    assert py == sources, (sorted(sources - py), sorted(py - sources))
    extension = [n for n in package if n.startswith(PACKAGE + "/_C.") and n.endswith((".so", ".pyd"))]
    assert len(extension) == 1, extension
    kernels = [n for n in package if n.startswith(KERNELS)]
    if os.environ.get("TORCH_TREE_ATTN_CUDA_ARCHS", "none") == "none" and not (ROOT / KERNELS).exists():
        assert not kernels, kernels[:5]
    rest = set(package) - py - set(extension) - set(kernels)
    assert not rest, sorted(rest)
    # What must never ship: the demo's weights, tests, examples, shader sources.
    for name in names:
        assert not name.endswith((".safetensors", ".metal", ".metallib", ".h", ".cpp")), name
        assert "/assets/" not in name and not name.startswith(("tests/", "examples/", "csrc/", "shaders/")), name
        assert not name.startswith(PACKAGE + "/test"), name


def test_wheel_size(wheel):
    with zipfile.ZipFile(wheel) as z:
        kernels = sum(i.compress_size for i in z.infolist() if i.filename.startswith(KERNELS))
        largest = max(z.infolist(), key=lambda i: i.compress_size)
    size = wheel.stat().st_size
    assert size - kernels <= SIZE_LIMIT, (
        f"{wheel.name}: {size / 2**20:.2f} MB ({kernels / 2**20:.2f} MB of kernels); the largest member is "
        f"{largest.filename}, {largest.compress_size / 2**20:.2f} MB compressed")


def test_installed_wheel_imports_and_names_the_missing_demo_assets(wheel, tmp_path):
    """Unpacked alone (no checkout beside it): the op runs, and the built-in models report
    where they were looked for and how to point at them."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    script = textwrap.dedent("""
        import os, torch, torch_tree_attn
        from torch_tree_attn.speculative import builtin
        assert torch_tree_attn.__file__.startswith(os.environ["SITE"]), torch_tree_attn.__file__
        q = torch.randn(1, 2, 3, 64)
        out = torch.ops.tree_attn.forward(q, q[:, :1], q[:, :1], torch.ones(1, 3, 3, dtype=torch.bool))
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert not builtin.builtin_assets_present()
        try:
            builtin.find_assets()
        except FileNotFoundError as e:
            print(e)
        else:
            raise SystemExit("find_assets found assets in an installed wheel")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_TREE_ATTN_ASSETS")}
    env.update(PYTHONPATH=str(site), SITE=str(site))
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    message = proc.stdout.strip()
    assert f"looked in {site / 'examples' / 'assets'}" in message, message
    assert "TORCH_TREE_ATTN_ASSETS" in message, message
