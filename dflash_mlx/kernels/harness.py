"""Run a Metal kernel's own source on the CPU, to test it where there is no Apple GPU.

:class:`CpuMetalKernel` takes what ``mx.fast.metal_kernel`` takes (a body in MLX's style:
inputs and outputs by name, ``thread_position_in_grid`` and the other thread attributes) and is
called the same way. It wraps the body into a C++ function over ``metal_cpu.h`` (Metal's
address spaces, vector types, half and bfloat, threadgroup memory, barriers and simd_* calls
with a simdgroup of 32), compiles it with g++ into a shared library cached by a hash of its
text, and runs the grid: the threads of one threadgroup as fibers that switch at every barrier
and simd_* call, threadgroups one after another. A missing barrier reads poison, not the other
threads' writes (see ``metal_cpu.h``), so it changes the results; a barrier that not every
thread reaches is an error. It is a test tool: slow, one call at a time.
"""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

HEADER = Path(__file__).with_name("metal_cpu.h")
COMPILER = "g++"
FLAGS = ["-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden", "-w"]
POISON = 0x7F
MAX_THREADS_PER_GROUP = 1024

_C_TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),  # numpy has no bfloat16: its bits
    mx.int32: ("int32_t", np.int32),
    mx.uint32: ("uint32_t", np.uint32),
    mx.int64: ("int64_t", np.int64),
    mx.uint64: ("uint64_t", np.uint64),
    mx.int16: ("int16_t", np.int16),
    mx.uint16: ("uint16_t", np.uint16),
    mx.int8: ("int8_t", np.int8),
    mx.uint8: ("uint8_t", np.uint8),
    mx.bool_: ("bool", np.bool_),
}
# The thread attributes MLX passes to a body that names them, with their types.
_ATTRIBUTES = {
    "thread_position_in_grid": ("uint3", "grid_pos"),
    "thread_position_in_threadgroup": ("uint3", "tg_pos"),
    "threadgroup_position_in_grid": ("uint3", "group_pos"),
    "threads_per_threadgroup": ("uint3", "tg_size"),
    "threadgroups_per_grid": ("uint3", "groups"),
    "threads_per_grid": ("uint3", "grid_size"),
    "thread_index_in_threadgroup": ("uint", "index_in_tg"),
    "thread_index_in_simdgroup": ("uint", "lane"),
    "simdgroup_index_in_threadgroup": ("uint", "simd_id"),
    "simdgroups_per_threadgroup": ("uint", "simds"),
    "threads_per_simdgroup": ("uint", None),
    "thread_execution_width": ("uint", None),
}

_LAUNCH = r"""
extern "C" char __start_metal_cpu_tg[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_metal_cpu_tg[] __attribute__((weak, visibility("hidden")));

extern "C" __attribute__((visibility("default"))) int metal_cpu_launch(
    void** metal_cpu_bufs, void** metal_cpu_shapes, void** metal_cpu_strides, const int* metal_cpu_ndims,
    const uint32_t* dims, char* err, int errlen) {
  using metal_cpu::Ids;
  std::function<void(const Ids&)> body = [&](const Ids& ids) {
    metal_cpu_body(metal_cpu_bufs, metal_cpu_shapes, metal_cpu_strides, metal_cpu_ndims, ids);
  };
  uint32_t g[3] = {dims[0], dims[1], dims[2]}, t[3] = {dims[3], dims[4], dims[5]}, n[3];
  for (int d = 0; d < 3; ++d) n[d] = (g[d] + t[d] - 1) / t[d];
  metal_cpu::sched().error[0] = 0;
  std::vector<Ids> ids;
  for (uint32_t gz = 0; gz < n[2]; ++gz)
    for (uint32_t gy = 0; gy < n[1]; ++gy)
      for (uint32_t gx = 0; gx < n[0]; ++gx) {
        // Metal runs threads only inside the grid: an edge threadgroup is smaller.
        uint32_t s[3] = {std::min(t[0], g[0] - gx * t[0]), std::min(t[1], g[1] - gy * t[1]),
                         std::min(t[2], g[2] - gz * t[2])};
        uint32_t count = s[0] * s[1] * s[2];
        uint32_t simds = (count + metal_cpu::SIMD_WIDTH - 1) / metal_cpu::SIMD_WIDTH;
        if (__start_metal_cpu_tg != nullptr)
          std::memset(__start_metal_cpu_tg, metal_cpu::POISON, __stop_metal_cpu_tg - __start_metal_cpu_tg);
        ids.assign(count, Ids{});
        for (uint32_t z = 0; z < s[2]; ++z)
          for (uint32_t y = 0; y < s[1]; ++y)
            for (uint32_t x = 0; x < s[0]; ++x) {
              uint32_t i = x + s[0] * (y + s[1] * z);
              Ids& d = ids[i];
              d.tg_pos = uint3(x, y, z);
              d.group_pos = uint3(gx, gy, gz);
              d.grid_pos = uint3(gx * t[0] + x, gy * t[1] + y, gz * t[2] + z);
              d.tg_size = uint3(s[0], s[1], s[2]);
              d.groups = uint3(n[0], n[1], n[2]);
              d.grid_size = uint3(g[0], g[1], g[2]);
              d.index_in_tg = i;
              d.lane = i % metal_cpu::SIMD_WIDTH;
              d.simd_id = i / metal_cpu::SIMD_WIDTH;
              d.simds = simds;
            }
        if (!metal_cpu::run_group(body, ids)) {
          std::snprintf(err, errlen, "threadgroup (%u, %u, %u): %s", gx, gy, gz, metal_cpu::sched().error);
          return 1;
        }
      }
  return 0;
}
"""


class KernelError(RuntimeError):
    """The emulated kernel broke a rule of Metal's (a barrier not every thread reaches...)."""


def compiler_missing() -> str | None:
    """Why kernels cannot run here (no g++), or None when they can."""
    if shutil.which(COMPILER) is None:
        return f"{COMPILER} is not on PATH: the CPU harness compiles Metal kernel sources with it"
    return None


def cache_dir() -> Path:
    """Where compiled kernels are kept, one shared library per source hash."""
    return Path(tempfile.gettempdir()) / f"dflash-mlx-metal-cpu-{os.getuid()}"


_LIBRARIES: dict[str, ctypes.CDLL] = {}
# The scheduler in each library is one set of globals, and ctypes lets go of the GIL.
_LOCK = threading.Lock()


def _compile(code: str, name: str) -> ctypes.CDLL:
    digest = hashlib.sha256((code + HEADER.read_text() + " ".join(FLAGS)).encode()).hexdigest()[:20]
    if digest in _LIBRARIES:
        return _LIBRARIES[digest]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    lib_path = folder / f"{re.sub(r'[^A-Za-z0-9_]', '_', name)}-{digest}.so"
    if not lib_path.exists():
        src = folder / f".{lib_path.stem}.{os.getpid()}.cpp"
        tmp = folder / f".{lib_path.name}.{os.getpid()}.partial"
        src.write_text(code)
        try:
            result = subprocess.run(
                [COMPILER, *FLAGS, f"-I{HEADER.parent}", str(src), "-o", str(tmp)],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise KernelError(f"kernel {name} does not compile:\n{result.stderr[:3000]}")
            os.replace(tmp, lib_path)  # concurrent builds of one source agree
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.metal_cpu_launch.restype = ctypes.c_int
    _LIBRARIES[digest] = lib
    return lib


def _template_lines(template: list[tuple[str, Any]] | None) -> list[str]:
    lines = []
    for name, value in template or []:
        if isinstance(value, mx.Dtype):
            lines.append(f"  using {name} = {_C_TYPES[value][0]};")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            raise TypeError(f"template argument {name}={value!r}: a dtype, bool or int")
    return lines


class CpuMetalKernel:
    """An ``mx.fast.metal_kernel`` stand-in that runs the source on the CPU (see the module).

    Args:
        name, input_names, output_names, source, header: As ``mx.fast.metal_kernel`` takes them.
    """

    def __init__(
        self,
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
    ):
        if atomic_outputs:
            raise NotImplementedError("the CPU harness has no atomics")
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)

    def _code(self, dtypes: list[mx.Dtype], template) -> str:
        names = self.input_names + self.output_names
        params = []
        for k, (arg, dtype) in enumerate(zip(names, dtypes)):
            const = "const " if k < len(self.input_names) else ""
            ctype = _C_TYPES[dtype][0]
            params.append(f"  {const}device {ctype}* {arg} = ({const}device {ctype}*)metal_cpu_bufs[{k}];")
            if k < len(self.input_names):
                for suffix, decl in (
                    ("shape", f"const constant int* {arg}_shape = (const int*)metal_cpu_shapes[{k}];"),
                    ("strides", f"const constant int64_t* {arg}_strides = (const int64_t*)metal_cpu_strides[{k}];"),
                    ("ndim", f"const constant int {arg}_ndim = metal_cpu_ndims[{k}];"),
                ):
                    if re.search(rf"\b{arg}_{suffix}\b", self.source):
                        params.append("  " + decl)
        attrs = []
        for attr, (ctype, field) in _ATTRIBUTES.items():
            if re.search(rf"\b{attr}\b", self.source):
                value = f"metal_cpu_ids.{field}" if field else "metal_cpu::SIMD_WIDTH"
                attrs.append(f"  const {ctype} {attr} = {value};")
        return "\n".join(
            [
                '#include "metal_cpu.h"',
                self.header,
                "static void metal_cpu_body(void** metal_cpu_bufs, void** metal_cpu_shapes,"
                " void** metal_cpu_strides, const int* metal_cpu_ndims, const metal_cpu::Ids& metal_cpu_ids) {",
                *_template_lines(template),
                *params,
                *attrs,
                "  {",
                self.source,
                "  }",
                "}",
                _LAUNCH,
            ]
        )

    def __call__(
        self,
        *,
        inputs: list[mx.array],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: list[tuple[str, Any]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream=None,
    ) -> list[mx.array]:
        if len(inputs) != len(self.input_names) or len(output_shapes) != len(self.output_names):
            raise ValueError(f"kernel {self.name}: inputs/outputs do not match its names")
        if any(t < 1 for t in threadgroup) or int(np.prod(threadgroup)) > MAX_THREADS_PER_GROUP:
            raise ValueError(f"kernel {self.name}: threadgroup {threadgroup} (1..{MAX_THREADS_PER_GROUP} threads)")
        mx.eval(inputs)
        arrays = []
        for x in inputs:
            if x.ndim == 0:
                raise NotImplementedError("the CPU harness takes array inputs, not scalars")
            if x.dtype == mx.bfloat16:
                x = x.view(mx.uint16)
            arrays.append(np.ascontiguousarray(np.array(x, copy=True)))
        outs = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            out = np.empty(tuple(shape), dtype=_C_TYPES[dtype][1])
            if init_value is None:
                out.view(np.uint8)[...] = POISON  # a read of what was never written shows
            elif dtype == mx.bfloat16:
                out[...] = np.array(mx.full(shape, init_value, dtype=mx.bfloat16).view(mx.uint16))
            else:
                out[...] = init_value
            outs.append(out)
        dtypes = [x.dtype for x in inputs] + list(output_dtypes)
        code = self._code(dtypes, template)
        if verbose:
            print(code)
        lib = _compile(code, self.name)
        shapes = [np.array(a.shape, dtype=np.int32) for a in arrays]
        strides = [np.array([s // a.itemsize for s in a.strides], dtype=np.int64) for a in arrays]

        def pointers(items):
            return (ctypes.c_void_p * max(len(items), 1))(*[i.ctypes.data for i in items])

        ndims = (ctypes.c_int * max(len(arrays), 1))(*[a.ndim for a in arrays])
        dims = (ctypes.c_uint32 * 6)(*grid, *threadgroup)
        err = ctypes.create_string_buffer(1024)
        with _LOCK:
            rc = lib.metal_cpu_launch(
                pointers(arrays + outs), pointers(shapes), pointers(strides), ndims, dims, err, len(err)
            )
        if rc != 0:
            raise KernelError(f"kernel {self.name}: {err.value.decode()}")
        results = []
        for out, dtype in zip(outs, output_dtypes):
            y = mx.array(out)
            results.append(y.view(mx.bfloat16) if dtype == mx.bfloat16 else y)
        return results


def cpu_metal_kernel(name, input_names, output_names, source, header="", **kwargs) -> CpuMetalKernel:
    """``mx.fast.metal_kernel``'s signature, for kernel modules that build with either."""
    return CpuMetalKernel(name, input_names, output_names, source, header, **kwargs)
