"""Compiler and linker flags shared by the product's setup.py and the test simulator's
(tests/sim/setup.py). Build-time only; nothing here is installed."""
import os
import shlex
import subprocess
import sys


def sanitizer_flags():
    """(compile, link) flags from TORCH_TREE_ATTN_SANITIZE (e.g. "address,undefined"), or none."""
    wanted = os.environ.get("TORCH_TREE_ATTN_SANITIZE", "").strip()
    if not wanted:
        return [], []
    # vptr checks need the type info of every library in the process (torch's too).
    compile_flags = [f"-fsanitize={wanted}", "-fno-sanitize=vptr", "-fno-sanitize-recover=all",
                     "-fno-omit-frame-pointer", "-g"]
    return compile_flags, [f"-fsanitize={wanted}"]


def libstdcxx_link_args():
    """Link arguments that make the extension use the C++ runtime torch uses.

    Some toolchains find only libstdc++.a on their library path (seen: a g++ wrapper whose
    -B directory holds no libstdc++.so), so `-lstdc++` links a private, static copy of the
    C++ runtime into the extension. Its iostream locale state is never initialised beside
    the shared copy torch loaded, and the first number formatted into an error message
    crashes. If the compiler cannot find a shared libstdc++, link the exact one this
    process (which imported torch) has mapped."""
    if not sys.platform.startswith("linux"):
        return []
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    try:
        found = subprocess.run(cxx + ["-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []
    import torch  # noqa: F401  (maps torch's libstdc++ into this process)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libstdc++.so"):
                return [path]
    return []
