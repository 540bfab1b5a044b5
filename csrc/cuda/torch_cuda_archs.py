"""Prints the CUDA architectures for CMake's CUDA_ARCHITECTURES from the installed torch.

Nothing (an empty line) when torch is a CPU-only build (torch.version.cuda is None): the
top-level CMakeLists.txt then skips csrc/cuda entirely. Otherwise TORCH_CUDA_ARCH_LIST
("8.0;9.0+PTX", the variable torch's own extension builder reads) when set, else the
architectures torch itself was compiled for (torch.cuda.get_arch_list()).
"X.Y" becomes "XY-real" (machine code only), "X.Y+PTX" becomes "XY" (machine code and PTX).
"""
import os
import re
import sys


def from_arch_list(text):
    archs = []
    for item in re.split(r"[;\s]+", text.strip()):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        item = item[: -len("+PTX")] if ptx else item
        m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)", item)
        if not m:
            raise SystemExit(f"TORCH_CUDA_ARCH_LIST: cannot read '{item}' (expected forms like 8.0, 9.0a, 9.0+PTX)")
        archs.append(f"{m[1]}{m[2]}{m[3]}" + ("" if ptx else "-real"))
    return archs


def from_torch(arch_list):
    archs = sorted({int(a[3:]) for a in arch_list if re.fullmatch(r"sm_\d+", a)})
    # Machine code for each, PTX for the newest so later GPUs can still run it.
    return [f"{a}-real" for a in archs[:-1]] + [str(a) for a in archs[-1:]]


def main():
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"torch is not importable: {e}")
    if torch.version.cuda is None:
        print("")
        return
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    archs = from_arch_list(env) if env.strip() else from_torch(torch.cuda.get_arch_list())
    if not archs:
        archs = ["80-real", "90"]
    print(";".join(archs))


if __name__ == "__main__":
    sys.exit(main())
