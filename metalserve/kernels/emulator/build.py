"""Compiles a generated kernel with the system g++ into a cached shared library (or an ASan program)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from metalserve.kernels.emulator.signature import GeneratedKernel, Param

EMULATOR_DIR = Path(__file__).resolve().parent
# -O1: a third faster to build than -O2, and emulated kernels run in milliseconds either way.
CXX_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-Wno-attributes", "-U_FORTIFY_SOURCE", "-pthread")
ASAN_FLAGS = ("-std=c++20", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
              "-Wno-attributes", "-pthread")

# A kernel-scope `threadgroup` array or scalar declaration, e.g. `threadgroup float buf[NSG * D];`.
_TG_DECL = re.compile(
    r"(?<![\w:])threadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?)\s+"
    r"([A-Za-z_]\w*)\s*((?:\[[^\]]+\]\s*)*);"
)

_TYPE = r"([A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?)"
_READ_ONLY = r"(?:const\s+(?:device|constant)|(?:device|constant)\s+const)"
# `(const device half4*)(expr)`: a read-only device pointer cast, kept counted as dev_cast<...>(expr).
_DEVICE_CAST = re.compile(r"\(\s*" + _READ_ONLY + r"\s+" + _TYPE + r"\s*\*\s*\)\s*\(")
# `const device T*` anywhere else (parameters, locals, helpers' arguments).
_DEVICE_PTR = re.compile(r"(?<![\w:])" + _READ_ONLY + r"\s+" + _TYPE + r"\s*\*")
COUNT_SLOTS = 64  # msl_rt::kMaxBuffers: byte counters, one per buffer slot
COUNT_NAMES = ("barriers", "simd_ops", "simd_mma")  # the counters after them


class EmulatorBuildError(RuntimeError):
    """g++ rejected the kernel; the message holds the compiler's output."""


def cache_dir() -> Path:
    """Where built kernels live: $METALSERVE_EMULATOR_CACHE, else ~/.cache/metalserve/emulator."""
    env = os.environ.get("METALSERVE_EMULATOR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "metalserve" / "emulator"


def compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise EmulatorBuildError(f"the Metal emulator needs a C++20 compiler; {cxx!r} is not on PATH")
    return cxx


def rewrite_threadgroup_decls(source: str) -> str:
    """Kernel-scope threadgroup variables become references into the group's shared arena."""
    return _TG_DECL.sub(
        lambda m: f"auto& {m.group(2)} = ::msl_rt::tg_var<{m.group(1)}{m.group(3).strip()}>(__LINE__);",
        source,
    )


def rewrite_device_pointers(source: str) -> str:
    """Read-only device pointers become msl_rt::dev_ptr, which counts the bytes read per buffer."""
    source = _DEVICE_CAST.sub(lambda m: f"::msl_rt::dev_cast<const {m.group(1)}>(", source)
    return _DEVICE_PTR.sub(lambda m: f"::msl_rt::dev_ptr<const {m.group(1)}> ", source)


def _argument(p: Param, slot: int) -> str:
    """The launcher's expression for one kernel parameter; `slot` indexes the buffer array."""
    if p.kind == "attribute":
        return f"c.{p.ctype}"
    if p.kind in ("scalar", "ndim"):
        return f"*reinterpret_cast<const {p.ctype}*>(bufs[{slot}])"
    if p.kind == "output":
        return f"reinterpret_cast<{p.ctype}*>(bufs[{slot}])"
    return f"::msl_rt::dev_ptr<const {p.ctype}>(reinterpret_cast<const {p.ctype}*>(bufs[{slot}]), {slot})"


def launcher_source(kernel: GeneratedKernel, asan: bool) -> str:
    """The generated kernel plus a C entry point that runs it over a grid, and for ASan a main()."""
    args = []
    slot = 0
    for p in kernel.params:
        args.append(_argument(p, slot))
        slot += p.kind != "attribute"
    call = f"{kernel.name}{kernel.template_args}(\n      " + ",\n      ".join(args) + ");"
    text = '#include "msl.h"\n' + rewrite_device_pointers(rewrite_threadgroup_decls(kernel.source))
    text += f"""
extern "C" int msl_run(void* const* bufs, const unsigned* dims, int reverse, int workers,
                       unsigned long stack, char* err, int err_len, unsigned long long* counts) {{
  msl_rt::Dims d{{{{dims[0], dims[1], dims[2]}}, {{dims[3], dims[4], dims[5]}}}};
  std::function<void(const msl_rt::ThreadCtx&)> body = [&](const msl_rt::ThreadCtx& c) {{
    {call}
  }};
  static_assert(msl_rt::kMaxBuffers == {COUNT_SLOTS} && msl_rt::kNumCounts == {COUNT_SLOTS + len(COUNT_NAMES)});
  std::string e = msl_rt::launch(d, reverse != 0, workers, stack, body,
                                 reinterpret_cast<uint64_t*>(counts));
  std::snprintf(err, err_len, "%s", e.c_str());
  return e.empty() ? 0 : 1;
}}
"""
    if asan:
        text += '#include "asan_main.h"\n'
    return text


def _digest(text: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (text, " ".join(flags), _headers_text(), compiler()):
        h.update(part.encode())
    return h.hexdigest()[:24]


@cache
def _headers_text() -> str:
    return "".join(p.read_text() for p in sorted(EMULATOR_DIR.glob("*.h")))


def _include_dir(flags: tuple[str, ...]) -> Path:
    """A cached copy of the headers with msl.h precompiled for `flags`: compiles take ~40% less time."""
    out = cache_dir() / f"pch-{_digest('', flags)}"
    if (out / "msl.h.gch").exists():
        return out
    cache_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), suffix=".tmp"))
    for header in EMULATOR_DIR.glob("*.h"):
        shutil.copy(header, tmp / header.name)
    cmd = [compiler(), *flags, "-x", "c++-header", str(tmp / "msl.h"), "-o", str(tmp / "msl.h.gch")]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        return EMULATOR_DIR  # still correct, only slower
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build(kernel: GeneratedKernel, asan: bool = False) -> Path:
    """Path of the built library (or ASan program) for `kernel`, compiling it once per content hash."""
    flags = ASAN_FLAGS if asan else CXX_FLAGS
    text = launcher_source(kernel, asan)
    digest = _digest(text, flags)
    out_dir = cache_dir()
    target = out_dir / f"{kernel.name[:80]}-{digest}{'.asan' if asan else '.so'}"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{kernel.name[:80]}-{digest}.cpp"
    src.write_text(text)
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    include = EMULATOR_DIR if asan else _include_dir(flags)
    cmd = [compiler(), *flags, "-I", str(include), str(src), "-o", str(tmp_path)]
    if not asan:
        cmd.insert(1, "-shared")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise EmulatorBuildError(f"g++ failed on {src}:\n{result.stderr[-6000:]}")
    os.replace(tmp_path, target)  # atomic: concurrent builders never see a half-written file
    return target


def build_all(kernels: list[tuple[GeneratedKernel, bool]]) -> list[Path]:
    """Build several (kernel, asan) pairs at once, one compiler per core (tests warm the cache so)."""
    workers = max(1, min(len(kernels), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pair: build(*pair), kernels))
