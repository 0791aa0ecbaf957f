"""Build torch_tree_attn_sim: the Metal Shading Language simulator, test apparatus of
torch-tree-attn. It is never part of the product's install; the README's test set-up
builds it:

    pip install --no-build-isolation ./tests/sim

At build time csrc/msl2cpp.py translates the product's shaders/*.metal and the
simulator's own self-test kernels (csrc/selftest/*.metal) into C++ against the MSL
prelude (csrc/msl.h). The extension compiles them with the fiber runtime, the product's
validation (csrc/validation.cpp) and Metal launch plan (csrc/metal/plan.cpp), so the
simulator runs exactly what the MPS backend would encode. C++20.

TORCH_TREE_ATTN_SANITIZE=address,undefined builds with those sanitizers; flags are shared
with the product's setup.py (csrc/build_flags.py).
"""
import glob
import os
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(HERE, "csrc")
GENERATED = os.path.join(HERE, "build", "generated")

sys.path.insert(0, os.path.join(ROOT, "csrc"))
from build_flags import libstdcxx_link_args, sanitizer_flags  # noqa: E402


def translated_kernels():
    """shaders/*.metal + csrc/selftest/*.metal -> C++ under build/generated."""
    sys.path.insert(0, CSRC)
    import msl2cpp  # noqa: E402

    inputs = sorted(glob.glob(os.path.join(ROOT, "shaders", "*.metal")))
    inputs += sorted(glob.glob(os.path.join(CSRC, "selftest", "*.metal")))
    os.makedirs(GENERATED, exist_ok=True)
    outputs = []
    for path in inputs:
        out = os.path.join(GENERATED, os.path.basename(path) + ".cpp")
        text = msl2cpp.translate_file(path)
        if not os.path.exists(out) or open(out).read() != text:
            with open(out, "w") as f:
                f.write(text)
        outputs.append(out)
    return outputs


sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
sources += [os.path.join(ROOT, "csrc", "validation.cpp"), os.path.join(ROOT, "csrc", "metal", "plan.cpp")]
sources += translated_kernels()

sanitize_compile, sanitize_link = sanitizer_flags()
cxx_flags = ["-std=c++20", "-O3", "-fvisibility=hidden"] + sanitize_compile
link_flags = sanitize_link + libstdcxx_link_args()

setup(
    name="torch_tree_attn_sim",
    version="0.1.0",
    description="Test apparatus of torch-tree-attn: a CPU simulator of its Metal shaders",
    packages=["torch_tree_attn_sim"],
    ext_modules=[
        CppExtension(
            "torch_tree_attn_sim._C",
            sources,  # absolute: two of them live outside this folder
            include_dirs=[CSRC, os.path.join(ROOT, "csrc"), os.path.join(ROOT, "shaders"), GENERATED],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
)
