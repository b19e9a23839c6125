#!/usr/bin/env python3
"""Compiles CUDA C files with NVRTC for an architecture, as the cuda plugin does at run time, and
prints each kernel's registers and spills when ptxas is at hand. No GPU needed: NVRTC comes from
CUDA_HOME, /usr/local/cuda, or the `nvidia-cuda-nvrtc` wheel of the Python environment in use.

    scripts/nvrtc-check.py [--arch sm_90] [--ptx-dir DIR] FILE.cu ...   (exit 1 if any file does not compile)

A file's own folder is on the include path, as the plugin hands NVRTC the headers beside it.
`--ptx-dir` keeps each file's PTX (DIR/FILE.ARCH.ptx), so that a change meant to leave the
generated code alone can be checked to: compare the two folders' files.
"""
import argparse
import ctypes
import glob
import os
import subprocess
import sys
import tempfile


def find(pattern_list):
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + [
        os.path.join(p, "nvidia", "cu13") for p in sys.path if p.endswith("site-packages")
    ]
    for root in filter(None, roots):
        for pattern in pattern_list:
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return found[0]
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--ptx-dir", help="write each file's PTX into this folder")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    library = find(["lib/libnvrtc.so.13", "lib64/libnvrtc.so*", "lib/libnvrtc.so*"])
    if not library:
        sys.exit("nvrtc-check: no libnvrtc found (CUDA_HOME, /usr/local/cuda, or pip install nvidia-cuda-nvrtc)")
    # NVRTC opens its builtins library by name, from the same folder.
    if os.path.dirname(library) not in os.environ.get("LD_LIBRARY_PATH", ""):
        os.environ["LD_LIBRARY_PATH"] = os.path.dirname(library) + ":" + os.environ.get("LD_LIBRARY_PATH", "")
        os.execv(sys.executable, [sys.executable] + sys.argv)
    nvrtc = ctypes.CDLL(library)
    ptxas = find(["bin/ptxas"])
    failed = 0
    for path in args.files:
        source = open(path, "rb").read()
        program = ctypes.c_void_p()
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, os.path.basename(path).encode(), 0, None, None)
        flags = [f"--gpu-architecture={args.arch}", f"--include-path={os.path.dirname(os.path.abspath(path))}"]
        options = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
        result = nvrtc.nvrtcCompileProgram(program, len(flags), options)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        if result != 0:
            failed += 1
            print(f"{path}: does not compile for {args.arch}:\n{log.value.decode()}")
            continue
        print(f"{path}: compiles for {args.arch}")
        nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(program, ptx)
        if args.ptx_dir:
            os.makedirs(args.ptx_dir, exist_ok=True)
            name = f"{os.path.splitext(os.path.basename(path))[0]}.{args.arch}.ptx"
            open(os.path.join(args.ptx_dir, name), "wb").write(ptx.value)
        if ptxas:
            with tempfile.TemporaryDirectory() as scratch:
                ptx_path = os.path.join(scratch, "kernel.ptx")
                open(ptx_path, "wb").write(ptx.value)
                report = subprocess.run([ptxas, f"-arch={args.arch}", "-v", ptx_path, "-o", os.path.join(scratch, "k.cubin")],
                                        capture_output=True, text=True)
                for line in report.stderr.splitlines():
                    if "Compiling entry" in line or "registers" in line or "spill" in line:
                        print("  " + line.split("info    : ")[-1].strip())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
