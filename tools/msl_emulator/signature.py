"""The kernel source MLX generates around a `metal_kernel` body, rebuilt here for the emulator.

Mirrors `write_signature` / `write_template` in MLX's `mlx/backend/common/metal_kernel.cpp` (0.32):
inputs with fewer than 8 elements go to `constant` memory, 0-d inputs become references, `<name>_shape`,
`_strides` and `_ndim` buffers appear when the body mentions them, and attributes are added for every
attribute name found in the body. A test compares this text with MLX's own `verbose=True` output.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metalserve.kernels.metal.launch import KernelLaunch, TemplateValue, as_array

MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, type) in MLX's order; a body that mentions the name gets the parameter.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_NAMES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}


def type_name(dtype: mx.Dtype) -> str:
    if dtype not in _TYPE_NAMES:
        raise ValueError(f"metal_kernel cannot take dtype {dtype}")
    return _TYPE_NAMES[dtype]


@dataclass(frozen=True)
class Param:
    """One parameter of the generated kernel, with how the emulator's launcher fills it."""

    text: str  # the declaration as MLX writes it
    kind: str  # "input", "scalar", "shape", "strides", "ndim", "output" or "attribute"
    ctype: str  # element type (or the attribute name for attributes)
    index: int  # which input/output array it belongs to


@dataclass(frozen=True)
class GeneratedKernel:
    """The source MLX would compile for one launch, its kernel name and its parameters."""

    name: str
    source: str
    template_args: str  # "<float, 16, 1>" or ""
    params: tuple[Param, ...]


def _template_value(value: TemplateValue) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return type_name(value)


def _template_kind(value: TemplateValue) -> str:
    if isinstance(value, bool):
        return "bool"
    return "int" if isinstance(value, int) else "typename"


def kernel_name(launch: KernelLaunch) -> str:
    name = "custom_kernel_" + launch.name
    if launch.template:
        name += "_" + template_hash(template_def(launch))
    for value in launch.inputs:
        arr = as_array(value)
        name += "_" + type_name(arr.dtype)
        if arr.ndim == 0:
            name += "s"
        elif arr.size < MAX_CONSTANT_ARRAY_SIZE:
            name += "c"
    for dtype in launch.output_dtypes:
        name += "_" + type_name(dtype)
    return name


def template_def(launch: KernelLaunch) -> str:
    return "<" + ", ".join(_template_value(v) for _, v in launch.template) + ">"


def template_hash(definition: str) -> str:
    return definition.replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]


def _input_params(launch: KernelLaunch) -> list[Param]:
    params: list[Param] = []
    for i, (name, value) in enumerate(zip(launch.input_names, launch.inputs, strict=True)):
        arr = as_array(value)
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        tname = type_name(arr.dtype)
        kind = "scalar" if arr.ndim == 0 else "input"
        params.append(Param(f"  const {location} {tname}{ref} {name}", kind, tname, i))
        if arr.ndim == 0:
            continue
        if f"{name}_shape" in launch.source:
            params.append(Param(f"  const constant int* {name}_shape", "shape", "int", i))
        if f"{name}_strides" in launch.source:
            params.append(Param(f"  const constant int64_t* {name}_strides", "strides", "int64_t", i))
        if f"{name}_ndim" in launch.source:
            params.append(Param(f"  const constant int& {name}_ndim", "ndim", "int", i))
    return params


def generate(launch: KernelLaunch) -> GeneratedKernel:
    """The full kernel source MLX generates for `launch` (header, template, signature, body)."""
    params = _input_params(launch)
    for i, (name, dtype) in enumerate(zip(launch.output_names, launch.output_dtypes, strict=True)):
        tname = type_name(dtype)
        full = f"atomic<{tname}>" if launch.atomic_outputs else tname
        params.append(Param(f"  device {full}* {name}", "output", full, i))
    lines = [f"{p.text} [[buffer({n})]]" for n, p in enumerate(params)]
    for attr, atype in METAL_ATTRIBUTES:
        if attr in launch.source:
            params.append(Param(f"  {atype} {attr}", "attribute", attr, -1))
            lines.append(f"  {atype} {attr} [[{attr}]]")
    name = kernel_name(launch)
    text = launch.header
    if launch.template:
        text += "template <" + ", ".join(f"{_template_kind(v)} {k}" for k, v in launch.template) + ">\n"
    text += f"[[kernel]] void {name}(\n" + ",\n".join(lines) + ") {\n" + launch.source + "\n}\n"
    targs = ""
    if launch.template:
        targs = template_def(launch)
        full_name = name + targs
        text += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({full_name}) {full_name};\n'
    return GeneratedKernel(name, text, targs, tuple(params))
