"""Build llama.cpp's command-line tools from the source our `[peers]` pin vendors, once, into an ignored folder.

    python -m bench.llama_build                       # pip download the sdist (if not cached), cmake, ninja
    python -m bench.llama_build --sdist /tmp/llama_cpp_python-0.3.36.tar.gz --jobs 2
    nice -n 19 python -m bench.llama_build            # on a machine whose cores others are timing on
    python -m bench.llama_build --cuda --sdist F      # GGML_CUDA=ON for sm_90 (H100, H200), beside the CPU build
    python -m bench.llama_build --pack F              # the sdist less what no build reads, to carry to a GPU machine

The source is `llama-cpp-python==0.3.36` (pyproject's `[peers]` pin) as its source distribution
(`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`), whose `vendor/llama.cpp` is the llama.cpp
that bench.peers' llama-cpp-python rows run. It is unpacked to `outputs/peers/llama.cpp-0.3.36/src` and built
there by cmake (Release, CPU, `GGML_NATIVE=ON` as the README's peers install, static libraries, no server, no
network) into `outputs/peers/llama.cpp-0.3.36/build/bin/`:

- `llama-speculative-simple`: speculative decoding with a draft (`--spec-type draft-eagle3`: EAGLE-3) on one
  prompt, greedy when `--temp 0`; prints the text, then `decoded N tokens in T seconds` and n_drafted / n_accept;
- `llama-completion`: plain decoding (the K = 0 row), llama.cpp's own decode timing (`eval time`);
- `llama-tokenize`: a prompt's token ids, to check that llama.cpp reads each prompt as the ids we decode.

A finished build writes `build.json` (the sdist's sha256, cmake arguments, targets, compiler, seconds) beside
them; `tools()` answers only when that stamp and every binary exist, so a build is done once. 138 ninja steps:
about 6 minutes on 2 idle cores (11 at `nice -n 19` beside other jobs). bench.llama_eagle3 uses the tools and llama.cpp's converter from the same source
(`src/convert_hf_to_gguf.py`).

`--cuda`: the same tools with llama.cpp's CUDA backend (`GGML_CUDA=ON`, `CMAKE_CUDA_ARCHITECTURES=90`: the H100
and H200 only, which keeps ggml-cuda's many kernel instances to one architecture) into `build-cuda/bin/`, stamped
`build-cuda.json`, beside the CPU build of the same source. The CUDA runtime and cuBLAS link dynamically, from the
toolkit nvcc belongs to: the build runs on the GPU machine that runs the tools, which has both. `--pack F` writes
the sdist without what no build or conversion reads (vendor/llama.cpp's models/ vocabularies, docs/, media/:
76.6 MB -> 11.2 MiB), a file `--sdist` takes like the sdist itself, for a machine without network that takes
small files only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.3.36"  # llama-cpp-python, pyproject.toml's [peers] pin
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
CACHE = ROOT / "outputs" / "peers" / f"llama.cpp-{VERSION}"  # outputs/* is git-ignored
TARGETS = ("llama-speculative-simple", "llama-completion", "llama-tokenize")
CUDA_ARCHITECTURES = "90"  # sm_90: H100, H200
CUDA_CMAKE_ARGS = ("-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCHITECTURES}")
PACK_DROPS = ("models/", "docs/", "media/")  # of vendor/llama.cpp: test vocabularies and documentation, no build input
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


class BuildError(RuntimeError):
    pass


def cache_dir(cache: Path | None = None) -> Path:
    return Path(cache) if cache is not None else CACHE


def source_dir(cache: Path | None = None) -> Path:
    """llama.cpp's source (the sdist's vendor/llama.cpp), with convert_hf_to_gguf.py and gguf-py."""
    return cache_dir(cache) / "src"


def build_dir(cache: Path | None = None, cuda: bool = False) -> Path:
    return cache_dir(cache) / ("build-cuda" if cuda else "build")


def bin_dir(cache: Path | None = None, cuda: bool = False) -> Path:
    return build_dir(cache, cuda) / "bin"


def stamp_path(cache: Path | None = None, cuda: bool = False) -> Path:
    return cache_dir(cache) / ("build-cuda.json" if cuda else "build.json")


def cmake_args(cuda: bool = False) -> tuple[str, ...]:
    return CMAKE_ARGS + (CUDA_CMAKE_ARGS if cuda else ())


def tools(cache: Path | None = None, cuda: bool = False) -> dict[str, Path] | None:
    """{target: binary} of a finished build (the CUDA one with `cuda`), or None (no stamp, or a binary missing)."""
    if not stamp_path(cache, cuda).is_file():
        return None
    found = {t: bin_dir(cache, cuda) / t for t in TARGETS}
    return found if all(p.is_file() and os.access(p, os.X_OK) for p in found.values()) else None


def missing_message(cache: Path | None = None, cuda: bool = False) -> str:
    if cuda:
        return (f"llama.cpp's CUDA tools are not built under {cache_dir(cache)}; build them once on the GPU machine "
                f"with: python -m bench.llama_build --cuda")
    return (f"llama.cpp's tools are not built under {cache_dir(cache)}; build them once (about 6 minutes on 2 "
            f"cores) with: python -m bench.llama_build")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(cache: Path, given: Path | None) -> Path:
    """The sdist: `given`, else the cached copy, else `pip download` into the cache."""
    cache.mkdir(parents=True, exist_ok=True)
    if given is not None:
        if not given.is_file():
            raise BuildError(f"--sdist {given}: no such file")
        return given
    cached = cache / SDIST
    if cached.is_file():
        return cached
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={VERSION}", "-d", str(cache)]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0 or not cached.is_file():
        raise BuildError(f"pip download of llama-cpp-python=={VERSION} failed; download {SDIST} yourself and pass "
                         f"--sdist")
    return cached


def unpack(sdist: Path, dest: Path) -> None:
    """vendor/llama.cpp of the sdist -> dest (replaced whole, so a half-unpacked tree never stays)."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        if not any(m.name == "CMakeLists.txt" for m in members):
            raise BuildError(f"{sdist}: no {prefix}CMakeLists.txt (not llama-cpp-python {VERSION}'s sdist?)")
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def pack(sdist: Path, out: Path) -> Path:
    """The sdist's vendor/llama.cpp without PACK_DROPS, as a tar.gz under the sdist's own prefix (so `unpack` and
    `--sdist` take it as they take the sdist); written to a temporary name, then renamed."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    drops = tuple(prefix + d for d in PACK_DROPS)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        kept = 0
        for m in src:
            if not m.name.startswith(prefix) or m.name.startswith(drops) or m.name + "/" in drops:
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
            kept += m.name == prefix + "CMakeLists.txt"
    if not kept:
        tmp.unlink()
        raise BuildError(f"{sdist}: no {prefix}CMakeLists.txt (not llama-cpp-python {VERSION}'s sdist?)")
    tmp.rename(out)
    return out


NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def run_with_progress(cmd: list[str], log_path: Path, desc: str) -> None:
    """Run `cmd`, its output to `log_path`, with a progress bar from ninja's `[n/m]` lines (make's `[ p%]`)."""
    from tqdm import tqdm

    print("$", " ".join(cmd), flush=True)
    with open(log_path, "a") as log, tqdm(total=100, desc=desc, unit="step", dynamic_ncols=True) as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        last = ""
        for line in proc.stdout:
            log.write(line)
            last = line.strip() or last
            if m := NINJA_STEP.match(line):
                bar.total = int(m.group(2))
                bar.n = int(m.group(1))
                bar.set_postfix_str(line.split()[-1].rsplit("/", 1)[-1][:40], refresh=False)
                bar.refresh()
            elif m := re.match(r"^\[\s*(\d+)%\]", line):
                bar.n = int(m.group(1))
                bar.refresh()
        if proc.wait() != 0:
            raise BuildError(f"{cmd[0]} exited with {proc.returncode} (last line: {last!r}); the whole output is "
                             f"in {log_path}")


def cuda_compiler() -> str:
    """nvcc: on PATH, else the toolkit's usual place; a BuildError where neither has it."""
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)
    if found is None:
        raise BuildError("--cuda: nvcc is neither on PATH nor at /usr/local/cuda/bin/nvcc (the CUDA toolkit builds "
                         "ggml-cuda)")
    return found


def build(cache: Path | None = None, sdist: Path | None = None, jobs: int | None = None, force: bool = False,
          cuda: bool = False) -> dict[str, Path]:
    """Unpack and build TARGETS once (module doc), for the CPU or with `cuda`; returns {target: binary}."""
    cache = cache_dir(cache)
    if not force and (found := tools(cache, cuda)) is not None:
        return found
    for tool in ("cmake",):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not on PATH (llama.cpp builds with cmake >= 3.14)")
    args = list(cmake_args(cuda))
    if cuda:
        args.append(f"-DCMAKE_CUDA_COMPILER={cuda_compiler()}")
    t0 = time.time()
    src = fetch_sdist(cache, sdist)
    stamp_path(cache, cuda).unlink(missing_ok=True)
    print(f"unpacking vendor/llama.cpp of {src.name} into {source_dir(cache)}", flush=True)
    unpack(src, source_dir(cache))
    out = build_dir(cache, cuda)
    shutil.rmtree(out, ignore_errors=True)
    log_path = cache / ("build-cuda.log" if cuda else "build.log")
    log_path.write_text("")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_with_progress(["cmake", "-S", str(source_dir(cache)), "-B", str(out), *generator, *args], log_path,
                      "configure")
    jobs = jobs or os.cpu_count() or 1
    run_with_progress(["cmake", "--build", str(out), "--target", *TARGETS, "-j", str(jobs)], log_path, "build")
    missing = [t for t in TARGETS if not (bin_dir(cache, cuda) / t).is_file()]
    if missing:
        raise BuildError(f"the build finished without {missing} in {bin_dir(cache, cuda)}; see {log_path}")
    compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    stamp = {"llama_cpp_python": VERSION, "sdist": src.name, "sdist_sha256": sha256(src),
             "cmake_args": args, "generator": generator[1] if generator else "default",
             "targets": list(TARGETS), "jobs": jobs, "compiler": compiler, "machine": platform.machine(),
             "seconds": round(time.time() - t0, 1), "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    if cuda:
        stamp["nvcc"] = subprocess.run([cuda_compiler(), "--version"], capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1]
    stamp_path(cache, cuda).write_text(json.dumps(stamp, indent=1))
    return tools(cache, cuda)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_build", description=__doc__.split("\n")[0],
                                 epilog="The tools land in outputs/peers/llama.cpp-<version>/build/bin (--cuda: "
                                        "build-cuda/bin).")
    ap.add_argument("--sdist", type=Path, default=None, help=f"{SDIST} already downloaded, or a --pack of it "
                    "(default: pip download it into the cache folder)")
    ap.add_argument("--cache", type=Path, default=None, help=f"the folder (default {CACHE.relative_to(ROOT)})")
    ap.add_argument("--cuda", action="store_true", help="the CUDA build (GGML_CUDA=ON, sm_90) into build-cuda/")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    ap.add_argument("--force", action="store_true", help="build again even where a finished build exists")
    ap.add_argument("--pack", type=Path, default=None, metavar="OUT",
                    help="write the sdist without vendor/llama.cpp's models/, docs/ and media/ to OUT (a .tar.gz), "
                         "and build nothing")
    args = ap.parse_args(argv)
    if args.pack is not None:
        try:
            out = pack(fetch_sdist(cache_dir(args.cache), args.sdist), args.pack)
        except BuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
        return 0
    found = tools(args.cache, args.cuda)
    if found is not None and not args.force:
        print(f"already built ({stamp_path(args.cache, args.cuda)}):")
    else:
        try:
            found = build(args.cache, args.sdist, args.jobs, args.force, args.cuda)
        except BuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"built in {json.loads(stamp_path(args.cache, args.cuda).read_text())['seconds']:.0f} s:")
    for target, path in found.items():
        print(f"  {target:26} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
