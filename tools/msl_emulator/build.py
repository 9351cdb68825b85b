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

from tools.msl_emulator.signature import GeneratedKernel, Param

EMULATOR_DIR = Path(__file__).resolve().parent
# -O1: a third faster to build than -O2, and emulated kernels run in milliseconds either way.
CXX_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-Wno-attributes", "-U_FORTIFY_SOURCE", "-pthread")
ASAN_FLAGS = ("-std=c++20", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-Wno-attributes", "-pthread")

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
KERNELS_PER_BATCH = 12  # kernels per g++ run when warming the cache


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


def kernel_unit(kernel: GeneratedKernel, symbol: str) -> str:
    """The generated kernel in a namespace of its own, plus a C entry point `symbol` that runs it over a
    grid. Several units fit in one translation unit (one g++ run builds many kernels)."""
    args = []
    slot = 0
    for p in kernel.params:
        args.append(_argument(p, slot))
        slot += p.kind != "attribute"
    ns = f"msl_k_{symbol}"
    call = f"{ns}::{kernel.name}{kernel.template_args}(\n      " + ",\n      ".join(args) + ");"
    text = f"namespace {ns} {{\n" + rewrite_device_pointers(rewrite_threadgroup_decls(kernel.source))
    text += f"""}}  // namespace {ns}
extern "C" int {symbol}(void* const* bufs, const unsigned* dims, int reverse, int workers,
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
    return text


def launcher_source(kernel: GeneratedKernel, asan: bool) -> str:
    """One kernel's whole translation unit (entry point `msl_run`), and for ASan a main()."""
    text = '#include "msl.h"\n' + kernel_unit(kernel, "msl_run")
    if asan:
        text += '#include "asan_main.h"\n'
    return text


def entry_symbol(library: Path) -> str:
    """The entry point's name in a built library: msl_run_<digest> (libraries may hold several)."""
    return "msl_run_" + library.name.rsplit("-", 1)[1].removesuffix(".so")


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


@cache
def _target(kernel: GeneratedKernel, asan: bool) -> Path:
    flags = ASAN_FLAGS if asan else CXX_FLAGS
    digest = _digest(launcher_source(kernel, asan), flags)
    return cache_dir() / f"{kernel.name[:80]}-{digest}{'.asan' if asan else '.so'}"


def _compile(text: str, stem: str, asan: bool) -> Path:
    """Compiles one translation unit into a temporary file in the cache; returns its path."""
    flags = ASAN_FLAGS if asan else CXX_FLAGS
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{stem}.cpp"
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
    return tmp_path


def _build_libraries(kernels: list[GeneratedKernel]) -> None:
    """Builds several kernels as one shared library, linked into the cache under each one's name."""
    targets = [_target(k, False) for k in kernels]
    units = "".join(kernel_unit(k, entry_symbol(t)) for k, t in zip(kernels, targets, strict=True))
    stem = "batch-" + hashlib.sha256("".join(t.name for t in targets).encode()).hexdigest()[:16]
    built = _compile('#include "msl.h"\n' + units, stem, asan=False)
    for target in targets:
        link = built.with_name(target.name + ".tmp-link")
        os.link(built, link)
        os.replace(link, target)  # atomic: concurrent builders never see a half-written file
    built.unlink()


def build(kernel: GeneratedKernel, asan: bool = False) -> Path:
    """Path of the built library (or ASan program) for `kernel`, compiling it once per content hash."""
    target = _target(kernel, asan)
    if target.exists():
        return target
    if asan:
        os.replace(_compile(launcher_source(kernel, True), target.stem, asan=True), target)
    else:
        _build_libraries([kernel])
    return target


def build_all(kernels: list[tuple[GeneratedKernel, bool]]) -> list[Path]:
    """Build several (kernel, asan) pairs at once: one compiler per core, each compiling a batch of
    kernels in one translation unit (g++'s fixed cost per run is most of a small kernel's build)."""
    missing = {_target(k, a): (k, a) for k, a in kernels if not _target(k, a).exists()}
    programs = [k for k, a in missing.values() if a]
    libraries = [k for k, a in missing.values() if not a]
    workers = max(1, len(os.sched_getaffinity(0)))
    chunks = max(workers, -(-len(libraries) // KERNELS_PER_BATCH))
    jobs: list[tuple[list[GeneratedKernel], bool]] = [(libraries[i::chunks], False) for i in range(chunks)]
    jobs += [([k], True) for k in programs]
    with ThreadPoolExecutor(workers) as pool:
        list(
            pool.map(
                lambda job: _build_libraries(job[0]) if not job[1] else build(job[0][0], True),
                [j for j in jobs if j[0]],
            )
        )
    return [build(k, a) for k, a in kernels]
